"""LoRA for the Tunix models of ``posttrain.trainer.models``: qwix adapters and the PEFT format.

- ``apply_lora`` adds qwix LoRA adapters (``nnx.LoRAParam``) to the modules a regex or a
  list of module names selects, and refuses a selection that adapts nothing or not what
  it names (errors name ``spec.lora.targetModules``).
- ``save_peft_adapter`` / ``load_peft_adapter`` write and read the Hugging Face ``peft``
  format (``adapter_model.safetensors`` + ``adapter_config.json``).

qwix computes ``y = x W + (alpha / rank) * (x A) B``, the same scaling as ``peft``'s
``lora_alpha / r`` (no rsLoRA). For a Tunix weight, qwix's ``A`` holds the contracted
axes (HF ``in_features``, row-major) and ``B`` the others (HF ``out_features``), so
``lora_A.weight = A.reshape(-1, r).T`` and ``lora_B.weight = B.reshape(r, -1).T``. Gemma's
fused ``kv_einsum`` (and ``qkv_einsum``) has one ``A`` for k and v: it exports as
``k_proj`` and ``v_proj`` with equal ``lora_A``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from safetensors import safe_open
from tunix.models.gemma import model as gemma2_lib
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from posttrain.api import lora_modules
from posttrain.api.patterns import compile_user_regex
from posttrain.trainer import models

TARGET_FIELD = "spec.lora.targetModules"
RESTORE_FIELD = "spec.lora.restoreFrom"
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

_TUNIX_NAMES = lora_modules.TUNIX_NAMES
_HF_TO_TUNIX = lora_modules.HF_TO_TUNIX


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """How a model's LoRA was made (kept on the model as ``posttrain_lora``)."""

    rank: int
    alpha: float
    target_regex: str

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _kind(family: str) -> str:
    return lora_modules.kind(family)


def family_of(model: nnx.Module) -> str:
    """The posttrain family of a Tunix model instance."""
    for cls, family in (
        (llama3_lib.Llama3, "llama3"),
        (qwen2_lib.Qwen2, "qwen2"),
        (qwen3_lib.Qwen3, "qwen3"),
        (gemma3_lib.Gemma3, "gemma3"),
        (gemma2_lib.Gemma, "gemma2"),
    ):
        if isinstance(model, cls):
            return family
    raise TypeError(f"not a Tunix model of a supported family: {type(model).__name__}")


def default_lora_targets(family: str) -> str:
    """qwix module-path regex of the default LoRA targets: every attention and MLP
    projection of every layer (PEFT's ``all-linear`` without the output head)."""
    if family not in models.FAMILIES:
        raise ValueError(
            f"spec.model.family: {family!r} is not one of {', '.join(models.FAMILIES)}"
        )
    if _kind(family) == "gemma":
        return r"layers/\d+/(attn/(q_einsum|kv_einsum|qkv_einsum|attn_vec_einsum)|mlp/(gate_proj|up_proj|down_proj))"
    return r"layers/\d+/(attn/(q_proj|k_proj|v_proj|o_proj)|mlp/(gate_proj|up_proj|down_proj))"


def _module_path(path: Sequence[Any]) -> str:
    return "/".join(str(p) for p in path)


def adaptable_modules(model: nnx.Module) -> dict[str, str]:
    """Module path -> weight name, for every module LoRA can adapt (Linear / Einsum)."""
    out = {}
    for path, module in (
        nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
    ):
        if isinstance(module, nnx.Linear):
            out[_module_path(path)] = "kernel"
        elif hasattr(module, "einsum_str") and isinstance(getattr(module, "w", None), nnx.Param):
            out[_module_path(path)] = "w"
    return out


_NAME_LIST = lora_modules.NAME_LIST


