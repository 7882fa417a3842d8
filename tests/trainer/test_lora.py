"""qwix LoRA on the Tunix models, and the PEFT adapter format.

The PEFT goldens (fixtures/<family>/peft_adapter + peft_golden.npz) were exported from
JAX by `scripts/make_hf_fixtures.py --make-peft`, and `--check-peft` (run in the torch
venv, see the script) checked that `peft` loads them onto the transformers models and
gives these logits. Here CI checks the JAX side still reproduces them.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from flax import nnx
from hf_fixtures import FIXTURE_FAMILY, FIXTURES, fixture_loader
from safetensors.numpy import load_file

from posttrain.trainer import lora as lora_lib
from posttrain.trainer import models, peft_format
from posttrain.trainer.models.saving import save_hf

pytestmark = pytest.mark.trainer

RANK, ALPHA = 4, 8.0
TOL = 1e-4
LLAMA_LIKE = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj")
GEMMA = ("attn/q_einsum", "attn/kv_einsum", "attn/attn_vec_einsum")
MLP = ("mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")


@pytest.fixture(scope="module")
def base():
    return fixture_loader()


def expected_paths(family: str, layers=(0, 1), modules=None) -> set[str]:
    if modules is None and family == "gemma3-mha":
        modules = ("attn/qkv_einsum", "attn/attn_vec_einsum") + MLP
    if modules is None:
        modules = (GEMMA if family.startswith("gemma") else LLAMA_LIKE) + MLP
    return {f"layers/{i}/{m}" for i in layers for m in modules}


@pytest.mark.parametrize("family", FIXTURE_FAMILY)
def test_default_targets_adapt_every_projection(family, base):
    model, _ = base(family)
    adapted = lora_lib.apply_lora(model, RANK, ALPHA)
    assert lora_lib.lora_module_paths(adapted) == sorted(expected_paths(family))
    flat = nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))
    names = {str(path[-1]) for path, _ in flat}
    assert names <= {"w_lora_a", "w_lora_b", "kernel_lora_a", "kernel_lora_b"}
    for path, var in flat:
        assert var.shape[-1 if str(path[-1]).endswith("_a") else 0] == RANK, path
    # the base weights stay plain params, and the original model is untouched
    plain = [
        p
        for p, v in nnx.to_flat_state(nnx.state(adapted, nnx.Param))
        if not isinstance(v, nnx.LoRAParam)
    ]
    assert plain == [p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert lora_lib.lora_module_paths(model) == []
    default = lora_lib.default_lora_targets(FIXTURE_FAMILY[family])
    assert adapted.posttrain_lora == lora_lib.LoraSettings(RANK, ALPHA, default)


def test_lora_starts_as_the_base_model(base):
    """qwix's init: lora_a random (he-uniform), lora_b zero, so x A B = 0 at the start."""
    model, _ = base("llama3")
    adapted = lora_lib.apply_lora(model, RANK, ALPHA)
    for path, var in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam)):
        value = np.asarray(var.get_value())
        if str(path[-1]).endswith("_lora_a"):
            bound = np.sqrt(6.0 / np.prod(value.shape[:-1]))
            assert 0 < np.abs(value).max() <= bound, path
        else:
            assert not value.any(), path
    again = lora_lib.apply_lora(model, RANK, ALPHA)  # deterministic for a seed
    a = adapted.layers[1].mlp.up_proj.kernel_lora_a.get_value()
    np.testing.assert_array_equal(a, again.layers[1].mlp.up_proj.kernel_lora_a.get_value())
    other = lora_lib.apply_lora(model, RANK, ALPHA, seed=1).layers[1].mlp.up_proj.kernel_lora_a
    assert not np.array_equal(a, other.get_value())


