"""Run by test_grpo_placement.py in its own process with 8 CPU devices (XLA_FLAGS must be
set before jax starts): one process that sees every device, as one Pathways controller
does. Prints RESULT<json> with what the test asserts.

    python grpo_placement_check.py MODEL PROMPTS OUT
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain.api.spec import EvalSpec  # noqa: E402
from posttrain.checks import validate  # noqa: E402
from posttrain.trainer import data, grpo, models, rl_placement  # noqa: E402
from posttrain.trainer.distributed import ProcessInfo  # noqa: E402
from posttrain.trainer.loop import train  # noqa: E402
from posttrain.trainer.policy import load_policy  # noqa: E402


def job(model: str, prompts: str, out: str, steps: int, staleness: int, every: int, loss: str):
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "placement"},
        "spec": {
            "technique": "grpo",
            "model": {"source": model, "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8},
            "data": {"source": prompts},
            "training": {
                "steps": steps,
                "batchSize": 4,
                "learningRate": 0.05,
                "schedule": "constant",
                "remat": "layer",  # the trainer's; the sampler's copy runs without remat
                "logEverySteps": 1,
                "seed": 0,
            },
            "grpo": {
                "numGenerations": 2,
                "beta": 0.04,
                "maxPromptLength": 32,
                "maxCompletionLength": 4,
                "temperature": 1.0,
                "rewards": [{"type": "exactAnswer"}, {"type": "lengthPenalty", "targetLength": 1}],
                "lossAlgorithm": loss,
                "rollout": {"placement": "disaggregated", "samplerFraction": 0.25},
                "maxStaleness": staleness,
            },
            "checkpoint": {"everySteps": every},
            "output": {"uri": out},
        },
    }
    parsed, errors = validate(doc)
    assert not errors, errors
    return parsed


def ids(devices) -> list[int]:
    return sorted(d.id for d in devices)


def remat_configs(model) -> list[str]:
    return sorted({layer.config.remat_config.name for layer in model.layers})


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def placement(model: str, prompts: str, out: str) -> dict:
    parsed = job(model, prompts, out, steps=4, staleness=1, every=1000, loss="dr-grpo")
    trainer_devices, sampler_devices = rl_placement.split_devices(parsed.spec)
    mesh = models.make_mesh(devices=trainer_devices)
    policy = load_policy(parsed.spec, mesh, Path(out))
    tokenizer = data.load_tokenizer(policy.model_dir)
    run = grpo.GrpoRun(parsed, ProcessInfo(None, 1, 0), policy, tokenizer, mesh)
    run.loader = rl_placement.Lookahead(data.build_loader(parsed.spec, tokenizer))
    sampler_model = lambda: run.cluster.rollout.model()  # noqa: E731
    snapshot = run.snapshot()
    staleness = []
    with jax.set_mesh(mesh):
        for index in range(4):
            out_metrics = run(next(run.loader), index)
            staleness.append(int(out_metrics["staleness"]))
            metrics = {k: float(v) for k, v in out_metrics.items() if np.ndim(v) == 0}
    run.close()
    run.sync_rollout()  # a weight sync as evaluation makes it: the trainer's version now
    lora_trainer = jax.tree.leaves(nnx.state(policy.model, nnx.LoRAParam))
    lora_sampler = jax.tree.leaves(nnx.state(sampler_model(), nnx.LoRAParam))
    rollouts = run.async_rollouts.intervals["rollout"]
    trains = run.async_rollouts.intervals["train"]
    return {
        "trainer_devices": ids(trainer_devices),
        "sampler_devices": ids(sampler_devices),
        "policy_on": ids(rl_placement.devices_of(nnx.state(policy.model))),
        "optimizer_on": ids(rl_placement.devices_of(nnx.state(run.opt))),
        "sampler_model_on": ids(rl_placement.devices_of(nnx.state(sampler_model()))),
        "policy_remat": remat_configs(policy.model),
        "sampler_remat": remat_configs(sampler_model()),
        "snapshot_on": ids(rl_placement.devices_of(snapshot)),
        "snapshot_leaves": len(jax.tree.leaves(snapshot)),
        "lora_leaves": len(lora_trainer),
        "param_leaves": len(jax.tree.leaves(nnx.state(policy.model, nnx.Param))),
        "snapshot_bytes": nbytes(snapshot),
        "model_bytes": nbytes(nnx.state(policy.model, nnx.Param)),
        "sampler_lora_is_trainer_lora": all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(lora_trainer, lora_sampler, strict=True)
        ),
        "staleness": staleness,
        "overlap_seconds": rl_placement.overlapping(rollouts, trains),
        "rollout_intervals": rollouts,
        "train_intervals": trains,
        "metrics": metrics,
    }


def resume(model: str, prompts: str, out: str) -> dict:
    from safetensors.numpy import load_file
    from tb_events import scalars

    # DAPO: its dynamic sampling draws new prompts on the sampler thread too.
    spec = job(model, prompts, out, steps=4, staleness=1, every=2, loss="dapo")
    # Held-out evaluation samples on the sampler too, between the rollouts in flight.
    spec.spec.eval = EvalSpec(source=prompts, every_steps=2, samples=0)
    first = train(spec, ProcessInfo(None, 1, 0), show_bar=False)
    adapter = Path(out) / "hf" / "adapter_model.safetensors"
    whole = load_file(str(adapter))
    tb = scalars(Path(out) / "tensorboard")
    staleness, drawn = tb["train/staleness"], tb["train/prompts_drawn"]
    weight = tb["train/behaviour_weight"]
    shutil.rmtree(Path(out) / "checkpoints" / "4")
    shutil.rmtree(Path(out) / "hf")
    (Path(out) / "summary.json").unlink()
    again = train(spec, ProcessInfo(None, 1, 0), show_bar=False)
    resumed = load_file(str(adapter))
    return {
        "first_step": first.step,
        "resumed_from": again.resumed_from,
        "step": again.step,
        "bitwise": sorted(whole) == sorted(resumed)
        and all(np.array_equal(whole[k], resumed[k]) for k in whole),
        "staleness": [staleness[s] for s in sorted(staleness)],
        "prompts_drawn": [drawn[s] for s in sorted(drawn)],
        "behaviour_weight": [weight[s] for s in sorted(weight)],
        "evals": sorted(first.evals),
    }


if __name__ == "__main__":
    model, prompts, out = sys.argv[1:4]
    sys.path.insert(0, str(Path(__file__).parent))
    result = {
        "placement": placement(model, prompts, out + "/placement"),
        "resume": resume(model, prompts, out + "/resume"),
    }
    print("RESULT" + json.dumps(result))