def resolve_targets(
    family: str, target_modules: str | Sequence[str] | None, adaptable: Sequence[str] = ()
) -> str:
    """The qwix regex for ``spec.lora.targetModules``.

    Accepts None (the family default), ``"all-linear"``, a regex over module paths such
    as ``layers/0/attn/q_proj``, or module names (a list, or a comma-separated string)
    in Hugging Face (``q_proj``) or Tunix (``q_einsum``) spelling.
    """
    if target_modules is None or (isinstance(target_modules, str) and not target_modules.strip()):
        return default_lora_targets(family)
    kind = _kind(family)
    if isinstance(target_modules, str):
        if target_modules.strip() == "all-linear":
            return default_lora_targets(family)
        if not _NAME_LIST.fullmatch(target_modules):
            compile_user_regex(target_modules, TARGET_FIELD)
            return target_modules
        names = [n.strip() for n in target_modules.split(",")]
    else:
        names = [str(n) for n in target_modules]
    aliases = _HF_TO_TUNIX[kind]
    unknown = [n for n in names if n not in aliases]
    if unknown:
        raise ValueError(
            f"{TARGET_FIELD}: {family} has no module named {', '.join(map(repr, unknown))}; "
            f"valid names: {', '.join(sorted(aliases))} (or a regex over module paths such as "
            f"{default_lora_targets(family)!r})"
        )
    if kind == "gemma" and ("k_proj" in names) != ("v_proj" in names):
        raise ValueError(
            f"{TARGET_FIELD}: in {family}, k_proj and v_proj are one fused projection "
            "(kv_einsum): list both or neither"
        )
    tunix = sorted({aliases[n] for n in names})
    if kind == "gemma" and any(p.endswith("qkv_einsum") for p in adaptable):
        # q, k and v are fused into qkv_einsum in this model (num_heads == num_kv_heads)
        qkv = {"q_einsum", "kv_einsum", "qkv_einsum"}
        if qkv & set(tunix):
            if not ({"q_proj", "k_proj", "v_proj"} <= set(names) or "qkv_einsum" in names):
                raise ValueError(
                    f"{TARGET_FIELD}: this {family} model fuses q, k and v (qkv_einsum): "
                    "list q_proj, k_proj and v_proj together"
                )
            tunix = sorted((set(tunix) - qkv) | {"qkv_einsum"})
    return r"(.*/)?(" + "|".join(tunix) + r")"


