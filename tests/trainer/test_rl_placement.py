"""The asynchronous rollout schedule (rl_placement.AsyncRollouts) and the loader the
sampler reads ahead of the loop (rl_placement.Lookahead), with stand-ins for sampling:
which policy version samples each step, that no step trains on a rollout more than
maxStaleness versions old, and that a resumed schedule is the uninterrupted one's."""

from __future__ import annotations

import threading

import pytest

from posttrain.trainer import rl_placement

pytestmark = pytest.mark.trainer


class Loader:
    def __init__(self):
        self.position = 0

    def __next__(self):
        self.position += 1
        return {"row": self.position - 1}

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = state["position"]


def schedule(k: int, every: int, total: int, start: int = 0):
    """Run the learner's side of the pipeline; (step, version of its rollout, rows)."""
    version = [start]  # the learner's version: updates applied
    sampled = []

    def generate(step, batch, snapshot):
        sampled.append((step, snapshot))
        return {"row": batch["row"], "snapshot": snapshot}

    rollouts = rl_placement.AsyncRollouts(
        max_staleness=k,
        every_steps=every,
        total_steps=total,
        snapshot=lambda: version[0],
        generate=generate,
        lock=threading.Lock(),
    )
    loader = rl_placement.Lookahead(Loader())
    loader.set_state({"position": start})
    out = []
    for index in range(start, total):
        batch = next(loader)

        def batch_at(step, index=index, batch=batch):
            return batch if step == index else loader.peek(step - index)

        if rollouts.start is None:
            rollouts.begin(index, batch_at)
        rolled, v = rollouts.take(index)
        assert rolled["snapshot"] == v  # sampled with the weights of its own version
        out.append((index, v, rolled["row"]))
        version[0] += 1  # the update
        rollouts.submit_due(version[0], batch_at)
    rollouts.close()
    return out, loader


def test_versions_lag_by_at_most_k_and_restart_at_checkpoints():
    out, _ = schedule(k=2, every=4, total=10)
    assert [v for _, v, _ in out] == [0, 0, 0, 1, 4, 4, 4, 5, 8, 8]
    assert all(0 <= step - v <= 2 for step, v, _ in out)
    assert [row for _, _, row in out] == list(range(10))  # each step its own batch


def test_on_policy_and_resumed_schedules():
    out, _ = schedule(k=0, every=1000, total=5)
    assert [v for _, v, _ in out] == [0, 1, 2, 3, 4]
    whole, _ = schedule(k=2, every=4, total=10)
    resumed, _ = schedule(k=2, every=4, total=10, start=4)
    assert resumed == whole[4:]


def test_a_rollout_older_than_max_staleness_is_refused():
    rollouts = rl_placement.AsyncRollouts(
        max_staleness=1,
        every_steps=100,
        total_steps=10,
        snapshot=lambda: None,
        generate=lambda step, batch, snap: {},
        lock=threading.Lock(),
    )
    rollouts.begin(0, lambda step: {})
    rollouts.take(0)
    rollouts.submit_due(1, lambda step: {})  # steps 1 and 2 at version 1
    rollouts.take(1)
    with pytest.raises(AssertionError, match="the rollout of step 3 missed its version"):
        rollouts.submit_due(3, lambda step: {})  # the learner skipped version 2
    rollouts.close()


def test_lookahead_checkpoints_the_loops_position_not_the_samplers():
    loader = rl_placement.Lookahead(Loader())
    assert next(loader) == {"row": 0}
    assert loader.peek(2) == {"row": 2}  # read ahead for the sampler
    assert loader.get_state() == {"position": 1}  # what the loop has taken
    assert next(loader) == {"row": 1}
    assert loader.get_state() == {"position": 2}
    loader.set_state({"position": 1})
    assert next(loader) == {"row": 1}


def test_split_of_the_devices_a_process_sees():
    from posttrain.checks import validate

    def spec(fraction):
        doc = {
            "apiVersion": "posttrain.dev/v1alpha1",
            "kind": "PostTrainJob",
            "metadata": {"name": "split"},
            "spec": {
                "technique": "grpo",
                "model": {"source": "/models/tiny"},
                "data": {"source": "/data/x.jsonl"},
                "grpo": {
                    "rewards": [{"type": "exactAnswer"}],
                    "rollout": {"placement": "disaggregated", "samplerFraction": fraction},
                },
                "output": {"uri": "/out"},
            },
        }
        job, errors = validate(doc)
        assert not errors, errors
        return job.spec

    devices = [f"d{i}" for i in range(8)]
    trainer, sampler = rl_placement.split_devices(spec(0.25), devices)
    assert trainer == devices[:6] and sampler == devices[6:]
    with pytest.raises(ValueError, match="spec.grpo.rollout.samplerFraction: the job has a single"):
        rl_placement.split_devices(spec(0.5), devices[:1])
    with pytest.raises(ValueError, match=r"0.3 of the job's 8 devices is 2.4 devices"):
        rl_placement.split_devices(spec(0.3), devices)
