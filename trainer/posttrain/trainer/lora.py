"""LoRA for the Tunix models of ``posttrain.trainer.models``: qwix adapters.

``apply_lora`` adds qwix LoRA adapters (``nnx.LoRAParam``) to the modules a regex or a
list of module names selects, and refuses a selection that adapts nothing or not what it
names (errors name ``spec.lora.targetModules``). The Hugging Face ``peft`` format of
those adapters is ``posttrain.trainer.peft_format``'s.

qwix computes ``y = x W + (alpha / rank) * (x A) B``, the same scaling as ``peft``'s
``lora_alpha / r`` (no rsLoRA).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from tunix.models.gemma import model as gemma2_lib
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from posttrain.api import lora_modules
from posttrain.api.patterns import compile_user_regex
from posttrain.trainer import models
from posttrain.trainer.models import scan

TARGET_FIELD = "spec.lora.targetModules"

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


def module_path(path: Sequence[Any]) -> str:
    return "/".join(str(p) for p in path)


def adaptable_modules(model: nnx.Module) -> dict[str, str]:
    """Module path -> weight name, for every module LoRA can adapt (Linear / Einsum)."""
    out = {}
    for path, module in (
        nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
    ):
        if isinstance(module, nnx.Linear):
            out[module_path(path)] = "kernel"
        elif hasattr(module, "einsum_str") and isinstance(getattr(module, "w", None), nnx.Param):
            out[module_path(path)] = "w"
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
    flat = scan.flat_state(model, nnx.LoRAParam)
    return sorted({module_path(path[:-1]) for path in flat})


def apply_lora(
    model: nnx.Module,
    rank: int,
    alpha: float,
    target_regex: str | Sequence[str] | None = None,
    mesh=None,
    *,
    dropout: float = 0.0,
    seed: int = 0,
    abstract: bool = False,
) -> nnx.Module:
    """A copy of ``model`` with qwix LoRA adapters on the modules ``target_regex`` selects.

    ``target_regex``: see ``resolve_targets`` (None = ``default_lora_targets(family)``).
    ``abstract``: the adapters as ``jax.ShapeDtypeStruct``s with their shardings on
    ``mesh``, nothing allocated or run on its devices (``step_memory`` on compile-only
    TPU devices, where any operation that runs fails).
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
        examples = sorted(adaptable, key=natural_order)[:4]
        raise ValueError(
            f"{TARGET_FIELD}: {target_regex!r} selects no adaptable module of this {family} "
            f"model (regex {regex!r}, full match against paths such as {', '.join(examples)}); "
            f"the default is {default_lora_targets(family)!r}"
        )
    provider = _LoraProvider(module_path=regex, rank=rank, alpha=alpha, dropout=dropout)
    mesh = mesh if mesh is not None else _mesh_of(model)
    batch = int(mesh.shape.get("fsdp", 1))
    # tokens, positions, no cache, the attention mask: abstract, so nothing runs here
    args = (
        jax.ShapeDtypeStruct((batch, 1), jnp.int32),
        jax.ShapeDtypeStruct((batch, 1), jnp.int32),
        None,
        jax.ShapeDtypeStruct((batch, 1, 1), jnp.bool_),
    )

    # qwix creates the adapters during one forward pass. Run it abstractly (a trace, no
    # compilation, no device memory), then take the base params from `model` and make
    # the LoRA params here, each host building only its shards.
    def adapt(base, *inputs):
        return qwix.apply_lora_to_model(base, provider, *inputs, rngs=nnx.Rngs(seed))

    with jax.set_mesh(mesh):
        adapted = nnx.eval_shape(adapt, model, *args)
    graphdef, abs_state = nnx.split(adapted)
    base = dict(nnx.to_flat_state(nnx.state(model)))
    flat = {}
    lora_paths = sorted(
        (p for p, v in nnx.to_flat_state(abs_state) if isinstance(v, nnx.LoRAParam)), key=str
    )
    for path, var in nnx.to_flat_state(abs_state):
        if isinstance(var, nnx.LoRAParam):
            init = _abstract_lora if abstract else _init_lora
            flat[path] = var.copy(init(var, path, lora_paths.index(path), seed, mesh))
        elif path in base:
            flat[path] = base[path].copy()
        else:
            raise RuntimeError(f"posttrain bug: qwix added non-LoRA state {path}")
    lora_model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    got = set(lora_module_paths(lora_model))
    if got != expected:
        missing, extra = (
            sorted(expected - got, key=natural_order),
            sorted(got - expected, key=natural_order),
        )
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


def _lora_sharding(var: nnx.Variable, mesh) -> jax.sharding.NamedSharding:
    spec = var.get_metadata().get("out_sharding") or ()
    spec = models.fit_spec(spec, tuple(var.shape), mesh)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _abstract_lora(var: nnx.Variable, path: tuple, index: int, seed: int, mesh):
    """An adapter's shape, float32 dtype and sharding, as _init_lora would make it."""
    return jax.ShapeDtypeStruct(tuple(var.shape), jnp.float32, sharding=_lora_sharding(var, mesh))


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
    return jax.make_array_from_callback(shape, _lora_sharding(var, mesh), lambda idx: value[idx])


def natural_order(path: str) -> list:
    """Sort key of a module path with its layer numbers in numeric order."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def settings_of(model: nnx.Module) -> LoraSettings:
    settings = getattr(model, "posttrain_lora", None)
    if settings is None:
        if not lora_module_paths(model):
            raise ValueError("the model has no LoRA adapters (apply_lora first)")
        raise ValueError("the model's LoRA was not made by posttrain's apply_lora (alpha unknown)")
    return settings


def refuse_tower_targets(model: nnx.Module, target_modules: Any) -> None:
    """ValueError naming spec.lora.targetModules when it selects vision tower modules:
    LoRA adapts the language model only."""
    adaptable = list(adaptable_modules(model))
    regex = resolve_targets(family_of(model), target_modules, adaptable)
    tower = [p for p in adaptable if p.startswith("vision_encoder/") and re.fullmatch(regex, p)]
    if tower:
        raise ValueError(
            f"{TARGET_FIELD}: {target_modules!r} selects vision tower modules "
            f"({', '.join(tower[:3])}); LoRA adapts the language model only"
        )