def lora_module_paths(model: nnx.Module) -> list[str]:
    """Sorted paths (``layers/0/attn/q_proj``) of the modules that carry LoRA params."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    return sorted({_module_path(path[:-1]) for path, _ in flat})


def apply_lora(
    model: nnx.Module,
    rank: int,
    alpha: float,
    target_regex: str | Sequence[str] | None = None,
    mesh=None,
    *,
    dropout: float = 0.0,
    seed: int = 0,
) -> nnx.Module:
    """A copy of ``model`` with qwix LoRA adapters on the modules ``target_regex`` selects.

    ``target_regex``: see ``resolve_targets`` (None = ``default_lora_targets(family)``).
    Raises ValueError naming ``spec.lora.targetModules`` when the selection adapts no
    module, or when a selected module did not get an adapter.
    """
    if rank <= 0:
        raise ValueError(f"spec.lora.rank must be positive, got {rank}")
    family = family_of(model)
    adaptable = adaptable_modules(model)
    regex = resolve_targets(family, target_regex, list(adaptable))
    expected = {p for p in adaptable if re.fullmatch(regex, p)}
    if not expected:
        examples = sorted(adaptable, key=_natural)[:4]
        raise ValueError(
            f"{TARGET_FIELD}: {target_regex!r} selects no adaptable module of this {family} "
            f"model (regex {regex!r}, full match against paths such as {', '.join(examples)}); "
            f"the default is {default_lora_targets(family)!r}"
        )
    provider = _LoraProvider(module_path=regex, rank=rank, alpha=alpha, dropout=dropout)
    mesh = mesh if mesh is not None else _mesh_of(model)
    batch = int(mesh.shape.get("fsdp", 1))
    args = (
        jnp.ones((batch, 1), jnp.int32),
        jnp.zeros((batch, 1), jnp.int32),
        None,
        jnp.ones((batch, 1, 1), jnp.bool_),
    )

    # qwix creates the adapters during one forward pass. Run it abstractly (a trace, no
    # compilation, no device memory), then take the base params from `model` and make
    # the LoRA params here, each host building only its shards.
    def adapt(base):
        return qwix.apply_lora_to_model(base, provider, *args, rngs=nnx.Rngs(seed))

    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(adapt, model)
    graphdef, abs_state = nnx.split(abstract)
    base = dict(nnx.to_flat_state(nnx.state(model)))
    flat = {}
    lora_paths = sorted(
        (p for p, v in nnx.to_flat_state(abs_state) if isinstance(v, nnx.LoRAParam)), key=str
    )
    for path, var in nnx.to_flat_state(abs_state):
        if isinstance(var, nnx.LoRAParam):
            flat[path] = var.copy(_init_lora(var, path, lora_paths.index(path), seed, mesh))
        elif path in base:
            flat[path] = base[path].copy()
        else:
            raise RuntimeError(f"posttrain bug: qwix added non-LoRA state {path}")
    lora_model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    got = set(lora_module_paths(lora_model))
    if got != expected:
        missing, extra = sorted(expected - got, key=_natural), sorted(got - expected, key=_natural)
        raise ValueError(
            f"{TARGET_FIELD}: {target_regex!r} adapted {len(got)} of the {len(expected)} "
            f"modules it selects (not adapted: {missing[:5]}, unexpected: {extra[:5]})"
        )
    lora_model.posttrain_lora = LoraSettings(int(rank), float(alpha), regex)
    return lora_model


class _LoraProvider(qwix.LoraProvider):
    """qwix's LoRA, with an adapted op's output in the dtype the op has without LoRA:
    float32 adapters on a bfloat16 base keep the activations bfloat16 (qwix would
    promote them to float32 at every adapted layer, and from there the whole model)."""

    def dot_general(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw
    ):
        out = super().dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, **kw
        )
        return out.astype(preferred_element_type or jnp.result_type(lhs, rhs))

    def einsum(self, einsum_str, *operands, **kwargs):
        out = super().einsum(einsum_str, *operands, **kwargs)
        return out.astype(kwargs.get("preferred_element_type") or jnp.result_type(*operands))


def _mesh_of(model: nnx.Module):
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        sharding = getattr(var.get_value(), "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return models.make_mesh(1, 1, jax.devices()[:1])


def _init_lora(var: nnx.Variable, path: tuple, index: int, seed: int, mesh) -> jax.Array:
    """qwix's initial LoRA values: lora_a he-uniform over its fan-in, lora_b zeros; drawn
    on the host from (seed, index) so every host draws the same and keeps its shards.
    Float32 whatever the base's dtype: the adapters are the master weights."""
    shape, dtype = tuple(var.shape), np.dtype(np.float32)
    if str(path[-1]).endswith("_lora_a"):
        bound = math.sqrt(6.0 / math.prod(shape[:-1]))
        rng = np.random.default_rng([seed, index])
        value = rng.uniform(-bound, bound, size=shape).astype(dtype)
    else:
        value = np.zeros(shape, dtype)
    spec = var.get_metadata().get("out_sharding") or ()
    spec = models.fit_spec(spec, shape, mesh)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    return jax.make_array_from_callback(shape, sharding, lambda idx: value[idx])


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def settings_of(model: nnx.Module) -> LoraSettings:
    settings = getattr(model, "posttrain_lora", None)
    if settings is None:
        if not lora_module_paths(model):
            raise ValueError("the model has no LoRA adapters (apply_lora first)")
        raise ValueError("the model's LoRA was not made by posttrain's apply_lora (alpha unknown)")
    return settings


def info_from_model(model: nnx.Module, hf_prefix: str = "model.") -> models.ModelInfo:
    """Enough of a ModelInfo to map a Tunix model's params to HF names."""
    family = family_of(model)
    cfg = model.config
    gemma = family.startswith("gemma")
    tie = (
        True
        if gemma
        else bool(getattr(cfg, "weight_tying", getattr(cfg, "use_tied_embedding", False)))
    )
    return models.ModelInfo(
        family=family,
        model_dir="",
        hf_config={},
        config=cfg,
        dtype=None,
        num_layers=cfg.num_layers,
        vocab_size=cfg.num_embed if gemma else cfg.vocab_size,
        hidden_size=cfg.embed_dim,
        intermediate_size=cfg.hidden_dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=tie,
        hf_prefix=hf_prefix,
    )


