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
    """`posttrain run` and `posttrain train` (main._run) set XLA_FLAGS before JAX's
    backend starts: before pathways.initialize, stopped here."""
    from posttrain.trainer import main

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    seen = {}

    def stop(*args, **kwargs):
        import os

        seen["flags"] = os.environ.get("XLA_FLAGS")
        raise SystemExit(0)

    monkeypatch.setattr("posttrain.trainer.pathways.initialize", stop)
    with pytest.raises(SystemExit):
        main._run(None, show_bar=False)
    assert seen["flags"] == cpu_flags.MEMORY_SCHEDULER
