"""The trainer's start-up device check (posttrain.trainer.device_check): simulated device
lists for each accelerator kind, then the real check on this machine's CPU JAX."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from posttrain.api.spec import USER_ERROR_EXIT_CODE
from posttrain.checks import load_job
from posttrain.trainer import device_check
from posttrain.trainer.device_check import CRASH_EXIT_CODE, Expected, diagnose, expected

GOLDEN = Path(__file__).parent.parent / "golden" / "jobs"


@dataclass(frozen=True)
class Dev:
    platform: str
    device_kind: str


def devs(n: int, platform: str = "tpu", kind: str = "TPU v6 lite") -> list[Dev]:
    return [Dev(platform, kind) for _ in range(n)]


def job(accelerator: str, **resources):
    j = load_job(GOLDEN / "cpu.yaml")
    j.spec.resources.accelerator = accelerator
    for k, v in resources.items():
        setattr(j.spec.resources, k, v)
    return j


@pytest.mark.parametrize(
    "accelerator, resources, pathways, want",
    [
        ("v6e-16", {}, False, Expected("tpu", 4, 16)),
        ("v6e-16", {"slices": 2}, False, Expected("tpu", 4, 32)),
        ("v6e-256", {"slices": 2}, True, Expected("tpu", None, 512, True)),
        ("v5p-128", {}, False, Expected("tpu", 4, 64)),  # megacore: a device per chip
        ("tpu7x-128", {}, False, Expected("tpu", 8, 128)),  # a device per TensorCore
        ("v5e-8", {}, False, Expected("tpu", 4, 8)),
        ("v6e-8", {"machine_type": "ct6e-standard-8t"}, False, Expected("tpu", 8, 8)),
        ("nvidia-h100-80gb", {"nodes": 2}, False, Expected("gpu", 8, 16)),
        ("nvidia-l4", {"gpus_per_node": 2}, False, Expected("gpu", 2, 2)),
        ("cpu", {}, False, Expected("cpu", None, None)),
    ],
)
def test_expected_devices(accelerator, resources, pathways, want):
    assert expected(job(accelerator, **resources), pathways) == want


def everything_installed(_: str) -> bool:
    return True


@pytest.mark.parametrize(
    "want, local, total, fragment",
    [
        (Expected("tpu", 4, 16), devs(1, "cpu", "cpu"), 4, "JAX sees 1 x cpu (cpu)"),
        (Expected("tpu", 4, 16), devs(8), 32, "JAX sees 8 x tpu (TPU v6 lite) in this process"),
        (Expected("tpu", 4, 16), devs(4), 12, "12 tpu devices in all, the job was given 16"),
        (Expected("gpu", 8, 16), devs(7, "gpu", "NVIDIA H100 80GB HBM3"), 14, "given 8 per"),
        (Expected("gpu", 8, 16), [], 0, "JAX sees no devices"),
        (Expected("tpu", None, 512, True), devs(256), 256, "256 tpu devices in all"),
    ],
)
def test_wrong_devices_crash_naming_image_and_what_jax_found(want, local, total, fragment):
    err = diagnose(want, "r.example/t:1-tpu", lambda: (local, total), everything_installed)
    assert err is not None and err.exit_code == CRASH_EXIT_CODE  # the JobSet retries
    assert str(err).startswith("image r.example/t:1-tpu: ") and fragment in str(err), err


@pytest.mark.parametrize(
    "want, local, total",
    [
        (Expected("tpu", 4, 16), devs(4), 16),
        (Expected("gpu", 8, 16), devs(8, "gpu", "NVIDIA H100 80GB HBM3"), 16),
        (Expected("tpu", None, 512, True), devs(512), 512),
        (Expected("cpu", None, None), devs(8, "cpu", "cpu"), 8),
    ],
)
def test_the_devices_given_pass(want, local, total):
    assert diagnose(want, "img", lambda: (local, total), everything_installed) is None


@pytest.mark.parametrize("kind, arg", [("tpu", "tpu"), ("gpu", "cuda12")])
def test_image_without_the_backend_is_a_user_error(kind, arg):
    """A CPU-only image for a TPU or GPU job fails the JobSet at once: no restart helps."""

    def no_devices():
        raise AssertionError("JAX is not asked when the backend is missing")

    err = diagnose(Expected(kind, 8, 8), "r.example/t:1", no_devices, lambda _: False)
    assert err is not None and err.exit_code == USER_ERROR_EXIT_CODE
    assert "image r.example/t:1 has no JAX" in str(err)
    assert f"--build-arg ACCELERATOR={arg}" in str(err)


def test_pathways_client_needs_no_local_backend():
    want = Expected("tpu", None, 16, True)
    assert diagnose(want, "img", lambda: (devs(16), 16), lambda _: False) is None


def test_backend_that_does_not_start_is_a_crash():
    def broken():
        raise RuntimeError("Unable to initialize backend 'cuda': no supported devices found")

    err = diagnose(Expected("gpu", 8, 8), "img", broken, everything_installed)
    assert err is not None and err.exit_code == CRASH_EXIT_CODE
    assert "could not start its GPU backend on this node: Unable to initialize" in str(err)


def test_real_cpu_jax(monkeypatch):
    """This machine's JAX: a CPU job passes, a GPU job on this (CPU-only) install stops."""
    monkeypatch.setenv("POSTTRAIN_IMAGE", "r.example/t:1")
    device_check.check(job("cpu"))
    if device_check.has_backend("gpu", device_check._installed):
        pytest.skip("this machine has a CUDA JAX plugin")
    with pytest.raises(device_check.DeviceMismatch, match="image r.example/t:1 has no JAX GPU"):
        device_check.check(job("nvidia-h100-80gb"))


def test_posttrain_train_stops_before_training(tmp_path):
    """`posttrain train` in a pod of a GPU job, on a CPU-only image: exit 65 and one line
    naming the image, before any model is read."""
    config = tmp_path / "job.yaml"
    text = (GOLDEN / "h200-2-nodes.yaml").read_text().replace("nodes: 2", "nodes: 1")
    config.write_text(text.replace("batchSize: 16", "batchSize: 8"))
    env = {**os.environ, "POSTTRAIN_IMAGE": "r.example/t:1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "train", "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == USER_ERROR_EXIT_CODE, proc.stderr[-3000:]
    assert "posttrain: image r.example/t:1 has no JAX GPU backend" in proc.stderr
