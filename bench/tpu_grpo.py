"""A GRPO step on the accelerator: how much of it is sampling and how much the learner.

Writes a checkpoint at a published shape with random weights (bench/tpu_loop.py's), runs
``posttrain run`` of a colocated GRPO job on it (Tunix's sampler with its KV cache, then
posttrain's learner), and reads each step's wall time (from one TensorBoard event to the
next) and its ``train/rollout_seconds`` (sampling and scoring, timed after the last
update finished). The sampling share is rollout_seconds / step time; the learner's share
is the rest (its forward and backward over the group, the reference's log-probs, the
update). Steps after the first two (those hold the compiles) and before the last (its
event is written without waiting for a next step) are averaged.

    python bench/tpu_grpo.py                              # Qwen3-0.6B LoRA r16, 64 x 512
    python bench/tpu_grpo.py --layers 2 --prompts 2 --generations 2 --new-tokens 16 --seq 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "trainer")]

import tpu_loop  # noqa: E402


def job_file(args: argparse.Namespace, root: Path, out: Path) -> Path:
    import yaml

    _, rank = __import__("tpu").CASES[args.case]
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(256):
            f.write(json.dumps({"prompt": f"What is {i} + {i}? Answer with the number.",
                                "answer": str(2 * i)}) + "\n")  # fmt: skip
    spec = {
        "technique": "grpo",
        "model": {"source": str(root / "model"), "dtype": "bfloat16"},  # bf16 compute
        "data": {"source": str(root / "prompts.jsonl")},
        "training": {"steps": args.steps, "batchSize": args.prompts, "learningRate": 1e-5,
                     "logEverySteps": 1, "remat": args.remat, "attention": "auto",
                     "gradientAccumulation": args.accumulation},
        "grpo": {"numGenerations": args.generations, "maxPromptLength": args.prompt_tokens,
                 "maxCompletionLength": args.new_tokens, "temperature": 0.9,
                 "rolloutEngine": "vanilla",
                 "rewards": [{"type": "exactAnswer", "weight": 1.0}]},
        "checkpoint": {"everySteps": args.steps},
        "output": {"uri": str(out)},
    }  # fmt: skip
    if rank:
        spec["lora"] = {"rank": rank, "alpha": 2 * rank}
    doc = {"apiVersion": "posttrain.dev/v1alpha1", "kind": "PostTrainJob",
           "metadata": {"name": "grpo-bench"}, "spec": spec}  # fmt: skip
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def step_times(out: Path) -> dict[int, dict[str, float]]:
    """Each step's wall time (its event's time less the previous step's) and its
    rollout_seconds, from the run's TensorBoard events."""
    from tb_events import events

    wall, rollout = {}, {}
    for event in events(out / "tensorboard"):
        for value in event.summary.value:
            if value.tag == "train/rollout_seconds":
                rollout[event.step] = value.simple_value
                wall[event.step] = event.wall_time
    steps = sorted(wall)
    return {
        s: {"step_s": wall[s] - wall[p], "rollout_s": rollout[s]}
        for p, s in zip(steps, steps[1:], strict=False)
    }


def main() -> int:
    from tpu import CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="qwen3-0.6b-lora")
    parser.add_argument("--layers", type=int, default=0, help="fewer layers (a quick check)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a step")
    parser.add_argument("--generations", type=int, default=4, help="completions a prompt")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--accumulation", type=int, default=8)
    parser.add_argument("--remat", default="layer")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=64, help="the checkpoint writer's rows")
    parser.add_argument("--json", type=Path, help="append the result as a JSON line here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    t = time.time()
    tpu_loop.write_checkpoint(args, root)
    print(f"checkpoint written in {time.time() - t:.0f} s", flush=True)

    out = root / "grpo-run"
    run = tpu_loop.posttrain_run(job_file(args, root, out), out, tag="train/rollout_seconds")
    times = step_times(out)
    # a step's metrics are read while the next step runs (the loop does not wait on each
    # step), so the last step's event comes early: the steady steps are the third to the
    # one before the last
    last = max(times)
    steady = [v for s, v in times.items() if 2 < s < last] or list(times.values())
    step_s = sum(v["step_s"] for v in steady) / len(steady)
    rollout_s = sum(v["rollout_s"] for v in steady) / len(steady)
    sequences = args.prompts * args.generations
    result = {
        "case": args.case, "layers": args.layers or "all", "sequences": sequences,
        "new_tokens": args.new_tokens, "accumulation": args.accumulation, "remat": args.remat,
        "step_s": step_s, "rollout_s": rollout_s, "sampling_share": rollout_s / step_s,
        "learner_share": 1 - rollout_s / step_s,
        "decode_tokens_per_s": sequences * args.new_tokens / rollout_s,
        "wall_s": run["wall_s"], "steps": times,
    }  # fmt: skip
    print(
        f"GRPO step ({sequences} sequences x {args.new_tokens} new tokens): {step_s:.2f} s; "
        f"sampling and scoring {rollout_s:.2f} s ({result['sampling_share']:.0%}), "
        f"the learner {step_s - rollout_s:.2f} s ({result['learner_share']:.0%}); "
        f"steps by time: "
        + ", ".join(f"{s}: {v['step_s']:.2f}/{v['rollout_s']:.2f}" for s, v in times.items()),
        flush=True,
    )
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
