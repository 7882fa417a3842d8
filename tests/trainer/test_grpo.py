"""GRPO on Tunix's RL stack, on CPU, with a tiny random Llama.

The task a tiny model can learn: "Say 7." -> "7". The model is first SFT'd a little on it
(loop.train, technique sft), then GRPO'd with an exactAnswer reward; its mean reward
rises. Also: exact resume with every reward type (LoRA, gspo-token, the reference being
the policy with adapters off), the reference handling per beta, host-local rollouts
(what several processes use) sampling exactly what the shared rollout samples, and 2
processes on localhost."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from tb_events import scalars
from tiny_job import assert_bitwise_equal
from tiny_model import make_tiny_llama

from posttrain.checks import validate
from posttrain.trainer.distributed import ProcessInfo
from posttrain.trainer.loop import train

pytestmark = pytest.mark.trainer


def ends_with_digit(prompts, completions, answer, **unused):
    """A user reward for the tests (spec.grpo.rewards[].function 'test_grpo:...')."""
    return [1.0 if c.strip()[-1:].isdigit() else 0.0 for c in completions]


@dataclass
class Task:
    root: Path
    model: Path  # the SFT'd tiny model (merged HF export)
    prompts: Path  # {"prompt": "Say 7.", "answer": "7"} rows


def _write_task(root: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    sft, prompts = root / "say-sft.jsonl", root / "say.jsonl"
    with sft.open("w") as f:
        for _ in range(200):
            n = rng.randint(0, 9)
            msgs = [
                {"role": "user", "content": f"Say {n}."},
                {"role": "assistant", "content": str(n)},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with prompts.open("w") as f:
        for _ in range(200):
            n = rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) + "\n")
    return sft, prompts


def job(spec: dict, name: str = "tiny-grpo"):
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": name},
        "spec": spec,
    }
    parsed, errors = validate(doc)
    assert not errors, errors
    return parsed


def run(spec: dict):
    return train(job(spec), ProcessInfo(None, 1, 0), show_bar=False)


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Task:
    """The tiny model SFT'd for 55 steps: it says the right digit about 40% of the time."""
    root = tmp_path_factory.mktemp("say")
    sft, prompts = _write_task(root)
    base = make_tiny_llama(root / "base")
    run(
        {
            "model": {"source": str(base), "dtype": "float32"},
            "data": {"source": str(sft), "maxLength": 48},
            "training": {
                "steps": 55,
                "batchSize": 16,
                "learningRate": 0.01,
                "schedule": "constant",
                "logEverySteps": 55,
            },
            "checkpoint": {"everySteps": 1000},
            "output": {"uri": str(root / "sft")},
        }
    )
    return Task(root, root / "sft" / "hf", prompts)


def grpo_spec(task: Task, out: Path, **over) -> dict:
    spec = {
        "technique": "grpo",
        "model": {"source": str(task.model), "dtype": "float32"},
        "data": {"source": str(task.prompts)},
        "training": {
            "steps": 30,
            "batchSize": 8,
            "learningRate": 0.002,
            "schedule": "constant",
            "logEverySteps": 1,
            "seed": 0,
        },
        "grpo": {
            "numGenerations": 4,
            "beta": 0.04,
            "maxPromptLength": 48,
            "maxCompletionLength": 4,
            "temperature": 1.0,
            "rewards": [{"type": "exactAnswer"}],
        },
        "checkpoint": {"everySteps": 1000},
        "output": {"uri": str(out)},
    }
    for key, value in over.items():
        spec[key] = value if not isinstance(value, dict) else {**spec.get(key, {}), **value}
    return spec


def series(out: Path, name: str) -> list[float]:
    values = scalars(out / "tensorboard")[f"train/{name}"]
    return [values[s] for s in sorted(values)]


def test_grpo_raises_the_mean_reward(task, tmp_path):
    """Full fine-tune, beta 0.04 against a frozen copy of the SFT'd model."""
    out = tmp_path / "out"
    held_out = tmp_path / "held-out.jsonl"  # prompts never trained on
    rng = random.Random(1)
    held_out.write_text(
        "".join(
            json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) + "\n"
            for n in (rng.randint(0, 9) for _ in range(16))
        )
    )
    spec = grpo_spec(task, out)
    spec["eval"] = {"source": str(held_out), "everySteps": 15, "samples": 0}
    result = run(spec)
    assert result.step == 30 and (out / "hf" / "model.safetensors").exists()
    held = {s: result.evals[s] for s in sorted(result.evals)}
    print(f"\nheld-out greedy mean reward / pass rate by step: {held}")
    assert sorted(held) == [0, 15, 30]
    assert held[30]["mean_reward"] > held[0]["mean_reward"], held
    assert held[30]["pass_rate"] == pytest.approx(held[30]["mean_reward"])  # exactAnswer: 0/1
    reward = series(out, "reward")
    before, after = float(np.mean(reward[:5])), float(np.mean(reward[-5:]))
    print(
        f"\nGRPO (full, 30 steps x 8 prompts x 4 completions): mean reward {before:.3f} -> "
        f"{after:.3f} (mean of the first 5 steps -> the last 5); per step: "
        f"{[round(r, 2) for r in reward]}"
    )
    assert after >= before + 0.05, reward  # 0.72 -> 0.81 in the streamed order of the data
    kl = series(out, "kl")
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and max(kl[1:]) > 0  # the reference is live
    assert {"train/reward/exactAnswer_0", "train/completion_length"} <= set(
        scalars(out / "tensorboard")
    )