def _lora_params(model: nnx.Module) -> dict[tuple, nnx.Variable]:
    return dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))


def _adapted_maps(model: nnx.Module, info: models.ModelInfo):
    """(ParamMap, lora_a var, lora_b var) for every adapted weight; all LoRA params used."""
    params = _lora_params(model)
    used: set[tuple] = set()
    out = []
    for m in models.param_maps(info):
        module, weight = m.path[:-1], m.path[-1]
        a_key, b_key = (*module, f"{weight}_lora_a"), (*module, f"{weight}_lora_b")
        if a_key in params and b_key in params:
            out.append((m, params[a_key], params[b_key]))
            used |= {a_key, b_key}
    left = sorted(set(params) - used, key=str)
    if left:
        raise ValueError(
            f"{TARGET_FIELD}: LoRA params {[_module_path(p) for p in left[:5]]} have no "
            "Hugging Face counterpart and cannot be exported"
        )
    return out


def _peft_naming(info: models.ModelInfo) -> models.ModelInfo:
    """``info`` naming modules as PEFT finds them on the transformers model: a model with
    Gemma 3's vision tower is a ``Gemma3ForConditionalGeneration``, whose decoder is
    ``model.language_model`` whatever layout its checkpoint was saved in."""
    if getattr(info, "vision", None) is None:
        return info
    return dataclasses.replace(info, hf_prefix="model.language_model.")


def _hf_module(source: str) -> str:
    return source.removesuffix(".weight")


def peft_tensors(
    model: nnx.Module, info: models.ModelInfo | None = None
) -> dict[str, Callable[[], np.ndarray]]:
    """PEFT key -> producer of the ``lora_A`` ([r, in]) / ``lora_B`` ([out, r]) tensor."""
    info = _peft_naming(info or info_from_model(model))
    out: dict[str, Callable[[], np.ndarray]] = {}
    for m, a_var, b_var in _adapted_maps(model, info):
        n = len(m.sources)

        def a_hf(a_var=a_var):
            a = models.host_array(a_var.get_value())
            return np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)

        for i, src in enumerate(m.sources):

            def b_hf(b_var=b_var, i=i, n=n):
                b = models.host_array(b_var.get_value())
                if n > 1:
                    b = b[:, i]
                return np.ascontiguousarray(b.reshape(b.shape[0], -1).T)

            key = PEFT_PREFIX + _hf_module(src)
            out[f"{key}.lora_A.weight"] = a_hf
            out[f"{key}.lora_B.weight"] = b_hf
    return out


def merged_deltas(model: nnx.Module, info: models.ModelInfo) -> dict[str, Callable[[], np.ndarray]]:
    """HF weight name -> producer of ``(alpha / r) * lora_B @ lora_A`` (float32)."""
    if not _lora_params(model):
        return {}
    scale = settings_of(model).scale
    tensors = peft_tensors(model, info)
    out = {}
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]

        def delta(key=key, module=module):
            a = tensors[key]().astype(np.float32)
            b = tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"]().astype(np.float32)
            return scale * (b @ a)

        out[f"{module}.weight"] = delta
    return out


def _target_modules(adapted: set[str], info: models.ModelInfo) -> list[str] | str:
    """PEFT ``target_modules``: short names when they select exactly the adapted modules,
    else a full-match regex over the module names."""
    every = {
        _hf_module(s) for m in models.param_maps(info) for s in m.sources if s.endswith(".weight")
    }
    short = sorted({m.rsplit(".", 1)[-1] for m in adapted})
    if {m for m in every if m.rsplit(".", 1)[-1] in short} == adapted:
        return short
    return "^(" + "|".join(re.escape(m) for m in sorted(adapted, key=_natural)) + ")$"