@pytest.mark.parametrize(
    ("family", "targets", "modules"),
    [
        ("llama3", ["q_proj", "v_proj"], ("attn/q_proj", "attn/v_proj")),
        ("qwen3", "q_proj, v_proj, down_proj", ("attn/q_proj", "attn/v_proj", "mlp/down_proj")),
        ("gemma3", ["q_proj", "k_proj", "v_proj", "o_proj"], GEMMA),
        ("gemma2", ["kv_einsum"], ("attn/kv_einsum",)),
        ("qwen2", "all-linear", LLAMA_LIKE + MLP),
        ("gemma3-mha", ["q_proj", "k_proj", "v_proj"], ("attn/qkv_einsum",)),
    ],
)
def test_named_targets(family, targets, modules, base):
    model, _ = base(family)
    adapted = lora_lib.apply_lora(model, RANK, ALPHA, targets)
    assert lora_lib.lora_module_paths(adapted) == sorted(expected_paths(family, modules=modules))


def test_regex_targets(base):
    model, _ = base("llama3")
    adapted = lora_lib.apply_lora(model, RANK, ALPHA, r"layers/1/(attn/o_proj|mlp/up_proj)")
    assert lora_lib.lora_module_paths(adapted) == ["layers/1/attn/o_proj", "layers/1/mlp/up_proj"]


@pytest.mark.parametrize(
    ("family", "targets", "message"),
    [
        ("llama3", r"layers/\d+/attn/(q|v)", "selects no adaptable module"),
        ("llama3", "model.layers.*q_proj", "selects no adaptable module"),
        ("llama3", r"layers/\d+/attn", "selects no adaptable module"),  # a module without weights
        ("gemma2", r".*/(q_proj|v_proj)", "selects no adaptable module"),
        ("llama3", ["q_proj", "qproj"], "no module named 'qproj'"),
        ("gemma3", ["gate", "up_proj"], "no module named 'gate'"),
        ("gemma2", ["q_proj", "k_proj"], "k_proj and v_proj are one fused projection"),
        ("gemma3-mha", ["q_proj", "o_proj"], "fuses q, k and v"),
        ("qwen2", "layers/(", "not a valid regular expression"),
    ],
)
def test_bad_targets_name_the_field(family, targets, message, base):
    model, _ = base(family)
    with pytest.raises(ValueError, match=r"spec\.lora\.targetModules") as err:
        lora_lib.apply_lora(model, RANK, ALPHA, targets)
    assert message in str(err.value)


@pytest.mark.parametrize("family", FIXTURE_FAMILY)
def test_peft_golden(family, base, tmp_path):
    """A committed adapter (that peft loads onto transformers with these logits) gives the
    same logits here, and exporting it again reproduces the committed files."""
    model, info = base(family)
    adapted = lora_lib.apply_lora(model, RANK, ALPHA)
    adapter = FIXTURES / family / "peft_adapter"
    peft_format.load_peft_adapter(adapted, adapter)
    golden = np.load(FIXTURES / family / "peft_golden.npz")
    logits = np.asarray(models.forward(adapted, golden["input_ids"]))
    np.testing.assert_allclose(logits, golden["logits"], atol=TOL, rtol=0)
    base_logits = np.load(FIXTURES / family / "golden.npz")["logits"]
    assert np.abs(logits - base_logits).max() > 100 * TOL  # the adapter does something

    out = peft_format.save_peft_adapter(
        adapted, tmp_path / "adapter", info, base_model_name=f"posttrain-fixtures/tiny-{family}"
    )
    committed, exported = (
        load_file(adapter / "adapter_model.safetensors"),
        load_file(out / "adapter_model.safetensors"),
    )
    assert set(exported) == set(committed)
    for key in committed:
        np.testing.assert_array_equal(exported[key], committed[key], err_msg=key)
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (adapter / "adapter_config.json").read_text()
    )


