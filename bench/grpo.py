"""GRPO throughput on CPU: steps/s and rollout tokens/s, against Tunix's own loop.

1. posttrain's GRPO step (``posttrain.trainer.grpo.GrpoRun``: Tunix rollout, rewards,
   advantages, Tunix's policy loss, one update), timed after the first (compiling) step:
   steps/s, rollout tokens/s (completion tokens sampled per second of sampling) and
   trained tokens/s.
2. The baseline, in the same run on the same model, LoRA, prompts and settings: Tunix's
   ``GRPOLearner.train`` driving the same RLCluster; steps/s and the ratio
   posttrain / Tunix (goal >= 0.95: the project's loop adds checkpointable data
   position, host-local rollouts and metrics, not time).

The task is the tests' "Say 7." -> "7" on a random tiny Llama (so completions run to
maxCompletionLength: a fixed amount of sampling per step).

    python bench/grpo.py [--steps 10] [--hidden 64] [--layers 2] [--prompts 8] \
        [--generations 4] [--completion 16]

``--placement`` compares, in one run on the same devices and the same work (model,
prompts, steps, seeds), colocated synchronous GRPO (the sampler shares the trainer's
devices and weights; each step waits for its rollouts) against disaggregated
asynchronous GRPO (spec.grpo.rollout disaggregated with ``--sampler-fraction`` of the
devices, maxStaleness ``--staleness``): time per step, completion tokens/s, the share of
the wall time the learner is idle, and the ratio (goal on accelerators >= 1.3).
``--devices N`` runs on N CPU devices (XLA_FLAGS, set before jax starts):

    python bench/grpo.py --placement --devices 8 [--staleness 1] [--sampler-fraction 0.5]

``--learner`` times the learner's update alone at the calculator example's shape
(examples/agent-calculator-smollm2-cpu.yaml: SmolLM2-135M-Instruct converted under
.cache/models, LoRA r8 restored from the warm start, 4 rows of 104 prompt and 152
completion tokens, remat layer), on the same model and batch in one run: the update as it
was, projecting every position onto the 49152-token vocabulary, against the update
projecting only the completion's positions (``models.last_positions``), with the
trainer's CPU scheduler (``cpu_flags``). It prints each one's compiled peak
(``memory_analysis()``: arguments + temporaries + outputs - aliased) and seconds a step
(the median of ``--steps`` steps after a compiling one, the updates taking turns),
and the ratios before / after; and the update of a batch whose every advantage is zero
(``grpo_step.make_zero_advantage_step``: no forward or backward pass):

    python bench/grpo.py --learner [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

if "--devices" in sys.argv:  # before jax starts
    _n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}"
    )

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "trainer")]
if "--learner" in sys.argv:  # the trainer's CPU scheduler, before jax starts (cpu_flags)
    from posttrain.trainer import cpu_flags

    cpu_flags.apply()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402
from timing import timed  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402

from posttrain.checks import validate  # noqa: E402
from posttrain.trainer import data, grpo, grpo_step, models, optim, rl_losses, rl_placement  # noqa: E402
from posttrain.trainer.distributed import ProcessInfo  # noqa: E402
from posttrain.trainer.policy import load_policy, shard_like_params  # noqa: E402
from posttrain.trainer.step_memory import memory_of, peak_bytes  # noqa: E402

EXAMPLE = ROOT / "examples" / "agent-calculator-smollm2-cpu.yaml"
SMOLLM2 = ROOT / ".cache" / "models" / "smollm2-135m-instruct"


def make_job(model_dir: Path, prompts: Path, args: argparse.Namespace):
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "bench-grpo"},
        "spec": {
            "technique": "grpo",
            "model": {"source": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 8, "alpha": 16},
            "data": {"source": str(prompts)},
            "training": {
                "steps": args.steps + 1,
                "batchSize": args.prompts,
                "learningRate": 1e-3,
                "schedule": "constant",
            },
            "grpo": {
                "numGenerations": args.generations,
                # Not 0: a random model's rewards all agree, and without a KL term such a
                # step skips the learner's passes (grpo_step.make_zero_advantage_step), which
                # Tunix's loop does not; with one both loops run the learner every step.
                "beta": 1e-3,
                "maxPromptLength": 48,
                "maxCompletionLength": args.completion,
                "temperature": 1.0,
                "rewards": [{"type": "exactAnswer"}],
            },
            "output": {"uri": tempfile.mkdtemp()},
        },
    }
    job, errors = validate(doc)
    assert not errors, errors
    return job


def setup(job):
    mesh = models.make_mesh()
    policy = load_policy(job.spec, mesh, Path(tempfile.mkdtemp()))
    tokenizer = data.load_tokenizer(policy.model_dir)
    loader = data.build_loader(job.spec, tokenizer)
    run = grpo.GrpoRun(job, ProcessInfo(None, 1, 0), policy, tokenizer, mesh)
    return mesh, policy, loader, run


def time_ours(job, steps: int) -> dict[str, float]:
    mesh, policy, loader, run = setup(job)
    batches = timed(next(loader) for _ in range(steps + 1))
    trained = 0
    with jax.set_mesh(mesh):
        shard_like_params(run.opt, mesh)
        for i, b in enumerate(batches):
            out = run(b, i)
            if i == 0:  # compiled and run before the clock starts
                jax.block_until_ready(out["loss"])
                run.rollout_seconds, run.rollout_tokens = 0.0, 0
            else:
                trained += int(out["tokens"])
    elapsed = batches.seconds(out["loss"])
    return {
        "steps_per_second": steps / elapsed,
        "rollout_tokens_per_second": run.rollout_tokens / max(run.rollout_seconds, 1e-9),
        "completion_tokens_per_second": trained / elapsed,
        "rollout_share": run.rollout_seconds / elapsed,
    }


def time_tunix(job, steps: int) -> float:
    """Tunix's GRPOLearner.train on the same cluster; seconds for `steps` steps after the
    first."""
    mesh, policy, loader, run = setup(job)
    batches = timed(
        {"prompts": b["prompts"].astype(str), "answer": b["answer"].astype(str)}
        for b in (next(loader) for _ in range(steps + 1))
    )
    with warnings.catch_warnings():  # Tunix shards its inputs by the legacy mesh context
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            run.learner.train(batches)
    return batches.seconds(jax.tree.leaves(policy.model))


def time_placement(job, steps: int) -> dict[str, float]:
    """`steps` GRPO steps after a first (compiling) one, with the job's placement: time
    per step, completion tokens trained per second, the learner's idle share."""
    trainer_devices, _ = rl_placement.split_devices(job.spec)
    mesh = models.make_mesh(devices=trainer_devices)
    policy = load_policy(job.spec, mesh, Path(tempfile.mkdtemp()))
    tokenizer = data.load_tokenizer(policy.model_dir)
    run = grpo.GrpoRun(job, ProcessInfo(None, 1, 0), policy, tokenizer, mesh)
    run.loader = rl_placement.Lookahead(data.build_loader(job.spec, tokenizer))
    trained, busy = 0, 0.0
    with jax.set_mesh(mesh):
        shard_like_params(run.opt, mesh)
        for i in range(steps + 1):
            if i == 1:  # compiled before the clock starts
                start = time.monotonic()
                wait0 = run.async_rollouts.wait_seconds if run.async_rollouts else 0.0
                rollout0 = run.rollout_seconds
            step_start = time.monotonic()
            out = run(next(run.loader), i)
            jax.block_until_ready(out["loss"])
            if i >= 1:
                trained += int(out["tokens"])
                busy += time.monotonic() - step_start
    elapsed = time.monotonic() - start
    run.close()
    if run.async_rollouts is not None:  # idle: waiting for the sampler's rollouts
        idle = run.async_rollouts.wait_seconds - wait0
    else:  # idle: the step's own rollout, on the learner's devices
        idle = run.rollout_seconds - rollout0
    return {
        "seconds_per_step": elapsed / steps,
        "tokens_per_second": trained / elapsed,
        "learner_idle": idle / elapsed,
    }