def test_lora_gspo_with_every_reward_type_resumes_exactly(task, tmp_path):
    """LoRA (the reference is the policy with its adapters off), gspo-token loss, the four
    reward types, 2 micro-batches a step; a run resumed from step 2 ends bitwise where the
    whole run ended."""
    out = tmp_path / "out"
    rewards = [
        {"type": "exactAnswer"},
        {"type": "regexFormat", "pattern": r"^\d$", "weight": 0.5},
        {"type": "lengthPenalty", "targetLength": 1, "weight": 0.1},
        {"type": "python", "function": "test_grpo:ends_with_digit", "weight": 0.2},
    ]
    spec = grpo_spec(
        task,
        out,
        lora={"rank": 4, "alpha": 8},
        training={"steps": 4, "learningRate": 0.01, "gradientAccumulation": 2},
        grpo={"lossAlgorithm": "gspo-token", "rewards": rewards},
        checkpoint={"everySteps": 2},
    )
    first_result = run(spec)
    assert first_result.step == 4
    tb = scalars(out / "tensorboard")
    assert {
        "train/reward/exactAnswer_0",
        "train/reward/regexFormat_1",
        "train/reward/lengthPenalty_2",
        "train/reward/python_3",
    } <= tb.keys()
    assert max(tb["train/kl"].values()) > 0
    assert sorted(tb["train/rollout_seconds"]) == [1, 2, 3, 4]
    assert min(tb["train/rollout_seconds"].values()) > 0
    first = load_file(str(out / "hf" / "adapter_model.safetensors"))

    shutil.rmtree(out / "checkpoints" / "4")
    shutil.rmtree(out / "hf")
    again = run(spec)
    assert again.resumed_from == 2 and again.step == 4
    resumed = load_file(str(out / "hf" / "adapter_model.safetensors"))
    assert_bitwise_equal(first, resumed)


def test_reference_per_beta_and_host_local_rollouts(task, tmp_path):
    from posttrain.trainer import data, grpo, models
    from posttrain.trainer.policy import load_policy

    def grpo_run(spec, **kw):
        parsed = job(spec)
        mesh = models.make_mesh()
        policy = load_policy(parsed.spec, mesh, tmp_path)
        tokenizer = data.load_tokenizer(policy.model_dir)
        return grpo.GrpoRun(parsed, ProcessInfo(None, 1, 0), policy, tokenizer, mesh, **kw)

    lora = {"lora": {"rank": 4, "alpha": 8}}
    assert grpo_run(grpo_spec(task, tmp_path, grpo={"beta": 0.0})).ref_kind == "none"
    full = grpo_run(grpo_spec(task, tmp_path))
    assert full.ref_kind == "model" and full.ref_model is not None
    assert grpo_run(grpo_spec(task, tmp_path, **lora)).ref_kind == "lora"

    # What several processes do (sample on a host-local replica, refreshed from the
    # policy) samples exactly what the rollout sharing the policy's weights samples.
    spec = grpo_spec(task, tmp_path, grpo={"numGenerations": 2}, **lora)
    spec["training"]["batchSize"] = 2
    parsed = job(spec)
    tokenizer = data.load_tokenizer(str(task.model))
    batch = next(data.build_loader(parsed.spec, tokenizer))
    shared, local = grpo_run(spec), grpo_run(spec, host_local=True)
    assert not local.shares_weights and shared.shares_weights
    a, b = shared.rollout(batch, 7), local.rollout(batch, 7)
    for key in ("prompt_ids", "completion_ids", "completion_mask", "rewards"):
        assert np.array_equal(a[key], b[key]), key


