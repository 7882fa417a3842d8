"""spec.training.remat: a decoder layer (or its attention and MLP) recomputed in backward
instead of kept trains the same losses as keeping everything, is really in the step, and
reaches every model a job loads from its spec alone."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import FAMILIES, FIXTURES
from safetensors.numpy import load_file
from tiny_job import run_job, tiny_job, validated

from posttrain.trainer import distill, loop, models
from posttrain.trainer.distributed import ProcessInfo
from posttrain.trainer.policy import load_reference

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "chat-sft.jsonl"


def _losses(model_dir: Path, out: Path, remat: str) -> list[float]:
    doc = tiny_job(model_dir, DATA, out, steps=3, every=3, lora=False,
                   training={"logEverySteps": 1, "remat": remat})  # fmt: skip
    result = run_job(validated(doc))
    return [result.losses[s] for s in sorted(result.losses)]


def test_remat_trains_the_same_losses(model_dir, tmp_path):
    none = _losses(model_dir, tmp_path / "none", "none")
    assert len(none) == 3
    layer = _losses(model_dir, tmp_path / "layer", "layer")  # block: its program below
    np.testing.assert_allclose(layer, none, rtol=1e-5)


def _remat_configs(model) -> set[str]:
    """The remat config of the model and of each of its decoder layers."""
    return {model.config.remat_config.name} | {
        layer.config.remat_config.name for layer in model.layers
    }


@pytest.mark.parametrize("remat,config", [("layer", "DECODER"), ("block", "BLOCK")])
def test_every_model_a_job_loads_has_the_specs_remat(model_dir, tmp_path, remat, config):
    """What loop.train sets up from the job alone (as bench/ and tests call it, with no
    wrapper around it): the policy, a frozen reference (DPO, GRPO) and a distillation
    teacher all rematerialise as spec.training.remat says (auto would be none on CPU)."""
    doc = tiny_job(model_dir, DATA, tmp_path / "out", steps=1, every=1, lora=False,
                   training={"remat": remat}, technique="distill",
                   distill={"teacher": {"source": str(model_dir), "dtype": "float32"}})  # fmt: skip
    job = validated(doc)
    run = loop.setup_run(job, ProcessInfo(None, 1, 0), show_bar=False, stop=None)
    assert _remat_configs(run.policy.model) == {config}
    assert _remat_configs(load_reference(job.spec, run.policy, run.mesh)) == {config}
    teacher, _ = distill.load_teacher(job.spec, run.policy.info, run.mesh, run.scratch)
    assert _remat_configs(teacher) == {config}


@pytest.mark.parametrize(
    "remat,config",
    [("layer", "DECODER"), ("block", "BLOCK"), ("none", "NONE"), ("dots", "DECODER")],
)
def test_the_step_recomputes_what_remat_says(model_dir, remat, config):
    """The Tunix config says it, and the gradient's program holds that many remat calls."""
    info, extras = models.model_info(model_dir, remat=remat)
    assert info.config.remat_config.name == config
    model = models.abstract_model(info, extras, models.make_mesh(1, 1, jax.devices()[:1]))
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((2, 16), np.int32)

    def loss(state, ids):
        logits = models.forward(nnx.merge(graphdef, state), ids)
        return logits.astype(np.float32).mean()

    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(state, ids))
    per_layer = {"layer": 1, "block": 2, "none": 0, "dots": 1}[remat]
    assert jaxpr.count("remat") + jaxpr.count("checkpoint[") >= per_layer * info.num_layers
    if remat == "none":
        assert "remat" not in jaxpr and "checkpoint[" not in jaxpr


def test_auto_is_none_on_cpu_and_unknown_values_name_the_field():
    assert models.resolve_remat("auto") == "none"  # these tests run on CPU
    assert models.resolve_remat("layer") == "layer"
    with pytest.raises(ValueError, match="spec.training.remat"):
        models.resolve_remat("everything")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama3"])  # llama3: above