def placement_main(args: argparse.Namespace, model_dir: Path, prompts: Path) -> int:
    base = make_job(model_dir, prompts, args)
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "bench-grpo"},
        "spec": base.spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
    }
    doc["spec"]["grpo"]["rollout"] = {
        "placement": "disaggregated",
        "samplerFraction": args.sampler_fraction,
    }
    doc["spec"]["grpo"]["maxStaleness"] = args.staleness
    split, errors = validate(doc)
    assert not errors, errors
    results: dict[str, dict[str, float]] = {}
    for _ in range(2):  # alternate, keep each one's best, to even out a busy machine
        for name, job in (("colocated-sync", base), ("disaggregated-async", split)):
            got = time_placement(job, args.steps)
            best = results.get(name)
            if best is None or got["seconds_per_step"] < best["seconds_per_step"]:
                results[name] = got
    n = jax.device_count()
    print(
        f"model: llama hidden {args.hidden} x {args.layers} layers, LoRA r8; "
        f"{args.prompts} prompts x {args.generations} completions x {args.completion} tokens "
        f"per step; {args.steps} timed steps; {n} {jax.devices()[0].platform} devices; "
        f"{os.cpu_count()} CPU cores"
    )
    print(
        f"disaggregated: sampler {args.sampler_fraction:g} of the devices "
        f"({rl_placement.describe(split.spec, n)}), maxStaleness {args.staleness}"
    )
    for name, r in results.items():
        print(
            f"{name:20s} {r['seconds_per_step']:7.3f} s/step {r['tokens_per_second']:8.1f} "
            f"tokens/s  learner idle {100 * r['learner_idle']:5.1f}%"
        )
    ratio = (
        results["colocated-sync"]["seconds_per_step"]
        / results["disaggregated-async"]["seconds_per_step"]
    )
    print(f"ratio disaggregated-async / colocated-sync (steps/s): {ratio:.3f} (goal >= 1.3)")
    return 0 if np.isfinite(ratio) else 1


