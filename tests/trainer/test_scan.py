"""spec.training.layerLoop: scan: decoder layers stored stacked and run by one lax.scan
give the unrolled model's logits, gradients, generations, training losses and exports;
a job resumes from checkpoints written with either loop."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import FIXTURES
from safetensors.numpy import load_file
from tiny_job import run_job, tiny_job, validated
from tiny_model import make_tiny_llama

from posttrain.checks import validate
from posttrain.trainer import lora, models, policy, sft
from posttrain.trainer.models import scan

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "chat-sft.jsonl"
SCANNED = ("llama3", "qwen2", "qwen3")


def _batch(rows: int = 2, length: int = 8) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    lengths = [length, length - 3]
    mask = np.array([[i < n for i in range(length)] for n in lengths[:rows]], np.int32)
    return {
        "input_ids": jnp.asarray(rng.integers(1, 60, (rows, length)) * mask, jnp.int32),
        "loss_mask": jnp.asarray(mask),
        "segment_ids": jnp.asarray(mask),
        "positions": jnp.asarray(np.maximum(np.cumsum(mask, -1) - 1, 0), jnp.int32),
    }


def _grads(model: nnx.Module, wrt) -> dict[tuple, np.ndarray]:
    """d(summed token NLL)/d(params), keyed by per-layer paths."""
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def loss(params):  # the frozen rest copied in the trace, as optim.accumulate does
        return sft.token_nll(nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest)),
                             _batch())[0]  # fmt: skip

    grads = jax.grad(loss)(params)
    nnx.update(model, grads)  # the gradients where the params were, to read them by path
    return {p: np.asarray(v.get_value()) for p, v in scan.flat_state(model, wrt).items()}


@pytest.mark.parametrize("family", SCANNED)
@pytest.mark.parametrize("remat", ["none", "dots"])
@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_scanned_layers_give_the_unrolled_logits_and_gradients(family, remat, adapters):
    def load():
        model, _ = models.load_model(FIXTURES / family, dtype=jnp.float32, remat=remat)
        return lora.apply_lora(model, 4, 8.0) if adapters else model

    wrt = nnx.LoRAParam if adapters else nnx.Param
    unrolled, stacked = load(), scan.stack(load())
    assert scan.is_stacked(stacked) and not scan.is_stacked(unrolled)
    assert len(stacked.layers) == len(unrolled.layers)
    if adapters:  # the adapters trained a little, so that the LoRA path moves the logits
        for model in (unrolled, stacked):
            nnx.update(model, jax.tree.map(lambda x: x + 0.01, nnx.state(model, nnx.LoRAParam)))
    batch = _batch()
    want = models.forward(unrolled, batch["input_ids"], batch["loss_mask"])
    got = models.forward(stacked, batch["input_ids"], batch["loss_mask"])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if remat == "dots":  # the layer's remat policy is the scanned body's
        assert models.remat.policy_of(stacked) == "dots"
    want_grads, got_grads = _grads(unrolled, wrt), _grads(stacked, wrt)
    assert got_grads.keys() == want_grads.keys()
    for path, value in want_grads.items():  # float32 sums in another order: 1e-5 of the scale
        atol = 1e-5 * float(np.abs(value).max())
        np.testing.assert_allclose(got_grads[path], value, rtol=1e-4, atol=atol, err_msg=str(path))


def test_stacked_parameters_keep_their_sharding_below_the_layer_axis():
    model, _ = models.load_model(FIXTURES / "qwen3", dtype=jnp.float32)
    per_layer = {p: v.get_value().sharding for p, v in nnx.to_flat_state(nnx.state(model))}
    scan.stack(model)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[:2] != ("layers", scan.STACKED):
            continue
        before = per_layer[("layers", 0, *path[2:])]
        assert var.get_value().shape[0] == 2
        assert tuple(var.get_value().sharding.spec) == (None, *before.spec), path


def test_generation_over_a_stacked_cache_gives_the_unrolled_tokens():
    unrolled, _ = models.load_model(FIXTURES / "qwen3", dtype=jnp.float32)
    stacked = scan.stack(models.load_model(FIXTURES / "qwen3", dtype=jnp.float32)[0])
    cache = models.init_cache(stacked, 1, 16)
    assert list(cache) == ["layer_0"] and cache["layer_0"]["k"].shape[0] == 2
    prompt = [5, 9, 13, 2, 7]
    want = models.greedy_generate(unrolled, None, prompt, 10).token_ids
    assert models.greedy_generate(stacked, None, prompt, 10).token_ids == want


def test_a_checkpoint_tree_converts_between_layouts():
    per_layer = {"params": {"embedder": {"w": jnp.ones((3, 2))},
                            "layers": {i: {"w": jnp.full((2, 4), float(i))} for i in range(3)}},
                 "opt": {"mu": {"layers": {i: {"w": jnp.full((2, 4), -i)} for i in range(3)}}}}  # fmt: skip
    assert scan.layout_of(per_layer) is False
    stacked = scan.to_layout(per_layer, True)
    assert scan.layout_of(stacked) is True
    assert stacked["params"]["layers"][scan.STACKED]["w"].shape == (3, 2, 4)
    np.testing.assert_array_equal(stacked["opt"]["mu"]["layers"][scan.STACKED]["w"][:, 0, 0],
                                  [0, -1, -2])  # fmt: skip
    back = scan.to_layout(stacked, False)
    assert jax.tree.structure(back) == jax.tree.structure(per_layer)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(per_layer), strict=True):
        np.testing.assert_array_equal(a, b)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stacked)
    assert scan.to_layout(abstract, False)["params"]["layers"][2]["w"].shape == (2, 4)
    assert scan.layout_of({"params": {"embedder": {}}}) is None


def test_layer_loop_resolves_and_refuses_by_name():
    for family in SCANNED:  # auto: scan on a TPU, where the chip measured it (docs/tpu.md)
        assert scan.resolve("auto", family=family, platform="tpu") == "scan"
        assert scan.resolve("auto", family=family, platform="cpu") == "unroll"
        assert scan.resolve("auto", family=family, platform="gpu") == "unroll"
        assert scan.resolve("auto", family=family, platform="tpu", grpo=True) == "unroll"
    assert scan.resolve("auto", family="gemma3", platform="tpu") == "unroll"
    assert scan.resolve("auto", family="qwen3") == "unroll"  # this machine's backend: CPU
    assert scan.resolve("scan", family="llama3", platform="cpu") == "scan"
    assert scan.resolve("unroll", family="llama3", platform="tpu") == "unroll"
    with pytest.raises(ValueError, match=r"spec\.training\.layerLoop: scan, but the gemma3"):
        scan.resolve("scan", family="gemma3")
    doc = tiny_job("m", DATA, "out", steps=1, every=1, training={"layerLoop": "scan"},
                   technique="grpo", grpo={"rewards": [{"type": "lengthPenalty"}]})  # fmt: skip
    errors = [str(e) for e in validate(doc)[1]]
    assert any("training.layerLoop" in e and "grpo" in e for e in errors), errors
    doc = tiny_job("m", DATA, "out", steps=1, every=1, training={"layerLoop": "scan"})
    doc["spec"]["model"]["family"] = "gemma3"
    errors = [str(e) for e in validate(doc)[1]]
    assert any("training.layerLoop" in e and "Gemma" in e for e in errors), errors
    doc["spec"]["training"]["layerLoop"] = "sideways"
    errors = [str(e) for e in validate(doc)[1]]
    assert any("training.layerLoop" in e and "unroll" in e for e in errors), errors


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("scan") / "llama")


def _run(model: Path, out: Path, loop: str, steps: int, lora: bool, **sections) -> list[float]:
    data = ROOT / "examples" / "data" / "preferences-dpo.jsonl" if "dpo" in sections else DATA
    doc = tiny_job(model, data, out, steps=steps, every=2, lora=lora,
                   training={"logEverySteps": 1, "layerLoop": loop}, **sections)  # fmt: skip
    result = run_job(validated(doc))
    return [result.losses[s] for s in sorted(result.losses)]


@pytest.mark.parametrize("adapters", [True, False], ids=["lora", "full"])
def test_a_scanned_job_trains_and_exports_what_an_unrolled_one_does(llama, tmp_path, adapters):
    unrolled = _run(llama, tmp_path / "unroll", "unroll", 4, adapters)
    scanned = _run(llama, tmp_path / "scan", "scan", 4, adapters)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)
    name = "adapter_model.safetensors" if adapters else "model.safetensors"
    (want,) = (tmp_path / "unroll").rglob(name)
    (got,) = (tmp_path / "scan").rglob(name)
    want, got = load_file(want), load_file(got)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("technique", ["dpo", "distill"])
def test_the_reference_and_the_teacher_scan_with_the_policy(llama, tmp_path, technique):
    """DPO's reference (the policy with its adapters zeroed) and a distillation teacher
    (its own model, stacked as well) give the unrolled losses."""
    sections = (
        {"technique": technique, "dpo": {"beta": 0.1}}
        if technique == "dpo"
        else {
            "technique": "distill",
            "distill": {"teacher": {"source": str(llama), "dtype": "float32"}, "alpha": 0.5},
        }
    )
    unrolled = _run(llama, tmp_path / "unroll", "unroll", 2, technique == "dpo", **sections)
    scanned = _run(llama, tmp_path / "scan", "scan", 2, technique == "dpo", **sections)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)


@pytest.mark.parametrize("first,then", [("unroll", "scan"), ("scan", "unroll")])
def test_a_job_resumes_from_a_checkpoint_of_the_other_layer_loop(llama, tmp_path, first, then):
    out = tmp_path / "out"
    _run(llama, out, first, 4, True)
    straight = load_file(out / "hf" / "adapter_model.safetensors")
    # as if the run had died after its step-2 checkpoint, and came back with the other loop
    shutil.rmtree(out / "checkpoints" / "4")
    shutil.rmtree(out / "hf")
    resumed = run_job(validated(tiny_job(llama, DATA, out, steps=4, every=2,
                                         training={"layerLoop": then})))  # fmt: skip
    assert resumed.resumed_from == 2 and resumed.step == 4
    again = load_file(out / "hf" / "adapter_model.safetensors")
    for key, value in straight.items():
        np.testing.assert_allclose(again[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    assert not list(out.rglob("*.unreadable")), "a checkpoint was set aside"


def test_layers_that_differ_are_refused_by_the_field():
    """LoRA on only the first layer: the layers are no longer alike, and scan says so."""
    model, _ = models.load_model(FIXTURES / "qwen3", dtype=jnp.float32)
    model = lora.apply_lora(model, 4, 8.0, r"layers/0/attn/q_proj")
    with pytest.raises(ValueError, match=r"spec\.training\.layerLoop: scan, .*targetModules"):
        scan.stack(model)


def test_auto_on_a_tpu_scans_alike_layers_and_unrolls_layers_that_differ():
    """auto scans on a TPU; LoRA on only some layers keeps the list there, where scan
    itself is refused (above)."""
    tpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu")]))
    spec = validated(tiny_job("m", DATA, "out", steps=1, every=1)).spec
    assert str(spec.training.layer_loop) == "auto"
    model, _ = models.load_model(FIXTURES / "qwen3", dtype=jnp.float32)
    model = lora.apply_lora(model, 4, 8.0)
    assert scan.alike(model) and scan.is_stacked(policy.apply_layer_loop(spec, model, "qwen3", tpu))
    model, _ = models.load_model(FIXTURES / "qwen3", dtype=jnp.float32)
    model = lora.apply_lora(model, 4, 8.0, r"layers/0/attn/q_proj")
    assert not scan.alike(model)
    assert not scan.is_stacked(policy.apply_layer_loop(spec, model, "qwen3", tpu))


def test_stacking_frees_each_parameters_layers_as_it_goes(monkeypatch):
    """The load's high-water mark is the weights once plus one parameter's stack, not the
    layers twice (on a TPU the runtime reserves a step's temporaries below that mark)."""
    model, _ = models.load_model(FIXTURES / "qwen3", dtype=jnp.float32)
    layers = list(model.layers)
    per_layer = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(layers))]

    def live_bytes() -> int:
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())

    before, largest, seen = live_bytes(), max(a.nbytes for a in per_layer) * len(layers), []
    stack_value = scan._stacked_value
    monkeypatch.setattr(scan, "_stacked_value",
                        lambda values: seen.append(live_bytes()) or stack_value(values))  # fmt: skip
    scan.stack(model)
    seen.append(live_bytes())
    assert all(a.is_deleted() for a in per_layer)
    assert max(seen) <= before + largest, (max(seen), before, largest)
    assert seen[-1] == before  # the weights once, stacked