def test_every_family_rematerialises_to_the_same_gradient(family):
    """A layer recomputed in backward gives the gradient of keeping it, in each family."""
    ids = np.load(FIXTURES / family / "golden.npz")["input_ids"]
    grads = {}
    for remat in ("none", "layer", "dots"):
        model, info = models.load_model(FIXTURES / family, dtype=np.float32, remat=remat)
        assert info.config.remat_config.name == ("NONE" if remat == "none" else "DECODER")
        graphdef, state = nnx.split(model)

        def loss(state, graphdef=graphdef):
            logits = models.forward(nnx.merge(graphdef, state), ids)
            return (logits * logits).mean()

        grads[remat] = jax.tree.leaves(jax.grad(loss)(state))
    for remat in ("layer", "dots"):
        for a, b in zip(grads["none"], grads[remat], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_dots_keeps_the_matmuls_that_layer_recomputes(model_dir):
    """remat dots: the gradient's program recomputes none of the projections (only the
    attention scores, a batched matmul), layer all of them; and a view without remat (the
    sampler's) runs Tunix's own call."""
    flops = {}
    ids = np.zeros((2, 16), np.int32)  # short: the projections outweigh the scores
    for remat in ("none", "layer", "dots"):
        model, _ = models.load_model(model_dir, dtype=np.float32, remat=remat)
        graphdef, state = nnx.split(model)

        def loss(state, graphdef=graphdef):
            return models.forward(nnx.merge(graphdef, state), ids).mean()

        compiled = jax.jit(jax.grad(loss)).lower(state).compile()
        flops[remat] = compiled.cost_analysis()["flops"]
    recomputed = {k: flops[k] - flops["none"] for k in ("layer", "dots")}
    assert recomputed["layer"] > 0.15 * flops["none"], flops
    assert recomputed["dots"] < 0.3 * recomputed["layer"], flops  # the scores' share
    model, _ = models.load_model(model_dir, dtype=np.float32, remat="dots")
    assert type(model.layers[0]).posttrain_remat_policy == "dots"
    graphdef, state = nnx.split(models.without_remat(model))
    jaxpr = jax.make_jaxpr(lambda state: models.forward(nnx.merge(graphdef, state), ids))(state)
    assert "remat" not in str(jaxpr) and "checkpoint[" not in str(jaxpr)


def completion_length(prompts, completions, **unused):
    """A reward that tells a random model's completions apart (spec.grpo.rewards[].function
    'test_remat:completion_length'), so that GRPO's advantages and gradients are not 0."""
    return [float(len(c)) for c in completions]


def _grpo_doc(model_dir: Path, tmp_path: Path, remat: str) -> dict:
    prompts = tmp_path / "say.jsonl"
    rows = (json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) for n in range(8))
    prompts.write_text("\n".join(rows) + "\n")
    doc = tiny_job(model_dir, prompts, tmp_path / remat, steps=2, every=1000, lora=False,
                   training={"batchSize": 2, "logEverySteps": 1, "remat": remat,
                             # sgd: a float difference of a gradient stays one of the
                             # weights (adam's first steps move a weight by about the
                             # learning rate whatever its gradient, float noise's too)
                             "optimizer": "sgd", "learningRate": 1.0},
                   technique="grpo", eval={"source": str(prompts), "everySteps": 2, "samples": 0})  # fmt: skip
    doc["spec"]["data"] = {"source": str(prompts)}
    doc["spec"]["grpo"] = {
        "numGenerations": 2,
        "beta": 0.04,  # a frozen reference copy, loaded rematerialised too
        "maxPromptLength": 32,
        "maxCompletionLength": 4,
        "rewards": [{"type": "python", "function": "test_remat:completion_length"}],
    }
    return doc


def test_grpo_samples_without_remat_on_the_policys_own_weights(model_dir, tmp_path):
    """Tunix's sampler cannot run nnx.remat. With remat layer, GRPO's rollouts and
    held-out greedy completions run a view of the policy without it that holds the
    policy's very Variables (no copy; every update reaches it)."""
    from posttrain.trainer import data, grpo

    job = validated(_grpo_doc(model_dir, tmp_path, "layer"))
    run = loop.setup_run(job, ProcessInfo(None, 1, 0), show_bar=False, stop=None)
    grpo_run = grpo.GrpoRun(job, run.process, run.policy, run.tokenizer, run.mesh)
    sampler = grpo_run.cluster.rollout.model()
    assert _remat_configs(run.policy.model) == {"DECODER"}
    assert _remat_configs(sampler) == {"NONE"} and grpo_run.shares_weights
    policy_vars = jax.tree.leaves(nnx.variables(run.policy.model), is_leaf=_is_variable)
    sampler_vars = jax.tree.leaves(nnx.variables(sampler), is_leaf=_is_variable)
    assert len(policy_vars) == len(sampler_vars)
    assert all(a is b for a, b in zip(policy_vars, sampler_vars, strict=True))
    batch = next(data.build_loader(job.spec, run.tokenizer))
    assert grpo_run.rollout(batch, 0)["completion_ids"].shape == (4, 4)
    # Several processes sample on a host-local replica: a copy of that view.
    local = grpo.GrpoRun(job, run.process, run.policy, run.tokenizer, run.mesh, host_local=True)
    assert _remat_configs(local.cluster.rollout.model()) == {"NONE"}


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def test_grpo_with_remat_layer_trains_what_remat_none_trains(model_dir, tmp_path):
    """Two steps with a held-out evaluation before and after: the same losses (rtol
    1e-5), held-out rewards (exactly) and final weights (atol 1e-6; 6e-8 measured, the
    steps moving weights by up to 0.29) as without remat: recomputing a layer in backward
    only reorders float32 sums."""
    results, weights = {}, {}
    for remat in ("none", "layer"):
        results[remat] = run_job(validated(_grpo_doc(model_dir, tmp_path, remat)))
        weights[remat] = load_file(str(tmp_path / remat / "hf" / "model.safetensors"))
    none, layer = results["none"], results["layer"]
    assert layer.step == none.step == 2 and sorted(layer.evals) == [0, 2]
    assert layer.evals == none.evals
    np.testing.assert_allclose([layer.losses[s] for s in (1, 2)],
                               [none.losses[s] for s in (1, 2)], rtol=1e-5, atol=1e-7)  # fmt: skip
    base = load_file(str(model_dir / "model.safetensors"))
    moved = 0.0
    for name, value in weights["none"].items():
        np.testing.assert_allclose(weights["layer"][name], value, rtol=0, atol=1e-6)
        moved = max(moved, float(np.abs(value - base[name]).max()))
    assert moved > 1e-4  # the steps trained: the comparison is not of two untouched models
