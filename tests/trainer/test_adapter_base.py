"""An exported adapter names its base model so that it loads on another machine
(trainer/posttrain/trainer/adapter_base.py): the Hub id of an hf:// source, the gs:// URI,
a local path as the job gave it, or what `posttrain export --base` names; its README.md
says how to load it elsewhere.

The peft cross-check (AutoPeftModelForCausalLM in another directory, with the base moved)
runs torch and peft in their own venv: `make torch-venv` (.cache/torch-venv; `make test`
and CI make it), or POSTTRAIN_TORCH_PYTHON. Without it the check is skipped, except in CI
(CI set), where it fails."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from tiny_job import run_job, tiny_job
from tiny_model import make_tiny_llama

from posttrain import cli
from posttrain.trainer import generate, models
from posttrain.trainer.adapter_base import BaseModel, base_model, model_card

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "chat-sft.jsonl"
TORCH_PYTHON = Path(os.environ.get("POSTTRAIN_TORCH_PYTHON", ROOT / ".cache/torch-venv/bin/python"))
IDS = [[5, 17, 42, 7, 99, 3]]


@pytest.mark.parametrize(
    "source, base, named",
    [
        (
            "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
            None,
            ("HuggingFaceTB/SmolLM2-135M-Instruct", None, "hub"),
        ),
        ("hf://org/name@v1.0", None, ("org/name", "v1.0", "hub")),
        ("gs://models/qwen3", None, ("gs://models/qwen3", None, "gcs")),
        ("relative/model", None, ("./relative/model", None, "path")),
        ("a/relative/model", None, ("a/relative/model", None, "path")),
        ("/abs/model", None, ("/abs/model", None, "path")),
        ("/abs/model", "org/name", ("org/name", None, "hub")),
        ("/abs/model", "hf://org/name@main", ("org/name", "main", "hub")),
        ("/abs/model", "./org/name", ("./org/name", None, "path")),
        ("/abs/model", "/elsewhere/model", ("/elsewhere/model", None, "path")),
    ],
)
def test_base_model_is_what_identifies_it_anywhere(source, base, named):
    assert base_model(source, base) == BaseModel(*named)


def test_an_empty_base_is_refused():
    with pytest.raises(ValueError, match="^--base: an empty base model name$"):
        base_model("/abs/model", " ")


def test_the_card_says_how_each_kind_of_base_loads():
    hub = model_card(base_model("hf://org/name@v2"), "hf://org/name@v2")
    assert "base_model: org/name" in hub and "at revision `v2`" in hub
    assert 'AutoPeftModelForCausalLM.from_pretrained("ADAPTER_DIR")' in hub
    gcs = model_card(base_model("gs://b/m"), "gs://b/m")
    assert "base_model:" not in gcs and "cannot load this base" in gcs
    assert "PeftModel.from_pretrained(base" in gcs and "--base" in gcs


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step LoRA run whose spec.model.source is the relative path models/base (run
    from its root directory); returns that directory (job.yaml, models/base, out/)."""
    root = tmp_path_factory.mktemp("portable")
    make_tiny_llama(root / "models" / "base")
    doc = tiny_job("models/base", DATA, "out", steps=2, every=2)
    (root / "job.yaml").write_text(yaml.safe_dump(doc))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        run_job(doc)
    finally:
        os.chdir(cwd)
    return root


def _config(adapter: Path) -> dict:
    return json.loads((adapter / "adapter_config.json").read_text())


def test_a_local_base_is_named_as_the_job_gave_it(trained):
    adapter = trained / "out" / "hf"
    cfg = _config(adapter)
    assert cfg["base_model_name_or_path"] == "./models/base" and cfg["revision"] is None
    card = (adapter / "README.md").read_text()
    assert "`./models/base`" in card and "relative to the directory the job ran in" in card
    assert "posttrain export JOB.yaml --base" in card
    assert "base_model:" not in card  # the Hub's metadata names only Hub ids


