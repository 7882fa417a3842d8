"""`posttrain run` / `posttrain train` give XLA's CPU backend the memory-minimising
scheduler (trainer/posttrain/trainer/cpu_flags.py), under which a rematerialised step
keeps what remat promises (tests/trainer/test_capacity_xla.py compiles it so), without
overriding a scheduler the user chose."""

from __future__ import annotations

import pytest

from posttrain.trainer import cpu_flags

pytestmark = pytest.mark.trainer


@pytest.mark.parametrize(
    "before, after",
    [
        (None, cpu_flags.MEMORY_SCHEDULER),
        (
            "--xla_force_host_platform_device_count=4",
            f"--xla_force_host_platform_device_count=4 {cpu_flags.MEMORY_SCHEDULER}",
        ),
        (
            "--xla_cpu_enable_concurrency_optimized_scheduler=true",
            "--xla_cpu_enable_concurrency_optimized_scheduler=true",
        ),
    ],
)
def test_apply_adds_the_memory_scheduler_unless_one_is_set(before, after):
    env = {} if before is None else {"XLA_FLAGS": before}
    assert cpu_flags.apply(env) == after and env["XLA_FLAGS"] == after


def test_the_trainer_entry_points_apply_it(monkeypatch):
    """`posttrain run` and `posttrain train` (main._run) set XLA_FLAGS, and for a CPU job
    glibc's thresholds, before JAX's backend starts: before pathways.initialize, stopped
    here."""
    from posttrain.trainer import main

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    seen = {}

    def stop(*args, **kwargs):
        import os

        seen["flags"] = os.environ.get("XLA_FLAGS")
        raise SystemExit(0)

    monkeypatch.setattr("posttrain.trainer.pathways.initialize", stop)
    monkeypatch.setattr(
        "posttrain.trainer.host_malloc.return_freed_memory", lambda: seen.setdefault("malloc", 1)
    )
    from types import SimpleNamespace

    def job(accelerator):
        return SimpleNamespace(
            spec=SimpleNamespace(resources=SimpleNamespace(accelerator=accelerator), grpo=None)
        )

    with pytest.raises(SystemExit):
        main._run(job("cpu"), show_bar=False)
    assert seen == {"flags": cpu_flags.MEMORY_SCHEDULER, "malloc": 1}
    seen.clear()
    with pytest.raises(SystemExit):  # an accelerator job's arrays are on its devices
        main._run(job("v6e-8"), show_bar=False)
    assert seen == {"flags": cpu_flags.MEMORY_SCHEDULER}


def test_a_disaggregated_cpu_job_gets_the_devices_its_placement_asks_for():
    """A CPU GRPO job with a disaggregated sampler needs several host devices; the user
    no longer sets XLA_FLAGS=--xla_force_host_platform_device_count=N for it."""
    from invalid_jobs import valid_job

    from posttrain.checks import validate

    def spec(fraction=None, accelerator="cpu"):
        doc = valid_job()
        doc["spec"]["technique"] = "grpo"
        doc["spec"]["resources"] = {"accelerator": accelerator}
        doc["spec"]["grpo"] = {"rewards": [{"type": "exactAnswer"}]}
        if fraction is not None:
            rollout = {"placement": "disaggregated", "samplerFraction": fraction}
            doc["spec"]["grpo"]["rollout"] = rollout
        job, errors = validate(doc)
        assert not errors, errors
        return job.spec

    assert cpu_flags.host_devices(spec(0.5)) == 2
    assert cpu_flags.host_devices(spec(0.25)) == 4
    assert cpu_flags.host_devices(spec(0.75)) == 4
    assert cpu_flags.host_devices(spec()) is None  # colocated: one device
    env = {"XLA_FLAGS": cpu_flags.MEMORY_SCHEDULER}
    assert cpu_flags.apply_devices(spec(0.5), env) == 2
    assert env["XLA_FLAGS"].split() == [
        cpu_flags.MEMORY_SCHEDULER, "--xla_force_host_platform_device_count=2"
    ]  # fmt: skip
    mine = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert cpu_flags.apply_devices(spec(0.5), mine) is None  # the user's count wins
    assert mine == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


_RETAINED = """
import sys
import numpy as np
from posttrain.trainer import host_malloc
if sys.argv[1] == "on":
    assert host_malloc.return_freed_memory()
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
big = np.ones((16 << 20) // 8)
del big  # glibc's default: the mmap threshold rises to 16 MiB
blocks = [np.ones((2 << 20) // 8) for _ in range(100)]  # 200 MiB in 2 MiB buffers
last = blocks[-1]
before = rss_mib()
del blocks  # all freed but the newest, which pins the heap's top
print(before - rss_mib())
"""


def test_freed_buffers_go_back_to_the_system():
    """Step-sized buffers freed after a larger one: with glibc's defaults they came from
    the heap and stay with the process; with return_freed_memory they are returned."""
    import subprocess
    import sys

    released = {}
    for mode in ("off", "on"):
        proc = subprocess.run(
            [sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        released[mode] = float(proc.stdout.split()[-1])
    assert released["on"] > 150 and released["off"] < 50, released


_ARENAS = """
import ctypes, re, sys, tempfile, threading
from posttrain.trainer import host_malloc
if sys.argv[1] == "on":
    assert host_malloc.return_freed_memory()
held, ready = [], threading.Barrier(9)
def work():  # each thread mallocs while the others are alive
    held.append(bytearray(200_000))
    ready.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
ready.wait()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fclose.argtypes = (ctypes.c_void_p,)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
with tempfile.NamedTemporaryFile("r") as out:  # malloc_info: an XML report, a heap per arena
    fp = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(len(re.findall("<heap nr=", out.read())))
"""


def test_threads_share_two_arenas():
    """Every thread that allocates gets an arena of its own under glibc's defaults (up
    to eight a core), each keeping its freed blocks; return_freed_memory caps them."""
    import subprocess
    import sys

    arenas = {}
    for mode in ("off", "on"):
        proc = subprocess.run(
            [sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        arenas[mode] = int(proc.stdout.split()[-1])
    from posttrain.trainer import host_malloc

    assert arenas["on"] <= host_malloc.ARENAS < arenas["off"], arenas


def test_the_user_s_malloc_settings_win(monkeypatch):
    from posttrain.trainer import host_malloc

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert host_malloc.return_freed_memory() is False
