"""Does GRPO with stale rollouts still learn? The same task, model, data and seeds trained
on-policy (maxStaleness 0) and with rollouts 1 and 2 policy versions old (decoupled PPO's
behaviour weights correcting the gap), all with a disaggregated sampler on CPU devices.

Two tasks (--task):

- say (the default): the trainer tests' "Say N." -> "N" on a tiny random Llama first
  SFT'd a little (it says the right digit about 40% of the time); GRPO full fine-tune
  with an exactAnswer reward raises that, with a held-out greedy pass rate at the end.
- arithmetic: the CPU example examples/grpo-lora-smollm2-cpu.yaml as shipped (LoRA on
  SmolLM2-135M-Instruct, `make demo` converts the model), with its sampler on half the
  devices and no checkpoint inside the run (a checkpoint step is on-policy); about 5
  minutes a run on two idle cores with --devices 2 (--batch-size: other prompts a step).

Prints, per maxStaleness, the mean training reward of the first and last `--window`
steps and the gap to the on-policy run (the stated tolerance: within 0.1 of the
on-policy final reward), and the first step at which each maxStaleness's trailing mean
reaches that line. With --seeds, each maxStaleness runs once per seed and the means over
the seeds are compared (with few prompts a step, as the arithmetic example has, a single
run's curve depends on when a sample first hits the format).

    python bench/grpo_staleness.py [--task say] [--steps 30] [--devices 8] [--window 5]
    python bench/grpo_staleness.py --task arithmetic --devices 2 --window 10 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if "--devices" in sys.argv:  # before jax starts
    _n = sys.argv[sys.argv.index("--devices") + 1]
else:
    _n = "8"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}"
)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "trainer")]

import jax  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from tb_events import scalars  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402

from posttrain.checks import validate  # noqa: E402
from posttrain.trainer.distributed import ProcessInfo  # noqa: E402
from posttrain.trainer.loop import train  # noqa: E402

TOLERANCE = 0.1


def job(spec: dict):
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "staleness"},
        "spec": spec,
    }
    parsed, errors = validate(doc)
    assert not errors, errors
    return parsed


def write_task(root: Path) -> tuple[Path, Path, Path]:
    rng = random.Random(0)
    sft, prompts, held_out = root / "sft.jsonl", root / "say.jsonl", root / "held-out.jsonl"
    with sft.open("w") as f:
        for _ in range(200):
            n = rng.randint(0, 9)
            msgs = [
                {"role": "user", "content": f"Say {n}."},
                {"role": "assistant", "content": str(n)},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    for path, rows in ((prompts, 200), (held_out, 20)):
        path.write_text(
            "".join(
                json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) + "\n"
                for n in (rng.randint(0, 9) for _ in range(rows))
            )
        )
    return sft, prompts, held_out


def say_task(root: Path, steps: int):
    """The "Say N." task: the SFT'd tiny model and, per maxStaleness, its GRPO spec."""
    sft, prompts, held_out = write_task(root)
    base = make_tiny_llama(root / "base")
    train(
        job(
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
        ),
        ProcessInfo(None, 1, 0),
        show_bar=False,
    )

    def spec(k: int, seed: int, out: Path) -> dict:
        return {
            "technique": "grpo",
            "model": {"source": str(root / "sft" / "hf"), "dtype": "float32"},
            "data": {"source": str(prompts)},
            "training": {
                "steps": steps,
                "batchSize": 8,
                "learningRate": 0.002,
                "schedule": "constant",
                "logEverySteps": 1,
                "seed": seed,
            },
            "grpo": {
                "numGenerations": 4,
                "beta": 0.04,
                "maxPromptLength": 48,
                "maxCompletionLength": 4,
                "temperature": 1.0,
                "rewards": [{"type": "exactAnswer"}],
                "rollout": {"placement": "disaggregated", "samplerFraction": 0.5},
                "maxStaleness": k,
            },
            "eval": {"source": str(held_out), "everySteps": steps, "samples": 0},
            "checkpoint": {"everySteps": 1000},
            "output": {"uri": str(out)},
        }

    return spec, (
        f"task: 'Say N.' -> 'N', tiny Llama SFT'd 55 steps; GRPO full fine-tune "
        f"{steps} steps x 8 prompts x 4 completions"
    )