@pytest.mark.parametrize("family", ["llama3", "gemma2", "gemma3-mha"])
def test_adapter_uses_peft_names_and_shapes(family, base, tmp_path):
    model, info = base(family)
    adapted = lora_lib.apply_lora(model, RANK, ALPHA)
    out = peft_format.save_peft_adapter(adapted, tmp_path, info, base_model_name="org/base")
    tensors = load_file(out / "adapter_model.safetensors")
    d, f = info.hidden_size, info.intermediate_size
    n, k, h = info.num_heads, info.num_kv_heads, info.head_dim
    in_out = {
        "self_attn.q_proj": (d, n * h),
        "self_attn.k_proj": (d, k * h),
        "self_attn.v_proj": (d, k * h),
        "self_attn.o_proj": (n * h, d),
        "mlp.gate_proj": (d, f),
        "mlp.up_proj": (d, f),
        "mlp.down_proj": (f, d),
    }
    expected = set()
    for i in range(info.num_layers):
        for module, (fan_in, fan_out) in in_out.items():
            key = f"base_model.model.model.layers.{i}.{module}"
            expected |= {f"{key}.lora_A.weight", f"{key}.lora_B.weight"}
            assert tensors[f"{key}.lora_A.weight"].shape == (RANK, fan_in)
            assert tensors[f"{key}.lora_B.weight"].shape == (fan_out, RANK)
    assert set(tensors) == expected
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["bias"]) == (
        RANK,
        ALPHA,
        0.0,
        "none",
    )
    assert cfg["inference_mode"] is True and cfg["base_model_name_or_path"] == "org/base"
    assert sorted(cfg["target_modules"]) == sorted(m.split(".")[-1] for m in in_out)
    if family == "gemma2":  # k and v share the fused kv_einsum's lora_A
        key = "base_model.model.model.layers.0.self_attn"
        np.testing.assert_array_equal(
            tensors[f"{key}.k_proj.lora_A.weight"], tensors[f"{key}.v_proj.lora_A.weight"]
        )


def test_partial_targets_export_a_regex_that_peft_full_matches(base, tmp_path):
    model, info = base("qwen2")
    adapted = lora_lib.apply_lora(model, RANK, ALPHA, r"layers/0/attn/(q_proj|v_proj)")
    out = peft_format.save_peft_adapter(adapted, tmp_path, info)
    target = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert isinstance(target, str)
    names = [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj")
    ]
    assert [n for n in names if re.fullmatch(target, n)] == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    ]


@pytest.mark.parametrize("family", ["llama3", "gemma3-mha"])
def test_merged_export_equals_lora_model(family, base, tmp_path):
    """save_hf merges (alpha / r) * B @ A into the weights: same logits as the adapter."""
    model, info = base(family)
    adapted = lora_lib.apply_lora(model, RANK, ALPHA)
    peft_format.load_peft_adapter(adapted, FIXTURES / family / "peft_adapter")
    merged, _ = models.load_model(save_hf(adapted, tmp_path / "merged", info))
    golden = np.load(FIXTURES / family / "peft_golden.npz")
    logits = np.asarray(models.forward(merged, golden["input_ids"]))
    np.testing.assert_allclose(logits, golden["logits"], atol=TOL, rtol=0)


def test_restore_refuses_mismatched_adapters(base):
    model, _ = base("llama3")
    adapter = FIXTURES / "llama3" / "peft_adapter"
    with pytest.raises(ValueError, match=r"spec\.lora\.restoreFrom.*r=4.*rank=8"):
        peft_format.load_peft_adapter(lora_lib.apply_lora(model, 8, ALPHA), adapter)
    with pytest.raises(ValueError, match=r"spec\.lora\.restoreFrom.*does not\s+target"):
        peft_format.load_peft_adapter(lora_lib.apply_lora(model, RANK, ALPHA, ["q_proj"]), adapter)
    with pytest.raises(FileNotFoundError, match=r"spec\.lora\.restoreFrom.*lacks"):
        peft_format.load_peft_adapter(
            lora_lib.apply_lora(model, RANK, ALPHA, "all-linear"), FIXTURES / "llama3"
        )
    with pytest.raises(ValueError, match="no LoRA adapters"):
        peft_format.load_peft_adapter(model, adapter)