def _peft_logits(adapter: Path, cwd: Path) -> np.ndarray:
    """AutoPeftModelForCausalLM.from_pretrained(adapter) run from `cwd`: its logits of IDS."""
    script = (
        "import json, sys, torch\n"
        "from peft import AutoPeftModelForCausalLM\n"
        "model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "with torch.no_grad():\n"
        "    out = model(torch.tensor(json.loads(sys.argv[2]))).logits\n"
        "print('LOGITS' + json.dumps(out.float().numpy().tolist()))\n"
    )
    proc = subprocess.run(
        [str(TORCH_PYTHON), "-c", script, str(adapter), json.dumps(IDS)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("LOGITS")), None)
    assert line, proc.stderr[-3000:]
    return np.asarray(json.loads(line[len("LOGITS") :]), np.float32)


@pytest.fixture(scope="module")
def moved(trained, tmp_path_factory) -> tuple[Path, np.ndarray]:
    """`posttrain export job.yaml --step 2 --base COPY` naming a copy of the base on
    "machine b", the adapter copied there too; returns the adapter and the trained model's
    logits of IDS."""
    machine_b = tmp_path_factory.mktemp("machine-b")
    copy = machine_b / "base"
    shutil.copytree(trained / "models" / "base", copy)
    cwd = os.getcwd()
    os.chdir(trained)
    try:
        model, _ = generate.load("out/hf", machine_b / "scratch")
        assert cli.main(["export", "job.yaml", "--step", "2", "--base", str(copy)]) == 0
    finally:
        os.chdir(cwd)
    exported = trained / "out" / "hf-step-2"
    assert _config(exported)["base_model_name_or_path"] == str(copy)
    assert f"`{copy}`" in (exported / "README.md").read_text()
    shutil.copytree(exported, machine_b / "adapter")
    return machine_b / "adapter", np.asarray(models.forward(model, np.asarray(IDS)))


@contextlib.contextmanager
def base_gone(trained: Path):
    """The job's own base model moved away for the duration."""
    (trained / "models" / "base").rename(trained / "models" / "away")
    try:
        yield
    finally:
        (trained / "models" / "away").rename(trained / "models" / "base")


def test_exported_with_base_it_loads_from_another_directory_and_base_location(
    trained, moved, tmp_path, monkeypatch, capsys
):
    """The adapter exported with --base, moved to another directory and loaded from a
    third with the job's base gone, gives the trained model's logits; the first export,
    which names the job's relative path, says in one line how to name the base."""
    adapter, want = moved
    monkeypatch.chdir(tmp_path)
    with base_gone(trained):
        model, tokenizer = generate.load(str(adapter), tmp_path / "scratch")
        logits = np.asarray(models.forward(model, np.asarray(IDS)))
        np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
        assert tokenizer.origin == str(adapter)  # the adapter carries the tokenizer
        capsys.readouterr()
        code = cli.main(["generate", str(trained / "out" / "hf"), "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 65
    assert "base model ./models/base is not a directory here" in err and "--base PATH" in err


def test_peft_loads_it_from_another_directory_and_base_location(trained, moved, tmp_path):
    """AutoPeftModelForCausalLM.from_pretrained(ADAPTER) from another directory, the job's
    base gone: peft finds the base the adapter names and gives the trained logits."""
    if not TORCH_PYTHON.is_file():
        missing = f"needs torch and peft: {TORCH_PYTHON} (make torch-venv)"
        pytest.fail(missing) if os.environ.get("CI") else pytest.skip(missing)
    adapter, want = moved
    with base_gone(trained):
        np.testing.assert_allclose(_peft_logits(adapter, tmp_path), want, atol=1e-4, rtol=0)


def test_base_is_refused_for_a_merged_export(trained, monkeypatch, capsys):
    monkeypatch.chdir(trained)
    code = cli.main(["export", "job.yaml", "--format", "merged", "--base", "org/name"])
    assert code == 65
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "posttrain: --base: only an adapter export names a base model (this export is merged)"
    )