def save_peft_adapter(
    model: nnx.Module,
    out_dir: str | os.PathLike,
    info: models.ModelInfo | None = None,
    base_model_name: str = "",
) -> Path:
    """Writes the model's LoRA as a PEFT adapter (``adapter_model.safetensors`` +
    ``adapter_config.json``) that ``peft.PeftModel.from_pretrained`` loads onto the HF
    base model. Only process 0 writes; every process must call it."""
    info = _peft_naming(info or info_from_model(model))
    settings = settings_of(model)
    tensors = peft_tensors(model, info)
    values = {k: produce() for k, produce in sorted(tensors.items())}  # gathers on all hosts
    out = Path(out_dir)
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    models.write_safetensors(
        out / ADAPTER_WEIGHTS,
        [(k, v.shape, v.dtype, lambda v=v: v) for k, v in values.items()],
    )
    adapted = {
        k[len(PEFT_PREFIX) : -len(".lora_A.weight")] for k in values if k.endswith(".lora_A.weight")
    }
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "target_modules": _target_modules(adapted, info),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": base_model_name or info.model_dir or None,
        "inference_mode": True,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def load_peft_adapter(
    model: nnx.Module, adapter_dir: str | os.PathLike, info: models.ModelInfo | None = None
) -> nnx.Module:
    """Loads a PEFT LoRA adapter into a model that ``apply_lora`` gave the same targets,
    rank and alpha (for ``spec.lora.restoreFrom``); updates ``model`` in place and returns
    it. Every adapter tensor must land on a LoRA param of the model and vice versa."""
    adapter_dir = Path(adapter_dir)
    cfg_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    if not cfg_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(
            f"{RESTORE_FIELD}: {adapter_dir} lacks {ADAPTER_CONFIG} or {ADAPTER_WEIGHTS}"
        )
    cfg = json.loads(cfg_path.read_text())
    settings = settings_of(model)
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise ValueError(
            f"{RESTORE_FIELD}: only plain LoRA adapters can be restored (got {cfg_path})"
        )
    if int(cfg["r"]) != settings.rank or float(cfg["lora_alpha"]) != settings.alpha:
        raise ValueError(
            f"{RESTORE_FIELD}: adapter has r={cfg['r']}, lora_alpha={cfg['lora_alpha']}; "
            f"spec.lora has rank={settings.rank}, alpha={settings.alpha}"
        )
    info = _peft_naming(info or info_from_model(model))
    with safe_open(str(weights_path), framework="numpy") as f:
        tensors = {re.sub(r"\.default(?=\.weight$)", "", k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    used: set[str] = set()
    updates = []
    for m, a_var, b_var in _adapted_maps(model, info):
        keys = [PEFT_PREFIX + _hf_module(s) for s in m.sources]
        absent = [f"{k}.lora_A.weight" for k in keys if f"{k}.lora_A.weight" not in tensors]
        absent += [f"{k}.lora_B.weight" for k in keys if f"{k}.lora_B.weight" not in tensors]
        if absent:
            raise ValueError(
                f"{RESTORE_FIELD}: adapter lacks {absent[:4]} that the model's LoRA has"
            )
        a_list = [tensors[f"{k}.lora_A.weight"] for k in keys]
        if any(not np.array_equal(a_list[0], a) for a in a_list[1:]):
            raise ValueError(
                f"{RESTORE_FIELD}: {', '.join(keys)} are one fused projection here and need "
                "equal lora_A weights"
            )
        a_shape, b_shape = a_var.shape, b_var.shape
        a = a_list[0].T.reshape(a_shape)
        bs = [tensors[f"{k}.lora_B.weight"].T for k in keys]
        b = (
            np.stack([x.reshape((b_shape[0], *b_shape[2:])) for x in bs], axis=1)
            if len(keys) > 1
            else bs[0].reshape(b_shape)
        )
        used |= {f"{k}.lora_{x}.weight" for k in keys for x in "AB"}
        updates += [(a_var, a), (b_var, b)]
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(
            f"{RESTORE_FIELD}: adapter has tensors for modules this model's LoRA does not "
            f"target ({extra[:4]}); set spec.lora.targetModules to match the adapter"
        )
    for var, value in updates:
        old = var.get_value()
        value = value.astype(old.dtype)
        var.set_value(
            jax.make_array_from_callback(old.shape, old.sharding, lambda idx, v=value: v[idx])
        )
    return model
