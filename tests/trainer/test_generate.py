"""`posttrain generate`: the streamed decoding matches the cached greedy decoder, and a
trained job's adapter (or the job file itself) answers a prompt from any directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from tiny_model import make_tiny_llama

from posttrain import cli
from posttrain.checks import validate
from posttrain.trainer import generate, models
from posttrain.trainer.distributed import ProcessInfo
from posttrain.trainer.loop import train

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 4-step LoRA run of a tiny Llama; returns its job file."""
    root = tmp_path_factory.mktemp("gen")
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "tiny-gen"},
        "spec": {
            "model": {"source": str(make_tiny_llama(root / "llama")), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8},
            "data": {"source": str(ROOT / "examples/data/chat-sft.jsonl"), "maxLength": 64},
            "training": {"steps": 4, "batchSize": 8, "learningRate": 0.01},
            "output": {"uri": str(root / "out")},
        },
    }
    job, errors = validate(doc)
    assert not errors, errors
    train(job, ProcessInfo(None, 1, 0), show_bar=False)
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_stream_is_the_cached_greedy_decoder(tmp_path):
    model, _ = models.load_model(make_tiny_llama(tmp_path / "llama"))
    prompt = [5, 17, 42, 7]
    want = models.greedy_generate(model, None, prompt, 6).token_ids
    assert list(generate.stream(model, prompt, 6)) == want
    # Stops before an end-of-sequence token, which is not yielded.
    k = next(i for i in range(1, len(want)) if want[i] not in want[:i])
    assert list(generate.stream(model, prompt, 6, eos_token_ids=[want[k]])) == want[:k]
    # Sampling: reproducible by seed.
    a = list(generate.stream(model, prompt, 6, temperature=1.0, seed=1))
    assert a == list(generate.stream(model, prompt, 6, temperature=1.0, seed=1))
    assert np.all(np.asarray(a) >= 0)


def test_nothing_compiles_once_the_first_token_is_shown(tmp_path):
    """The decoding step compiles before the first token, so the reply then streams
    without the pause of a compile."""
    import logging

    import jax

    model, _ = models.load_model(make_tiny_llama(tmp_path / "llama"))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles():
            tokens = generate.stream(model, [3, 9, 11], 7)  # shapes no other test uses
            next(tokens)
            before = len(said)
            assert any("Compiling jit(next_logits)" in line for line in said)
            rest = list(tokens)
    finally:
        logging.getLogger("jax").removeHandler(handler)
    assert len(rest) == 6
    assert [line for line in said[before:] if line.startswith("Compiling")] == []


def posttrain_generate(target: str, cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """`posttrain generate TARGET --prompt ...` run from `cwd`: (exit code, stdout, stderr)."""
    monkeypatch.chdir(cwd)
    code = cli.main(["generate", target, "--prompt", "Hello?", "--max-new-tokens", "5"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_from_a_job_file_or_its_adapter_in_another_directory(
    trained, tmp_path, monkeypatch, capsys
):
    adapter = yaml.safe_load(trained.read_text())["spec"]["output"]["uri"] + "/hf"
    by_job = posttrain_generate(str(trained), tmp_path, monkeypatch, capsys)
    by_adapter = posttrain_generate(adapter, tmp_path, monkeypatch, capsys)
    assert by_job[0] == 0, by_job[2][-2000:]
    assert by_adapter[0] == 0, by_adapter[2][-2000:]
    assert by_job[1] == by_adapter[1] and by_job[1].strip()
    # What it does before the first token, on stderr (the reply alone is on stdout).
    assert by_job[2].splitlines()[:2] == [
        f"posttrain: loading {trained}",
        "posttrain: compiling, then the reply streams below",
    ], by_job[2]


def test_generate_names_what_it_cannot_load(tmp_path, monkeypatch, capsys):
    code, _, err = posttrain_generate(str(tmp_path / "nothing"), tmp_path, monkeypatch, capsys)
    assert code == 65
    assert err.strip().splitlines()[-1] == (
        f"posttrain: MODEL_OR_JOB: {tmp_path / 'nothing'}: no such file or directory"
    )


def test_generate_leaves_no_scratch_directory(trained, tmp_path, monkeypatch, capsys):
    import tempfile

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    code, out, err = posttrain_generate(str(trained), tmp_path, monkeypatch, capsys)
    assert code == 0 and out.strip(), err[-2000:]
    assert list(temp.iterdir()) == []


def test_generate_keeps_its_programs_in_the_machines_compilation_cache(tmp_path):
    """`posttrain generate` (as `run` and `export`) keeps what it compiles under
    ~/.cache/posttrain/jax, so the next call on this machine loads it instead."""
    import os
    import subprocess
    import sys

    model = make_tiny_llama(tmp_path / "llama")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(HOME=str(tmp_path / "home"), JAX_PLATFORMS="cpu")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tiny model compiles fast
    r = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "generate", str(model), "--prompt", "Hi",
         "--max-new-tokens", "2"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    cache = tmp_path / "home" / ".cache" / "posttrain" / "jax"
    assert any(p.name.endswith("-cache") for p in cache.iterdir()), list(cache.iterdir())


def test_train_and_export_leave_no_scratch_directory(tmp_path, monkeypatch):
    """A run, then `posttrain export` of its checkpoint: /tmp is as it was."""
    import tempfile

    from tiny_job import run_job, tiny_job

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    data = ROOT / "examples/data/chat-sft.jsonl"
    doc = tiny_job(make_tiny_llama(tmp_path / "llama"), data, tmp_path / "out", steps=1, every=1)
    assert run_job(doc).step == 1
    assert list(temp.iterdir()) == []
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert cli.main(["export", str(job), "--step", "1"]) == 0
    assert (tmp_path / "out" / "hf-step-1").is_dir()
    assert list(temp.iterdir()) == []