def learner_job():
    """The calculator example's job, its model and adapter read from this checkout."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["model"]["source"] = str(SMOLLM2)
    spec["lora"]["restoreFrom"] = str(ROOT / spec["lora"]["restoreFrom"])
    spec["data"]["source"] = str(ROOT / spec["data"]["source"])
    spec["output"]["uri"] = tempfile.mkdtemp()
    job, errors = validate(doc)
    assert not errors, errors
    return job


def learner_main(args: argparse.Namespace) -> int:
    if not (SMOLLM2 / "model.safetensors").exists():
        print(f"--learner needs SmolLM2-135M-Instruct converted under {SMOLLM2}")
        return 2
    job = learner_job()
    spec, g = job.spec, job.spec.grpo
    mesh = models.make_mesh()
    policy = load_policy(spec, mesh, Path(tempfile.mkdtemp()))
    tokenizer = data.load_tokenizer(policy.model_dir)
    from tunix.rl.grpo import grpo_learner

    from posttrain.trainer.tunix_rl import TunixTokenizer

    tok = TunixTokenizer(tokenizer, g.max_prompt_length)
    pad, eos = tok.pad_id(), tok.eos_id()
    config = rl_losses.algo_config(g, grpo_learner.GRPOConfig)
    config.temperature = g.temperature
    rows, vocab = spec.training.batch_size * g.num_generations, policy.info.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, vocab, (rows, g.max_prompt_length)).astype(np.int32)
    prompt[:, : g.max_prompt_length // 4] = pad  # left-padded, as the sampler pads them
    completion = rng.integers(3, vocab, (rows, g.max_completion_length)).astype(np.int32)
    batch = {
        "prompt_ids": jnp.asarray(prompt),
        "completion_ids": jnp.asarray(completion),
        "completion_mask": jnp.ones_like(completion),
        "advantages": jnp.asarray(rng.normal(size=rows), jnp.float32),
        "rewards": jnp.zeros((rows, 1), jnp.float32),
    }
    every_position = mock.patch.object(
        grpo_step, "completion_view", lambda model, ids: models.compute_view(model)
    )
    modes = {"every position": every_position, "completion only": contextlib.nullcontext()}
    with jax.set_mesh(mesh):
        opt = nnx.Optimizer(policy.model, optim.optimizer(spec.training), wrt=policy.wrt)
        steps, memory = {}, {}
        for name, patch in modes.items():  # traced and compiled with the mode's view
            with patch:
                step = grpo_step.make_train_step(policy.wrt, config, pad, eos,
                                            spec.training.gradient_accumulation, "none")  # fmt: skip
                compiled = step.lower(policy.model, opt, None, batch).compile()
                memory[name] = memory_of(compiled)
                jax.block_until_ready(step(policy.model, opt, None, batch)["loss"])
            steps[name] = step
        # A batch whose every advantage is zero (beta 0): no forward or backward pass.
        zero = {**batch, "advantages": jnp.zeros_like(batch["advantages"])}
        steps["zero advantage"] = grpo_step.make_zero_advantage_step(policy.wrt)
        jax.block_until_ready(steps["zero advantage"](policy.model, opt, None, zero)["loss"])
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.steps):  # one step of each in turn: a busy machine slows all
            for name, step in steps.items():
                start = time.perf_counter()
                inputs = zero if name == "zero advantage" else batch
                jax.block_until_ready(step(policy.model, opt, None, inputs)["loss"])
                times[name].append(time.perf_counter() - start)
        seconds = {name: statistics.median(t) for name, t in times.items()}
    total = g.max_prompt_length + g.max_completion_length
    print(
        f"learner update of {EXAMPLE.name}: SmolLM2-135M-Instruct, vocab {vocab}, LoRA "
        f"r{spec.lora.rank}; {rows} rows x ({g.max_prompt_length} prompt + "
        f"{g.max_completion_length} completion) tokens; remat {spec.training.remat}; "
        f"median of {args.steps} steps each, taking turns; {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), {os.cpu_count()} CPU cores"
    )
    peaks = {name: peak_bytes(m) for name, m in memory.items()}
    for name, kept in (("every position", total), ("completion only", g.max_completion_length + 1)):
        m = {k: v / 2**20 for k, v in memory[name].items()}
        print(
            f"{name:16s} {kept:4d} positions projected  peak {peaks[name] / 2**20:8.1f} MiB "
            f"(temporaries {m['temp']:.1f}, arguments {m['argument']:.1f}, outputs "
            f"{m['output']:.1f}, aliased {m['alias']:.1f})  {seconds[name]:7.3f} s/step"
        )
    before, after = "every position", "completion only"
    print(
        f"ratio before / after: peak {peaks[before] / peaks[after]:.3f}, "
        f"seconds a step {seconds[before] / seconds[after]:.3f} (goal: both > 1)"
    )
    print(
        f"a step whose advantages are all zero: {seconds['zero advantage']:.3f} s/step, "
        f"{seconds[after] / seconds['zero advantage']:.0f}x less than the update's"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--placement", action="store_true", help="colocated vs disaggregated")
    p.add_argument("--learner", action="store_true", help="the example's learner update")
    p.add_argument("--devices", type=int, default=None, help="CPU devices (XLA_FLAGS)")
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--sampler-fraction", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--completion", type=int, default=16)
    args = p.parse_args()
    if args.learner:
        return learner_main(args)
    root = Path(tempfile.mkdtemp())
    model_dir = make_tiny_llama(root / "model", hidden=args.hidden, layers=args.layers)
    prompts = root / "say.jsonl"
    rng = random.Random(0)
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) + "\n"
            for n in (rng.randint(0, 9) for _ in range(256))
        )
    )
    if args.placement:
        return placement_main(args, model_dir, prompts)
    job = make_job(model_dir, prompts, args)

    # Alternate the two twice and keep each one's best, to even out a busy machine.
    ours: dict[str, float] = {}
    tunix = float("inf")
    for _ in range(2):
        tunix = min(tunix, time_tunix(job, args.steps))
        got = time_ours(job, args.steps)
        if not ours or got["steps_per_second"] > ours["steps_per_second"]:
            ours = got
    print(
        f"model: llama hidden {args.hidden} x {args.layers} layers, LoRA r8; "
        f"{args.prompts} prompts x {args.generations} completions x {args.completion} tokens "
        f"per step; {args.steps} timed steps; {jax.device_count()} CPU device(s)"
    )
    print(f"posttrain GRPO:        {ours['steps_per_second']:8.3f} steps/s")
    print(
        f"  rollout:             {ours['rollout_tokens_per_second']:8.0f} tokens/s sampled "
        f"({100 * ours['rollout_share']:.0f}% of the step)"
    )
    print(f"  trained:             {ours['completion_tokens_per_second']:8.0f} completion tokens/s")
    print(f"Tunix GRPOLearner:     {args.steps / tunix:8.3f} steps/s")
    ratio = ours["steps_per_second"] / (args.steps / tunix)
    print(f"ratio posttrain/Tunix: {ratio:.3f} (goal >= 0.95)")
    return 0 if np.isfinite(ratio) else 1


if __name__ == "__main__":
    sys.exit(main())
