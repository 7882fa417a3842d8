"""Multi-host training on one machine: 2 processes x 2 CPU devices with jax.distributed,
configured through the same environment variables the renderer puts into JobSet pods,
match the loss curve of 1 process x 4 devices. The 2 processes read the model from and
write their checkpoints to gs:// (a real GCS-compatible server), and resume from there
bitwise identically. As 2 slices of one host each (the MEGASCALE_* variables of a
multi-slice JobSet; see posttrain.trainer.mesh), the 2 processes train data parallel
over the slices, each holding a whole model, and match the 1-process run too. Every run
holds out rows and evaluates them with sample generations, so in both layouts the 2 hosts
also decode together and must write the 1-process run's evaluation; that 1-process run is
made once for the module."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tb_events import scalars
from tiny_model import make_tiny_llama

from posttrain.trainer import storage
from tests.trainer.data_helpers import gcs_bucket

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp: Path, model: Path | str, out: Path | str, batch_size: int = 8,
         training: dict | None = None, **extra: dict) -> Path:  # fmt: skip
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "multihost"},
        "spec": {
            "model": {"source": str(model), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8},
            "data": {"source": str(ROOT / "examples/data/chat-sft.jsonl"), "maxLength": 64},
            "training": {
                "steps": 6,
                "batchSize": batch_size,
                "learningRate": 0.01,
                "logEverySteps": 1,
                **(training or {}),
            },
            "checkpoint": {"everySteps": 3},
            "output": {"uri": str(out)},
            **extra,
        },
    }
    path = tmp / f"{storage.basename(str(out))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_", "POSTTRAIN_JOB", "MEGASCALE_"))
        or "CACHE" in k  # keep the compile cache
    }
    return {
        **env,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        **extra,
    }


CMD = [sys.executable, "-m", "posttrain.cli", "run"]


def _run(job: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [*CMD, str(job)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _two_hosts(job: Path, slices: int = 1) -> list[subprocess.Popen]:
    # What the 2 pods of a job get from the rendered JobSet (see posttrain.render.jobset):
    # 1 slice of 2 hosts, or 2 slices of 1 host with the MEGASCALE_* of a multi-slice job.
    hosts = 2 // slices
    pod_env = {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_port()}",
        "JAX_NUM_PROCESSES": "2",
        "POSTTRAIN_PODS_PER_JOB": str(hosts),
    }
    procs = []
    for process in range(2):
        job_index, index = divmod(process, hosts)
        env = {**pod_env, "POSTTRAIN_JOB_INDEX": str(job_index), "JOB_COMPLETION_INDEX": str(index)}
        if slices > 1:
            env.update(MEGASCALE_NUM_SLICES=str(slices), MEGASCALE_SLICE_ID=str(job_index))
        procs.append(_run(job, _env(2, **env)))
    return procs


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log
    return logs


# Held-out evaluation with sample generations: the 2 hosts decode together.
EVALUATION = {"eval": {"fraction": 0.1, "maxBatches": 1, "samples": 2, "maxNewTokens": 4}}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("multihost") / "model")


class _Single:
    """The 1 process x 4 devices run that both 2-process layouts must match; it trains
    while the first test's hosts do, and that test waits for it."""

    def __init__(self, tmp: Path, model: Path):
        self.out = tmp / "single"
        self._proc = _run(_job(tmp, model, self.out, **EVALUATION), _env(4))
        self._log: str | None = None

    def log(self) -> str:
        if self._log is None:
            self._log = _finish([self._proc])[0]
        return self._log

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()


@pytest.fixture(scope="module")
def single(model, tmp_path_factory):
    run = _Single(tmp_path_factory.mktemp("single"), model)
    yield run
    run.stop()


def test_two_processes_match_one(tmp_path: Path, model: Path, single: _Single):
    with gcs_bucket("ptmulti") as bucket:
        # The 2 hosts read the model from gs:// too, each only the blocks it holds.
        storage.upload_dir(model, f"{bucket}/model")
        multi_uri = f"{bucket}/multi"
        multi = _job(tmp_path, f"{bucket}/model", multi_uri, **EVALUATION)
        logs = _finish(_two_hosts(multi))
        assert "mesh dp=1 x fsdp=4 x tp=1" in single.log()
        for i, log in enumerate(logs):  # each host fetched its rows of the weights, none twice
            assert f"process {i} of 2" in log and "mesh dp=1 x fsdp=4 x tp=1" in log, log
            fetched, total = map(int, re.search(r"fetched (\d+) of the (\d+) bytes", log).groups())
            assert fetched < total, log
        multi_out = storage.download_dir(multi_uri, tmp_path / "multi")
        _assert_same_losses(single.out, multi_out)
        _assert_same_evaluations(single.out, multi_out)
        # Both hosts restart after step 3 and restore their shards from gs://.
        _assert_resumes_from_step_3(multi_uri, lambda: _two_hosts(multi))


