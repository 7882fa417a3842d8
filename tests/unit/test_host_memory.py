"""The host memory estimate of CPU jobs (operator/posttrain/host_memory.py) and
`posttrain estimate` on them; the measured peaks it is fitted to are in
docs/user-guide.md ("Running locally")."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from invalid_jobs import valid_job

from posttrain import capacity, catalog, host_memory
from posttrain.api.spec import PostTrainJobSpec

ROOT = Path(__file__).parent.parent.parent
SMOLLM2 = "/models/SmolLM2-135M-Instruct"  # a shape posttrain knows by name


def job(accelerator="cpu", source=SMOLLM2, **spec):
    """A LoRA job of 4 rows x 128 tokens, as the CPU examples are."""
    doc = valid_job()
    doc["spec"].update(
        model={"source": source, "dtype": "float32"},
        resources={"accelerator": accelerator},
        lora={"rank": 8, "alpha": 16},
        data={"source": "/d", "maxLength": 128},
        training={"batchSize": 4},
    )
    for key, value in spec.items():
        doc["spec"][key] = value
    return doc


def estimate(doc):
    s = PostTrainJobSpec.model_validate(doc["spec"])
    return host_memory.estimate(s, catalog.resolve(s.resources.accelerator, None))


def test_only_cpu_jobs_of_a_known_shape_get_one():
    assert estimate(job("v6e-8")) is None
    assert estimate(job(source="/models/tiny")) is None
    assert estimate(job()) is not None


def test_the_arrays_are_capacity_s_for_one_device_with_cpu_remat():
    """auto is none on CPU (the trainer's choice), not layer as on accelerators, and
    attention dense."""
    doc = job(data={"source": "/d", "maxLength": 256}, training={"batchSize": 8})
    est = estimate(doc)
    assert est.device.remat == "none" and est.device.layout.devices == 1
    s = PostTrainJobSpec.model_validate(doc["spec"])
    one_gpu = capacity.estimate(
        # dense attention, as on CPU (a GPU's auto is flash)
        s.model_copy(
            update={
                "training": s.training.model_copy(update={"remat": "none", "attention": "dense"})
            }
        ),
        catalog.resolve("nvidia-h100-80gb", None),
        capacity.Layout(1, 1),
    )
    assert est.device.terms == one_gpu.terms
    runtime = host_memory.RUNTIME_GIB + est.compile_gib
    assert est.total_gib == pytest.approx(runtime + est.arrays_gib)


def test_what_the_examples_change_lowers_it():
    """Halving maxLength halves the activations; remat layer keeps a fraction of them."""
    doc = job(data={"source": "/d", "maxLength": 256}, training={"batchSize": 8})
    base = estimate(doc)
    doc["spec"]["data"]["maxLength"] = 128
    short = estimate(doc)
    assert short.device.terms["activations"] < 0.55 * base.device.terms["activations"]
    doc["spec"]["training"]["remat"] = "layer"
    remat = estimate(doc)
    assert remat.device.terms["activations"] < 0.2 * short.device.terms["activations"]
    assert remat.total_gib < short.total_gib < base.total_gib


def test_the_loading_peak_counts_when_the_step_is_small():
    """Reading the checkpoint beside its weights, at the start, when the step's arrays
    are smaller than that."""
    est = estimate(job(data={"source": "/d", "maxLength": 16}, training={"batchSize": 1}))
    weights = est.device.terms["weights"]
    assert est.arrays_gib < weights + est.loading_gib
    assert est.total_gib == pytest.approx(
        host_memory.RUNTIME_GIB + est.compile_gib + weights + est.loading_gib
    )


def posttrain(*args):
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_posttrain_estimate_answers_for_cpu_jobs(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job()))
    out = posttrain("estimate", str(path))
    assert out.returncode == 0, out.stderr
    assert "host memory:" in out.stdout and out.stdout.strip().endswith("fits")
    for term in (*capacity.TERMS, "runtime", "compile", "loading", "peak"):
        assert f"  {term}" in out.stdout
    assert "remat none" in out.stdout and "this machine" in out.stdout
    path.write_text(yaml.safe_dump(job(resources={"accelerator": "cpu", "memory": "1Gi"})))
    over = posttrain("estimate", str(path))
    assert over.returncode == 1
    last = over.stdout.strip().splitlines()[-1]
    assert last.startswith("spec.resources.accelerator: the job needs about ")
    assert "more than spec.resources.memory's 1.0 GiB" in last
    path.write_text(yaml.safe_dump(job(source="/models/tiny")))
    unknown = posttrain("estimate", str(path))
    assert unknown.returncode == 0 and "no host memory estimate" in unknown.stdout


@pytest.mark.parametrize(
    "path", sorted((ROOT / "examples").glob("*-cpu.yaml")), ids=lambda p: p.name
)
def test_every_cpu_example_is_estimated_within_the_laptop_budget(path, monkeypatch):
    """The CPU examples are sized for a 4 GiB laptop budget (their measured peaks are in
    docs/user-guide.md)."""
    from posttrain.checks import load_job

    monkeypatch.chdir(ROOT)  # the examples' paths are relative to the repository root
    spec = load_job(str(path)).spec
    est = host_memory.estimate(spec, catalog.resolve("cpu", None))
    assert est is not None and est.total_gib <= 4.0, est and est.table()


def test_run_checks_the_estimate_against_this_machines_memory(monkeypatch):
    """`posttrain run` refuses, before anything loads, a job that needs more host memory
    than this machine has (by more than the estimate's band), warns within the band, and
    does not count a pod's spec.resources.memory on this machine; any accelerator job run
    here on CPU too."""
    monkeypatch.setattr(host_memory, "machine_memory_gib", lambda: 23.5)
    big = {"source": "/models/Llama-3.1-70B", "dtype": "float32"}

    def verdict(doc):
        return host_memory.on_this_machine(PostTrainJobSpec.model_validate(doc["spec"]))

    assert verdict(job()) == ("fit", None)
    said, why = verdict(job(model=big, resources={"accelerator": "cpu", "memory": "2Ti"}))
    assert said == "refuse" and why.startswith("spec.resources.accelerator: the job needs")
    assert "of this machine's 23.5 GiB" in why and "POSTTRAIN_SKIP_MEMORY_CHECK=1" in why
    assert verdict(job("v6e-8", model=big))[0] == "refuse"
    need = estimate(job()).total_gib
    monkeypatch.setattr(host_memory, "machine_memory_gib", lambda: need * 1.1)
    said, why = verdict(job())
    assert said == "warn" and "within the estimate's 25%" in why


def test_validate_warns_of_a_cpu_job_this_machine_cannot_hold(tmp_path, monkeypatch, capsys):
    from posttrain import cli

    monkeypatch.setattr(host_memory, "machine_memory_gib", lambda: 23.5)
    doc = job(model={"source": "/models/Llama-3.1-70B", "dtype": "float32"})
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert cli.main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"{path}: warning: posttrain run would refuse it here: spec.resources." in err
