"""Multi-host training on one machine: 2 processes x 2 CPU devices with jax.distributed,
configured through the same environment variables the renderer puts into JobSet pods,
match the loss curve of 1 process x 4 devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tb_events import scalars
from tiny_model import make_tiny_llama

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp: Path, model: Path, out: Path) -> Path:
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "multihost"},
        "spec": {
            "model": {"source": str(model), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8},
            "data": {"source": str(ROOT / "examples/data/chat-sft.jsonl"), "maxLength": 64},
            "training": {"steps": 6, "batchSize": 8, "learningRate": 0.01, "logEverySteps": 1},
            "checkpoint": {"everySteps": 3},
            "output": {"uri": str(out)},
        },
    }
    path = tmp / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "POSTTRAIN_JOB"))}
    return {
        **env,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        **extra,
    }


def test_two_processes_match_one(tmp_path: Path):
    model = make_tiny_llama(tmp_path / "model")
    single = _job(tmp_path, model, tmp_path / "single")
    multi = _job(tmp_path, model, tmp_path / "multi")
    cmd = [sys.executable, "-m", "posttrain.cli", "run"]
    one = subprocess.Popen(
        [*cmd, str(single)],
        env=_env(4),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    port = _port()
    # What a 2-host slice pod gets from the rendered JobSet (see posttrain.render.jobset).
    pod_env = {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": "2",
        "POSTTRAIN_JOB_INDEX": "0",
        "POSTTRAIN_PODS_PER_JOB": "2",
    }
    hosts = [
        subprocess.Popen(
            [*cmd, str(multi)],
            env=_env(2, **pod_env, JOB_COMPLETION_INDEX=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in [one, *hosts]]
    for proc, log in zip([one, *hosts], logs, strict=True):
        assert proc.returncode == 0, log
    assert "process 1 of 2" in logs[2]
    a = scalars(tmp_path / "single" / "tensorboard")["train/loss"]
    b = scalars(tmp_path / "multi" / "tensorboard")["train/loss"]
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), (step, a, b)
    assert a[6] < a[1]
    assert (tmp_path / "multi" / "hf" / "adapter_model.safetensors").exists()