def _assert_same_losses(single: Path, multi: Path) -> None:
    a = scalars(single / "tensorboard")["train/loss"]
    b = scalars(multi / "tensorboard")["train/loss"]
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), (step, a, b)
    assert a[6] < a[1]


def _assert_same_evaluations(single: Path, multi: Path) -> None:
    a, b = (json.loads((out / "eval.json").read_text()) for out in (single, multi))
    assert [e["step"] for e in a] == [e["step"] for e in b] == [6]
    for x, y in zip(a, b, strict=True):
        assert y["metrics"]["loss"] == pytest.approx(x["metrics"]["loss"], rel=1e-4)
        assert len(x["samples"]) == 2 and all(s["completion"] for s in x["samples"])
        assert y["samples"] == x["samples"]


def _assert_resumes_from_step_3(out: str, start) -> None:
    """Without step 6 and the export, the hosts `start` resume from step 3 and export the
    same adapter, bit for bit."""
    exported = storage.read_bytes(f"{out}/hf/adapter_model.safetensors")
    storage.delete(f"{out}/checkpoints/6", recursive=True)
    storage.delete(f"{out}/hf", recursive=True)
    logs = _finish(start())
    assert all("resumed from checkpoint step 3" in log for log in logs), logs
    assert storage.read_bytes(f"{out}/hf/adapter_model.safetensors") == exported


def test_two_slices_match_one(tmp_path: Path, model: Path, single: _Single):
    sliced = _job(tmp_path, model, tmp_path / "sliced", **EVALUATION)
    logs = _finish(_two_hosts(sliced, slices=2))
    assert "mesh dp=1 x fsdp=4 x tp=1" in single.log()
    for i, log in enumerate(logs):  # data parallel over the 2 slices, FSDP inside each
        assert f"process {i} of 2" in log and "mesh dp=2 x fsdp=2 x tp=1" in log, log
    _assert_same_losses(single.out, tmp_path / "sliced")
    _assert_same_evaluations(single.out, tmp_path / "sliced")
    # Each slice restores a whole replica of the checkpoint.
    _assert_resumes_from_step_3(str(tmp_path / "sliced"), lambda: _two_hosts(sliced, slices=2))


def test_two_hosts_scanning_their_layers_match_one_unrolling_them(
    tmp_path: Path, model: Path, single: _Single
):
    """spec.training.layerLoop: scan (what auto is on TPUs) on 2 hosts of 2 devices, FSDP
    over the 4: each host stacks its shards of the layers, trains, evaluates with a
    stacked KV cache, checkpoints and exports across the hosts as the unrolled run does,
    and resumes from its own checkpoint bit for bit."""
    scanned = _job(tmp_path, model, tmp_path / "scanned", training={"layerLoop": "scan"},
                   **EVALUATION)  # fmt: skip
    logs = _finish(_two_hosts(scanned))
    assert "decoder layers: unrolled" in single.log()
    for log in logs:
        assert "decoder layers: scanned" in log and "mesh dp=1 x fsdp=4 x tp=1" in log, log
    _assert_same_losses(single.out, tmp_path / "scanned")
    _assert_same_evaluations(single.out, tmp_path / "scanned")
    _assert_resumes_from_step_3(str(tmp_path / "scanned"), lambda: _two_hosts(scanned))


def test_a_batch_that_does_not_split_over_the_hosts_is_a_user_error(tmp_path: Path, model: Path):
    job = _job(tmp_path, model, tmp_path / "odd", batch_size=6)  # 6 rows, 4 devices
    procs = _two_hosts(job)
    for proc in procs:
        log = proc.communicate(timeout=600)[0]
        assert proc.returncode == 65, log
        assert "spec.training.batchSize: 6 rows per step do not split over the 4 devices" in log
