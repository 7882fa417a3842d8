"""GRPO with a disaggregated sampler and asynchronous rollouts, on 8 CPU devices in one
process (the Pathways programming model: one controller sees every device), in a
subprocess (grpo_placement_check.py: XLA_FLAGS must come before jax).

Holds: the sampler's arrays live only on the sampler's devices and the trainer's only on
the trainer's; the trainer rematerialises (remat layer) and the sampler's copy does not;
a weight sync moves only the trainable (LoRA) params; rollout and train step run at the
same time (their wall-clock intervals overlap); no rollout is older than maxStaleness
versions; a run killed after a checkpoint and resumed ends bitwise where the
uninterrupted run ended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_model import make_tiny_llama

pytestmark = pytest.mark.trainer

HERE = Path(__file__).parent


def test_disaggregated_async_grpo_on_eight_devices(tmp_path, compilation_cache):
    model = make_tiny_llama(tmp_path / "model")
    prompts = tmp_path / "say.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) + "\n" for n in range(10))
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "grpo_placement_check.py"),
            str(model),
            str(prompts),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, proc.stderr[-5000:]
    result = json.loads(line[len("RESULT") :])
    p = result["placement"]
    print("\nplacement:", {k: v for k, v in p.items() if "intervals" not in k})

    trainer, sampler = set(p["trainer_devices"]), set(p["sampler_devices"])
    assert len(trainer) == 6 and len(sampler) == 2 and not trainer & sampler  # 0.25 of 8
    assert set(p["policy_on"]) <= trainer and set(p["optimizer_on"]) <= trainer
    assert set(p["sampler_model_on"]) == sampler
    # The trainer rematerialises (remat layer); Tunix's sampler cannot, its copy does not.
    assert p["policy_remat"] == ["DECODER"] and p["sampler_remat"] == ["NONE"]
    # A weight sync moves the adapters only, onto the sampler's devices.
    assert set(p["snapshot_on"]) <= sampler
    assert p["snapshot_leaves"] == p["lora_leaves"] < p["param_leaves"]
    assert p["snapshot_bytes"] < p["model_bytes"] / 2
    assert p["sampler_lora_is_trainer_lora"]
    # maxStaleness 1: step 0 on-policy, then each step trains on the previous version's
    # rollouts, sampled while the previous step trained.
    assert p["staleness"] == [0, 1, 1, 1]
    assert p["overlap_seconds"] > 0, (p["rollout_intervals"], p["train_intervals"])
    m = p["metrics"]
    assert 0 < m["sampler_busy"] <= 1 and 0 < m["learner_busy"] <= 1
    assert m["weight_sync_seconds"] > 0

    r = result["resume"]
    print("resume:", r)
    assert r["first_step"] == 4 and r["resumed_from"] == 2 and r["step"] == 4
    assert r["bitwise"] and r["evals"] == [0, 2, 4]
    # On-policy again at each checkpoint step (2), one version behind otherwise.
    assert r["staleness"] == [0, 1, 0, 1]
    assert len(r["prompts_drawn"]) == 4  # DAPO's dynamic sampling ran every step
    # The sampler's log-probs are the trainer's: where a step trains on its own version's
    # rollouts the behaviour weight (pi_current / pi_sampler, mean over tokens) is 1.
    for stale, weight in zip(r["staleness"], r["behaviour_weight"], strict=True):
        assert abs(weight - 1) < 1e-3 if stale == 0 else 0 < weight <= 2, r
