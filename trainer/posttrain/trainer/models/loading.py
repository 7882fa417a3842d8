"""Loading a Hugging Face safetensors checkpoint into the family's Tunix nnx model.

The weights are loaded here rather than by Tunix's ``create_model_from_safe_tensors``,
because that one reads every tensor whole on every host and ``device_put``s it. Here each
parameter is built with ``jax.make_array_from_callback`` on the mesh with the parameter's
own sharding, and the callback reads only the slice that the local device needs
(``safe_open(...).get_slice``), so every host reads only its own shards.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.gemma3 import model as gemma3_lib

from posttrain.trainer.mesh import make_mesh
from posttrain.trainer.models import attention as attention_lib
from posttrain.trainer.models import remat as remat_lib
from posttrain.trainer.models.config import ModelInfo, model_info
from posttrain.trainer.models.families import model_class
from posttrain.trainer.models.params import param_maps
from posttrain.trainer.models.safetensors_io import SafetensorsDir, detect_prefix
from posttrain.trainer.models.scan import sharding_metadata_key

log = logging.getLogger(__name__)


def _configure(model: nnx.Module, info: ModelInfo, extras: dict) -> None:
    """Static settings the Tunix constructor cannot take (set on the abstract model)."""
    model.posttrain_compute_dtype = info.compute_dtype
    if info.remat in remat_lib.POLICIES:
        remat_lib.apply_policy(model, info.remat)
    if info.family == "gemma3":  # Tunix hard-codes a 5 local : 1 global pattern
        cfg = info.config
        for layer, kind in zip(model.layers, info.layer_types, strict=True):
            local = kind == "sliding_attention"
            attn = layer.attn
            attn.attn_type = (
                gemma3_lib.AttentionType.LOCAL_SLIDING if local else gemma3_lib.AttentionType.GLOBAL
            )
            attn.rope_base_frequency = (
                cfg.local_base_frequency if local else cfg.global_base_frequency
            )
            attn.rope_scale_factor = cfg.local_scale_factor if local else cfg.global_scale_factor


def fit_spec(spec: Sequence[Any], shape: tuple[int, ...], mesh) -> tuple:
    """Drops the mesh axes of dimensions they do not divide (those dims are replicated)."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for axes, dim in zip(spec, shape, strict=True):
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        names = tuple(a for a in names if a in mesh.shape)
        size = math.prod(mesh.shape[a] for a in names)
        if not names or dim % size:
            out.append(None)
        else:
            out.append(names[0] if len(names) == 1 else names)
    return tuple(out)


def _np_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def abstract_model(
    info: ModelInfo, extras: dict, mesh=None, attention: str = "dense"
) -> nnx.Module:
    """The Tunix model with abstract (shape-only) params; ``attention`` is
    spec.training.attention or a kernel of ``models.attention`` (installed)."""
    cls = model_class(info.family)
    # Llama 3 and Qwen3: their attention layers take config.json's RoPE (models.rope).
    rope = {"rope_inv_freq": extras["rope_inv_freq"]} if "rope_inv_freq" in extras else {}

    def build() -> nnx.Module:
        return cls(info.config, rngs=nnx.Rngs(params=0), **rope)

    if mesh is not None:
        with jax.set_mesh(mesh):
            model = nnx.eval_shape(build)
    else:
        model = nnx.eval_shape(build)
    _configure(model, info, extras)
    kernel = attention_lib.kernel_for(attention, info)
    if kernel != "dense":
        attention_lib.install(model, kernel)
    return model


def load_model(
    model_dir: str | os.PathLike,
    *,
    family: str = "auto",
    mesh=None,
    dtype: Any = jnp.float32,
    compute_dtype: Any = None,
    weights: str | None = None,
    num_layers: int | None = None,
    layers_field: str = "spec.model.layers",
    vision: bool = False,
    remat: str = "auto",
    attention: str = "dense",
) -> tuple[nnx.Module, ModelInfo]:
    """Loads a HF safetensors checkpoint into the family's Tunix nnx model, params in
    ``dtype``, forward passes (``compute_view``) in ``compute_dtype`` (default ``dtype``).

    Each parameter is created with ``jax.make_array_from_callback`` on ``mesh`` (default:
    one device) with the sharding Tunix annotates (axes that do not divide a dimension
    are dropped for it); every callback reads only its block from the safetensors files.
    ``weights`` is where those files are when not in ``model_dir`` (a gs:// prefix: the
    blocks are then fetched with ranged reads, and ``model_dir`` holds the small files).
    ``vision`` loads Gemma 3's vision tower and projector too (``posttrain.trainer.models.vision``).
    ``remat`` is spec.training.remat (``model_info``); ``attention`` spec.training.attention
    (``models.attention``: the kernel the attention layers run with segment ids).
    """
    info, extras = model_info(
        model_dir,
        family=family,
        dtype=dtype,
        compute_dtype=compute_dtype,
        num_layers=num_layers,
        layers_field=layers_field,
        vision=vision,
        remat=remat,
    )
    mesh = mesh if mesh is not None else make_mesh(1, 1, jax.devices()[:1])
    reader = SafetensorsDir(str(weights or model_dir))
    try:
        info.hf_prefix = detect_prefix(reader.keys())
        if info.vision is not None:
            from posttrain.trainer.models import vision as vision_lib

            info.vision = vision_lib.with_prefixes(info.vision, reader.keys())
        model = abstract_model(info, extras, mesh, attention)
        graphdef, abs_state = nnx.split(model)
        flat = dict(nnx.to_flat_state(abs_state))
        maps = {m.path: m for m in param_maps(info)}
        missing_maps = sorted(set(flat) - set(maps), key=str)
        if missing_maps:
            raise RuntimeError(f"posttrain bug: no HF mapping for Tunix params {missing_maps}")
        needed = {name for m in maps.values() for name in m.sources}
        absent = sorted(needed - reader.keys())
        if absent:
            raise ValueError(
                f"spec.model.source: {model_dir} lacks tensors {absent[:5]}"
                f"{' ...' if len(absent) > 5 else ''} that a {info.family} model with this "
                "config.json needs"
            )
        unused = sorted(
            k
            for k in reader.keys() - needed
            if not (k.endswith("rotary_emb.inv_freq") or k.endswith("lm_head.weight"))
        )
        if unused and num_layers is None:
            log.warning("ignoring %d checkpoint tensors, e.g. %s", len(unused), unused[:5])
        np_dtype = _np_dtype(dtype)
        new_flat = {}
        for path, var in flat.items():
            m = maps[path]
            for name in m.sources:
                if reader.shape(name) != m.hf_shape:
                    raise ValueError(
                        f"spec.model.source: tensor {name} has shape {reader.shape(name)}, "
                        f"config.json implies {m.hf_shape}"
                    )
            if tuple(var.shape) != m.shape:
                raise RuntimeError(f"posttrain bug: {path} is {var.shape}, mapping gives {m.shape}")
            key = sharding_metadata_key(var)
            spec = var.get_metadata().get(key) if key else None
            fitted = fit_spec(spec or (), m.shape, mesh)
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*fitted))

            def callback(index, m=m):
                return m.read(reader.get, index).astype(np_dtype)

            array = jax.make_array_from_callback(m.shape, sharding, callback)
            metadata = {key: fitted} if key and tuple(spec) != fitted else {}
            new_flat[path] = var.copy(array, **metadata)
        state = nnx.from_flat_state(new_flat)
        loaded = nnx.merge(graphdef, state)
        fetched = reader.fetched()
        if fetched:
            log.info("fetched %d of the %d bytes of %s's weights", *fetched, weights)
    finally:
        reader.close()
    return loaded, info