def arithmetic_task(steps: int, batch_size: int | None):
    """The arithmetic CPU example as shipped (or with `batch_size` prompts a step), its
    sampler on half the devices."""
    example = yaml.safe_load((ROOT / "examples" / "grpo-lora-smollm2-cpu.yaml").read_text())
    base = example["spec"]
    model = ROOT / base["model"]["source"]
    if not (model / "config.json").exists():
        sys.exit(f"{model}: not found; `make demo` (or posttrain convert-gguf) makes it")

    def spec(k: int, seed: int, out: Path) -> dict:
        s = json.loads(json.dumps(base))
        s["model"]["source"] = str(model)
        s["data"]["source"] = str(ROOT / s["data"]["source"])
        s["training"].update(steps=steps, seed=seed)
        if batch_size:
            s["training"]["batchSize"] = batch_size
        s["grpo"].update(
            rollout={"placement": "disaggregated", "samplerFraction": 0.5}, maxStaleness=k
        )
        s["checkpoint"] = {"everySteps": 1000}
        s["output"] = {"uri": str(out)}
        return s

    b = batch_size or base["training"]["batchSize"]
    prompts = f"{b} prompt{'s' if b > 1 else ''}"
    return spec, (
        f"task: examples/grpo-lora-smollm2-cpu.yaml (SmolLM2-135M LoRA r{base['lora']['rank']}, "
        f"arithmetic), {steps} steps x {prompts} x {base['grpo']['numGenerations']} completions"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=("say", "arithmetic"), default="say")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument(
        "--batch-size", type=int, help="arithmetic: prompts a step (default: the example's)"
    )
    args = p.parse_args()
    root = Path(tempfile.mkdtemp())
    if args.task == "say":
        spec_for, title = say_task(root, args.steps)
    else:
        spec_for, title = arithmetic_task(args.steps, args.batch_size)
    results = {}
    for k in args.staleness:
        runs = []
        for seed in args.seeds:
            out = root / f"grpo-{k}-{seed}"
            start = time.monotonic()
            result = train(job(spec_for(k, seed, out)), ProcessInfo(None, 1, 0), show_bar=False)
            tb = scalars(out / "tensorboard")
            reward = [tb["train/reward"][s] for s in sorted(tb["train/reward"])]
            stale = [tb["train/staleness"][s] for s in sorted(tb["train/staleness"])]
            evals = result.evals
            runs.append(
                {
                    "first": float(np.mean(reward[: args.window])),
                    "last": float(np.mean(reward[-args.window :])),
                    "pass_rate": evals[args.steps]["pass_rate"] if args.steps in evals else None,
                    "pass_rate_0": evals[0]["pass_rate"] if 0 in evals else None,
                    "max_staleness_seen": max(stale),
                    "seconds": time.monotonic() - start,
                    "reward": reward,
                }
            )
            print(
                f"maxStaleness {k} seed {seed}: rewards {[round(r, 3) for r in reward]}", flush=True
            )
        results[k] = runs
    seeds = f"seeds {', '.join(map(str, args.seeds))}"
    print(f"{title}; sampler 0.5 of {jax.device_count()} CPU devices; {seeds}")

    def mean(runs: list[dict], key: str) -> float:
        return float(np.mean([r[key] for r in runs]))

    ref = results.get(0)
    for k, runs in results.items():
        gap = (
            ""
            if ref is None
            else f"  gap to on-policy {mean(runs, 'last') - mean(ref, 'last'):+.3f}"
        )
        held = (
            ""
            if runs[0]["pass_rate"] is None
            else f", held-out pass rate {mean(runs, 'pass_rate_0'):.2f} -> {mean(runs, 'pass_rate'):.2f}"
        )
        per_seed = ", ".join(f"{r['last']:.3f}" for r in runs)
        print(
            f"maxStaleness {k}: train reward {mean(runs, 'first'):.3f} -> {mean(runs, 'last'):.3f} "
            f"(mean of first/last {args.window} steps, over the seeds; last per seed {per_seed})"
            f"{held}, staleness seen {max(r['max_staleness_seen'] for r in runs):.0f}, "
            f"{mean(runs, 'seconds'):.0f} s a run{gap}"
        )
    if ref is None:
        return 0
    within = all(mean(runs, "last") >= mean(ref, "last") - TOLERANCE for runs in results.values())
    print(f"every run within {TOLERANCE} of the on-policy final reward: {within}")
    goal = mean(ref, "last") - TOLERANCE
    for k, runs in results.items():
        step = first_step_reaching([r["reward"] for r in runs], goal, args.window)
        reached = f"at step {step}" if step else f"not in {args.steps} steps"
        print(
            f"maxStaleness {k}: mean of the last {args.window} steps first >= {goal:.3f} {reached}"
        )
    return 0


def first_step_reaching(curves: list[list[float]], goal: float, window: int) -> int | None:
    """The first step whose trailing `window`-step mean of the seeds' mean curve reaches
    goal (steps count from 1)."""
    curve = np.mean(np.asarray(curves), axis=0)
    for step in range(window, len(curve) + 1):
        if curve[step - window : step].mean() >= goal:
            return step
    return None


if __name__ == "__main__":
    sys.exit(main())
