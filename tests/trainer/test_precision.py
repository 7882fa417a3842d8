"""Mixed precision (spec.model.dtype bfloat16) on CPU with a tiny random Llama.

What trains is float32 (the master weights and their optimizer state), the forward and
backward passes run in bfloat16, logits and the loss in float32: a full fine-tune holds
float32 weights and computes with bfloat16 casts of them; LoRA holds a bfloat16 base and
float32 adapters whose layers still output bfloat16.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from tiny_job import run_job, tiny_job, validated

from posttrain.trainer import models, optim, peft_format, sft
from posttrain.trainer.models.saving import save_hf
from posttrain.trainer.policy import load_policy

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "chat-sft.jsonl"
BF16 = np.dtype(ml_dtypes.bfloat16)


def make_spec(model_dir: Path, out: Path, *, dtype="bfloat16", lora=True, **training):
    doc = tiny_job(
        model_dir,
        DATA,
        out,
        name="p",
        steps=4,
        every=2,
        lora=lora,
        dtype=dtype,
        training={"logEverySteps": 1, **training},
    )
    return validated(doc)


class Trainer:
    """What loop.train builds for SFT (policy, optimizer, step), one batch at a time."""

    def __init__(self, job):
        spec = job.spec
        self.policy = load_policy(spec, models.make_mesh(), Path(tempfile.mkdtemp()))
        self.model, self.wrt = self.policy.model, self.policy.wrt
        self.opt = nnx.Optimizer(self.model, optim.optimizer(spec.training), wrt=self.wrt)
        self._step = sft.make_train_step(self.wrt, spec.training.gradient_accumulation)

    def step(self, batch):
        return self._step(self.model, self.opt, batch)


def make_batch(rows=4, length=16, seed=0) -> dict[str, jax.Array]:
    ids = np.random.default_rng(seed).integers(3, 400, (rows, length)).astype(np.int32)
    ones = np.ones_like(ids)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape)
    batch = {"input_ids": ids, "loss_mask": ones, "segment_ids": ones, "positions": positions}
    return {k: jnp.asarray(v) for k, v in batch.items()}


def dtypes(state) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)}


def nbytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


def op_dtypes(fn, model) -> dict[str, set[str]]:
    """Primitive name -> dtypes of its outputs, over the traced ``fn(model)`` (nested
    jaxprs included)."""
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s: fn(nnx.merge(graphdef, s)))(state).jaxpr
    out: dict[str, set[str]] = defaultdict(set)

    def walk(j):
        for eqn in j.eqns:
            out[eqn.primitive.name] |= {str(v.aval.dtype) for v in eqn.outvars}
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jaxpr)
    return out


@pytest.fixture(scope="module")
def lora_bf16(model_dir, tmp_path_factory):
    """A bfloat16 LoRA policy after one optimizer step."""
    trainer = Trainer(make_spec(model_dir, tmp_path_factory.mktemp("lora")))
    trainer.step(make_batch())
    return trainer


def test_lora_adapters_and_their_optimizer_state_are_float32_on_a_bfloat16_base(lora_bf16):
    model = lora_bf16.model
    adapters = nnx.state(model, nnx.LoRAParam)
    base = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    opt_state = nnx.state(lora_bf16.opt)
    assert jax.tree.leaves(adapters) and dtypes(adapters) == {"float32"}
    assert dtypes(base) == {"bfloat16"}
    assert dtypes(opt_state) == {"float32"}
    # AdamW's two moments, one per adapter param: float32 like their masters
    assert nbytes(opt_state) >= 2 * nbytes(adapters)
    print(
        f"\nbf16 LoRA: base {nbytes(base)} B (bf16), adapters {nbytes(adapters)} B (fp32), "
        f"optimizer state {nbytes(opt_state)} B (fp32)"
    )


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_training_forward_computes_in_bfloat16_and_the_loss_in_float32(
    use_lora, lora_bf16, model_dir, tmp_path
):
    if use_lora:
        model = lora_bf16.model
    else:
        model = Trainer(make_spec(model_dir, tmp_path, lora=False)).model
        assert dtypes(nnx.state(model, nnx.Param)) == {"float32"}
    ops = op_dtypes(lambda m: sft.token_nll(m, make_batch()), model)
    # every matmul (projections, adapters, attention, output head) in bfloat16 ...
    assert ops["dot_general"] == {"bfloat16"}
    # ... softmaxes, the log-softmax of the logits, and the loss in float32
    assert ops["exp"] == {"float32"} and ops["log"] == {"float32"}


def test_lora_layers_output_bfloat16_outside_the_training_step(lora_bf16, monkeypatch):
    """Called as it is (as a rollout sampler calls it), the model's float32 adapters do
    not promote the activations: every decoder layer outputs bfloat16, and so do the
    logits."""
    model = lora_bf16.model
    layer_cls = type(model.layers[0])
    call, seen = layer_cls.__call__, []

    def recording(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        seen.extend(str(x.dtype) for x in jax.tree.leaves(out) if x.dtype != jnp.int32)
        return out

    monkeypatch.setattr(layer_cls, "__call__", recording)
    ids = jnp.asarray([[5, 17, 42, 99, 7, 3]], jnp.int32)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    logits, _ = model(ids, positions, None, models.causal_mask(jnp.ones_like(ids, jnp.bool_)))
    assert len(seen) == len(model.layers) and set(seen) == {"bfloat16"}
    assert logits.dtype == jnp.bfloat16
    # and the KV-cache decoding of models.greedy_generate runs on it
    assert len(models.greedy_generate(model, None, [5, 17, 42], 3).token_ids) == 3


def test_an_update_below_bfloat16_resolution_reaches_the_float32_master(model_dir, tmp_path):
    """Adam's first step moves every weight by about the learning rate: 1e-4 is below
    half a bfloat16 step at 1.0 (2^-9), so bfloat16 weights would not move at all."""
    trainer = Trainer(
        make_spec(
            model_dir, tmp_path, lora=False, learningRate=1e-4, weightDecay=0.0, schedule="constant"
        )
    )
    norms = lambda: np.stack(  # noqa: E731  (RMSNorm weights start at exactly 1.0)
        [np.asarray(layer.input_layernorm.w.get_value()) for layer in trainer.model.layers]
    )
    assert np.all(norms() == 1.0)
    trainer.step(make_batch())
    after = norms()
    assert after.dtype == np.float32
    moved = np.abs(after - 1.0)
    assert np.mean(moved > 0) > 0.9 and moved.max() == pytest.approx(1e-4, rel=0.01)
    assert np.all(after.astype(BF16) == 1.0)  # what a bfloat16 copy would hold


def test_full_finetune_in_bfloat16_keeps_float32_weights_and_resumes_bitwise(model_dir, tmp_path):
    def train(dtype, out):
        job = make_spec(model_dir, out, dtype=dtype, lora=False)
        return run_job(job)

    bf16 = train("bfloat16", tmp_path / "bf16")
    fp32 = train("float32", tmp_path / "fp32")
    a, b = (np.array([r.losses[s] for s in sorted(r.losses)]) for r in (bf16, fp32))
    print(f"\nfull fine-tune losses: bf16 compute {a.round(5)}, fp32 {b.round(5)}")
    np.testing.assert_allclose(a, b, rtol=1e-2)  # the same training ...
    assert not np.array_equal(a, b)  # ... computed in another dtype

    exported = tmp_path / "bf16" / "hf" / "model.safetensors"
    with safe_open(str(exported), framework="numpy") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert {w.dtype for w in weights.values()} == {np.dtype(np.float32)}  # the masters

    # resume from step 2 (as if the run died after it): the same masters, bit for bit
    shutil.rmtree(tmp_path / "bf16" / "checkpoints" / "4")
    shutil.rmtree(tmp_path / "bf16" / "hf")
    again = train("bfloat16", tmp_path / "bf16")
    assert again.resumed_from == 2 and again.losses[4] == bf16.losses[4]
    with safe_open(str(exported), framework="numpy") as f:
        for key, value in weights.items():
            assert np.array_equal(f.get_tensor(key), value), key


def test_adapter_exports_from_a_bfloat16_base(lora_bf16, tmp_path):
    """PEFT adapter: float32 (the masters, lossless), read back bit for bit into float32
    adapters (spec.lora.restoreFrom). Merged model: the base's bfloat16, the delta added
    in float32."""
    model, info = lora_bf16.model, lora_bf16.policy.info
    adapter = peft_format.save_peft_adapter(model, tmp_path / "adapter", info)
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="numpy") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {np.dtype(np.float32)}  # noqa: SIM118

    fresh = Trainer(make_spec(info.model_dir, tmp_path / "fresh")).model
    peft_format.load_peft_adapter(fresh, adapter, info)
    restored = dict(nnx.to_flat_state(nnx.state(fresh, nnx.LoRAParam)))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value = restored[path].get_value()
        assert value.dtype == jnp.float32
        assert np.array_equal(np.asarray(value), np.asarray(var.get_value())), path

    out = save_hf(model, tmp_path / "merged", info)
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        merged = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert merged.dtype == BF16
    q = model.layers[0].attn.q_proj  # w [in, heads, head_dim], A [in, r], B [r, heads, head_dim]
    a = np.ascontiguousarray(np.asarray(q.w_lora_a.get_value()).T)  # PEFT lora_A [r, in]
    b = np.ascontiguousarray(np.asarray(q.w_lora_b.get_value()).reshape(4, -1).T)  # [out, r]
    base = np.asarray(q.w.get_value()).reshape(a.shape[1], -1).T  # HF [out, in], bfloat16
    expected = (base.astype(np.float32) + 2.0 * (b @ a)).astype(BF16)  # alpha / rank = 2
    np.testing.assert_array_equal(merged.view(np.uint16), expected.view(np.uint16))
