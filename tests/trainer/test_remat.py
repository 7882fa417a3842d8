"""spec.training.remat: a decoder layer (or its attention and MLP) recomputed in backward
instead of kept trains the same losses as keeping everything, is really in the step, and
reaches every model a job loads from its spec alone."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import FAMILIES, FIXTURES
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
    "remat,config", [("layer", "DECODER"), ("block", "BLOCK"), ("none", "NONE")]
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
    per_layer = {"layer": 1, "block": 2, "none": 0}[remat]
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
    for remat in ("none", "layer"):
        model, info = models.load_model(FIXTURES / family, dtype=np.float32, remat=remat)
        assert info.config.remat_config.name == ("DECODER" if remat == "layer" else "NONE")
        graphdef, state = nnx.split(model)

        def loss(state, graphdef=graphdef):
            logits = models.forward(nnx.merge(graphdef, state), ids)
            return (logits * logits).mean()

        grads[remat] = jax.tree.leaves(jax.grad(loss)(state))
    for a, b in zip(grads["none"], grads["layer"], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