def test_two_processes_on_localhost(task, tmp_path, compilation_cache):
    """jax.distributed with 2 CPU processes (1 device each): each host samples its own
    prompts on a host-local replica of the LoRA policy; one sharded update per step."""
    out = tmp_path / "out"
    spec = grpo_spec(
        task,
        out,
        lora={"rank": 4, "alpha": 8},
        training={"steps": 2, "batchSize": 4},
        checkpoint={"everySteps": 1},
    )
    job_file = tmp_path / "job.yaml"
    doc = {"apiVersion": "posttrain.dev/v1alpha1", "kind": "PostTrainJob"}
    job_file.write_text(yaml.safe_dump({**doc, "metadata": {"name": "two"}, "spec": spec}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_PROCESSES": "2"}
    env |= {
        "JAX_COMPILATION_CACHE_DIR": compilation_cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "posttrain.cli", "run", str(job_file)],
            env={**env, "JAX_PROCESS_ID": str(pid)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=900)[0])
        finally:
            for other in procs:
                if other.poll() is None and proc.returncode not in (None, 0):
                    other.kill()
        assert proc.returncode == 0, logs[-1][-4000:]
    assert (out / "hf" / "adapter_model.safetensors").exists()
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [
        1,
        2,
    ]
    assert sorted(scalars(out / "tensorboard")["train/reward"]) == [1, 2]


def test_dapo_dynamic_sampling_refills_the_batch_with_new_prompts(task, tmp_path):
    """DAPO: prompt groups whose completions all scored the same are dropped and new
    prompts, drawn at random from the data, sampled in their place; the batch keeps its
    size, leads with the informative groups the plain GRPO rollout sampled, and is the
    same when drawn again (a resumed run draws what the first drew)."""
    from posttrain.trainer import data, grpo, models
    from posttrain.trainer.policy import load_policy
    from posttrain.trainer.rl_losses import informative_groups

    def grpo_run(spec):
        parsed = job(spec)
        mesh = models.make_mesh()
        policy = load_policy(parsed.spec, mesh, tmp_path)
        tokenizer = data.load_tokenizer(policy.model_dir)
        run = grpo.GrpoRun(parsed, ProcessInfo(None, 1, 0), policy, tokenizer, mesh)
        run.loader = data.build_loader(parsed.spec, tokenizer)
        return run

    spec = grpo_spec(task, tmp_path, grpo={"numGenerations": 2}, lora={"rank": 4, "alpha": 8})
    spec["training"]["batchSize"] = 8
    batch = next(data.build_loader(job(spec).spec, data.load_tokenizer(str(task.model))))
    plain = grpo_run(spec).rollout(batch, 3)
    spec["grpo"]["lossAlgorithm"] = "dapo"
    dapo_run = grpo_run(spec)
    dapo = dapo_run.rollout(batch, 3)
    before = informative_groups(plain["rewards"].sum(-1), 2)
    after = informative_groups(dapo["rewards"].sum(-1), 2)
    assert not before.all(), "the task has no uniform group to drop"
    assert dapo["completion_ids"].shape == plain["completion_ids"].shape
    assert dapo["groups_dropped"] >= (~before).sum() and dapo["prompts_drawn"] % 8 == 0
    assert dapo["prompts_drawn"] > 0 and after.sum() > before.sum(), (before, after)
    kept = 2 * int(before.sum())  # the plain rollout's informative groups come first
    rows = np.repeat(before, 2)
    for key in ("prompt_ids", "completion_ids", "rewards", "advantages"):
        assert np.array_equal(plain[key][rows], dapo[key][:kept]), key
    # Prompts the batch did not hold were sampled.
    own = {tuple(r) for r in plain["prompt_ids"]}
    assert any(tuple(r) not in own for r in dapo["prompt_ids"][kept:])
    # Dropped groups that fill the batch carry no advantage.
    assert np.all(dapo["advantages"][~np.repeat(after, 2)] == 0)
    again = dapo_run.rollout(batch, 3)
    for key in ("prompt_ids", "completion_ids", "advantages"):
        assert np.array_equal(dapo[key], again[key]), key


def test_a_step_with_no_advantage_skips_the_learners_passes(task, tmp_path):
    """beta 0: a step whose groups all scored alike (every advantage zero) is
    `make_zero_advantage_step`'s update, which measures no entropy; one with an advantage
    is the full train step's. With one prompt a step, a step's rewards all agree exactly
    when their spread (reward_std) is zero."""
    out = tmp_path / "out"
    spec = grpo_spec(task, out, grpo={"numGenerations": 4, "beta": 0.0})
    spec["training"].update(steps=8, batchSize=1)
    assert run(spec).step == 8
    logged = scalars(out / "tensorboard")
    zero, spread = logged["train/zero_advantage"], logged["train/reward_std"]
    assert sorted(zero) == list(range(1, 9)) and {0.0, 1.0} == set(zero.values()), zero
    assert {s for s, v in zero.items() if v} == {s for s, v in spread.items() if v == 0}
    assert set(logged["train/entropy"]) == {s for s, v in zero.items() if not v}
