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
