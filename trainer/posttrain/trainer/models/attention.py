"""Attention kernels for the Tunix models (``spec.training.attention``): dense, splash, cuDNN.

Tunix's attention layers compute ``softmax(q k^T) v`` in full: a ``[B, heads, L, L]``
score array per layer, masked with a ``[B, L, L]`` boolean mask the train step builds
(``sft.attention_mask``). At 8k tokens that is gigabytes per layer. ``install`` gives each
attention layer of a model a subclass of its Tunix class (as ``models.rope`` and
``models.remat`` do) whose ``block`` keeps Tunix's projections, norms and RoPE and hands
the scores, softmax and values to a fused kernel:

- ``splash``: Pallas splash attention on TPU (``jax.experimental.pallas.ops.tpu.
  splash_attention``), a ``CausalMask`` (a ``LocalMask`` on Gemma's sliding-window layers)
  with ``SegmentIds``, Gemma 2's logit soft-capping passed to the kernel; run under
  ``shard_map`` over the mesh's batch axes (``('dp', 'fsdp')``; heads over ``tp`` when it
  divides them), one kernel per example (``vmap``);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation='cudnn')`` on GPU, causal (and
  windowed), examples kept apart by a ``[B, 1, L, L]`` segment mask (a boolean, not the
  float scores);
- ``dense``: nothing installed; Tunix's own code.

What selects the path is what the step passes in the attention-mask slot of the model's
call: ``[B, L]`` int32 segment ids (0 = padding, 1..n = the packed example; from
``attention_input``) run the kernel, a ``[B, L, L']`` mask or a KV cache (prefill and
decode in generation, GRPO's sampler, Tunix's RL log-probabilities) runs Tunix's dense
code, except a Llama 3 or Qwen3 decode step (one new token a sequence): Tunix's attends
over every slot of the cache, masked, so its cost is the cache's full size from the first
new token on; ``decode_attend`` reads only the slots filled so far, in one of a few static
lengths (``decode_lengths``), for the same result. A padding token (segment 0) attends to
the padding before it rather than to itself alone as in the dense mask; no real token sees
padding either way, and the loss never counts a padding position, so losses are the same.

Where a kernel cannot take a shape (a length that is no multiple of 128 for splash, a
float32 run or soft-capping for cuDNN) the layer computes the same masked attention with
jnp (``reference``): correct, as costly as dense. Two more kernels run on CPU for tests:
``splash_interpret`` (the splash kernel in Pallas's interpret mode) and ``xla`` (the cuDNN
path through ``jax.nn.dot_product_attention``'s XLA implementation).

Gemma's sliding windows here span the last ``window`` tokens of a row (by index, within
the example, as Gemma 3's Tunix prefill does). Tunix's Gemma 2 dense path measures the
window from each token's position to the key's row index instead; on packed rows whose
later examples start ``window`` or more tokens in, that dense path masks the wrong keys.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec as P
from tunix.models.gemma import model as gemma2_lib
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from posttrain.trainer.mesh import ACTIVATION_BATCH, constrain
from posttrain.trainer.models import rope

log = logging.getLogger(__name__)

SETTINGS = ("auto", "dense", "flash")  # spec.training.attention
KERNELS = ("dense", "splash", "cudnn")  # what a setting resolves to
TEST_KERNELS = ("splash_interpret", "xla", "reference")  # runnable on CPU
FIELD = "spec.training.attention"
_FLASH = {"tpu": "splash", "gpu": "cudnn"}
NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


def resolve(
    setting: str,
    *,
    family: str,
    platform: str | None = None,
    vision: bool = False,
) -> str:
    """The kernel (dense, splash or cudnn) of ``spec.training.attention`` on ``platform``
    (default: JAX's backend). ``auto`` is flash where there is one and it applies, else
    dense; ``flash`` where none applies is an error naming the field."""
    setting = str(setting)
    if setting not in SETTINGS:
        raise ValueError(f"{FIELD}: {setting!r} is not one of {', '.join(SETTINGS)}")
    if setting == "dense":
        return "dense"
    platform = platform or jax.default_backend()
    kernel = _FLASH.get(platform)
    why = None
    if kernel is None:
        why = f"there is no flash kernel on {platform} (TPU: splash, GPU: cuDNN)"
    elif vision:
        why = "Gemma 3 vision rows attend both ways within an image, which needs the dense mask"
    elif kernel == "cudnn" and family == "gemma2":
        why = "cuDNN flash attention has no logit soft-capping (Gemma 2)"
    if why is None:
        return kernel
    if setting == "flash":
        raise ValueError(f"{FIELD}: flash, but {why}; use auto or dense")
    log.info("attention: dense (%s)", why)
    return "dense"


def kernel_for(attention: str, info: Any) -> str:
    """The kernel of ``attention`` for a model of ``info`` (a ``ModelInfo``): a setting
    (auto, dense, flash) resolved on this platform, or a kernel named as it is (tests)."""
    if attention in KERNELS + TEST_KERNELS:
        return attention
    return resolve(attention, family=info.family, vision=info.vision is not None)


def install(model: nnx.Module, kernel: str) -> nnx.Module:
    """Gives every attention layer of ``model`` (in place) the ``kernel`` for calls with
    segment ids; ``dense`` puts Tunix's own layers back. Returns ``model``."""
    if kernel not in KERNELS + TEST_KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is not one of {KERNELS + TEST_KERNELS}")
    stacked = getattr(model.layers, "stacked", None)  # models.scan's one stacked layer
    for layer in [stacked] if stacked is not None else model.layers:
        attn = layer.attn
        base = type(attn).__bases__[0] if _is_flash(type(attn)) else type(attn)
        if kernel == "dense":
            attn.__class__ = base
        else:
            attn.__class__ = _flash_class(base)
            attn.posttrain_attention = kernel
    model.posttrain_attention = kernel
    return model


def kernel_of(model: nnx.Module) -> str:
    """The kernel ``install`` gave ``model`` (dense when none)."""
    return getattr(model, "posttrain_attention", "dense")


def attention_input(
    model: nnx.Module, segment_ids: jax.Array, dense_mask: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """What a train step passes in the model's attention-mask slot: ``segment_ids`` [B, L]
    (0 = padding) where a kernel is installed, else ``dense_mask(segment_ids)`` [B, L, L]."""
    if kernel_of(model) == "dense":
        return dense_mask(segment_ids)
    return segment_ids.astype(jnp.int32)


def _is_flash(cls: type) -> bool:
    return getattr(cls, "posttrain_flash", False)


# --- the kernels: [B, T, N, H] scaled queries, [B, S, K, H] keys and values -------------


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    kernel: str,
    window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention within each segment (and the last ``window`` tokens) -> [B, T, N, H]
    in ``v``'s dtype. ``q`` is already scaled; ``soft_cap``: Gemma 2's tanh capping."""
    length = q.shape[1]
    if kernel in ("splash", "splash_interpret"):
        block = _block_size(length)
        if block is not None:
            return _sharded(
                functools.partial(
                    _splash_local,
                    window=window,
                    soft_cap=soft_cap,
                    block=block,
                    interpret=kernel == "splash_interpret",
                ),
                q,
                k,
                v,
                segment_ids,
            )
        _warn_once(f"splash attention needs a length that is a multiple of 128, not {length}")
    elif kernel in ("cudnn", "xla"):
        half = q.dtype in (jnp.bfloat16, jnp.float16)
        if soft_cap is None and (kernel == "xla" or half):
            return _dot_product(q, k, v, segment_ids, window, kernel)
        _warn_once(
            "cuDNN flash attention takes neither soft-capping nor float32"
            f" (here {q.dtype}, soft cap {soft_cap})"
        )
    return reference(q, k, v, segment_ids, window=window, soft_cap=soft_cap)


def reference(q, k, v, segment_ids, *, window=None, soft_cap=None) -> jax.Array:
    """``attend`` in plain jnp (the scores materialised), float32 softmax."""
    return _masked(q, k, v, _mask(segment_ids, window), soft_cap)


def _masked(q, k, v, mask, soft_cap=None) -> jax.Array:
    """Softmax attention of [B, T, N, H] queries over [B, S, K, H] keys and values where
    ``mask`` [B, T, S] allows; the scores in float32."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, n // kv, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k).astype(jnp.float32)
    if soft_cap is not None:
        logits = jnp.tanh(logits / soft_cap) * soft_cap
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], logits, NEG_INF), axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v)
    return out.reshape(b, t, n, h)


def _mask(segment_ids: jax.Array, window: int | None) -> jax.Array:
    """[B, T, T]: causal, same segment, within ``window``."""
    t = segment_ids.shape[-1]
    i = jnp.arange(t)
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    return allowed[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


# A decode step's keys: the cache's first slots, in at most DECODE_BUCKETS static lengths
# (multiples of 128), so a step reads the filled part of the cache rather than all of it.
DECODE_BUCKETS = 8


def decode_lengths(size: int) -> list[int]:
    """The static key lengths a decode step over a ``size``-slot cache chooses from."""
    granule = 128 * math.ceil(size / (128 * DECODE_BUCKETS))
    return [*range(granule, size, granule), size]


def decode_attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, filled: Any):
    """One decode step's attention -> [B, 1, N, H]: the scaled query ``q`` [B, 1, N, H]
    over the caches ``k``, ``v`` [B, S, K, H] where ``mask`` [B, 1, S] allows, reading only
    the shortest of ``decode_lengths(S)`` that covers the ``filled`` first slots (the whole
    cache when it wrapped). The keys left out are masked anyway: the result is Tunix's
    dense step's, without reading the empty slots of the cache."""
    lengths = decode_lengths(k.shape[1])

    def over(n: int) -> Callable:
        return lambda q, k, v, mask: _masked(q, k[:, :n], v[:, :n], mask[..., :n])

    if len(lengths) == 1:
        return over(lengths[0])(q, k, v, mask)
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(lengths), filled), len(lengths) - 1)
    return jax.lax.switch(index, [over(n) for n in lengths], q, k, v, mask)


def _block_size(length: int) -> int | None:
    for block in (512, 256, 128):
        if length % block == 0:
            return block
    return None


def _splash_local(q, k, v, segment_ids, *, window, soft_cap, block, interpret):
    """Splash attention on one device's share: [b, T, n, H] -> [b, T, n, H]."""
    t, heads = q.shape[1], q.shape[2]
    if window is None:
        one = mask_lib.CausalMask((t, t))
    else:
        one = mask_lib.LocalMask((t, t), (window - 1, 0), offset=0)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = splash.make_splash_mha(
        mask_lib.MultiHeadMask([one] * heads),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=soft_cap,
        interpret=interpret,
    )

    def one_example(q, k, v, segments):
        ids = splash.SegmentIds(q=segments, kv=segments)
        return kernel(q, k, v, segment_ids=ids)

    heads_first = (0, 2, 1, 3)  # [b, T, n, H] <-> [b, n, T, H]
    out = jax.vmap(one_example)(
        q.transpose(heads_first),
        k.transpose(heads_first),
        v.transpose(heads_first),
        segment_ids.astype(jnp.int32),
    )
    return out.transpose(heads_first).astype(v.dtype)


def _sharded(local: Callable, q, k, v, segment_ids) -> jax.Array:
    """``local`` under shard_map over the mesh ``jax.set_mesh`` set: the batch over
    ``('dp', 'fsdp')`` (the axes that divide it), heads over ``tp`` where it divides both
    head counts; ``local`` itself outside a mesh or on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(q, k, v, segment_ids)
    batch = tuple(a for a in ACTIVATION_BATCH if a in mesh.shape and mesh.shape[a] > 1)
    if batch and q.shape[0] % math.prod(mesh.shape[a] for a in batch):
        batch = ()
    tp = mesh.shape.get("tp", 1)
    heads = "tp" if tp > 1 and q.shape[2] % tp == 0 and k.shape[2] % tp == 0 else None
    rows = batch or None
    spec = P(rows, None, heads, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, spec, spec, P(rows, None)),
        out_specs=spec,
        check_vma=False,
    )(q, k, v, segment_ids)


def _dot_product(q, k, v, segment_ids, window, implementation) -> jax.Array:
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=same[:, None],
        scale=1.0,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    ).astype(v.dtype)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("attention: %s; computing it in full for this shape", message)


# --- each family's projections: Tunix's code up to the scores, and after them ----------


def _rotate(attn, x, positions, lib):
    """llama3 / qwen3 RoPE: config.json's frequencies (models.rope) where the layer has
    them, Tunix's own otherwise."""
    freq = getattr(attn, "rope_inv_freq", None)
    if freq is not None:
        return rope.rotate(x, positions, attn.head_dim, inv_freq=freq)
    return lib.apply_rope(x, positions, head_dim=attn.head_dim)


def _llama3_qkv(attn, x, positions):
    shd = attn.shd_config.act_btnh
    q = constrain(attn.q_proj(x), shd)
    k = constrain(attn.k_proj(x), shd)
    v = constrain(attn.v_proj(x), shd)
    q = _rotate(attn, q, positions, llama3_lib)
    k = _rotate(attn, k, positions, llama3_lib)
    return q * attn.scale, k, v


def _qwen3_qkv(attn, x, positions):
    shd = attn.shd_config.act_btnh
    q = constrain(attn.q_norm(attn.q_proj(x)), shd)
    k = constrain(attn.k_norm(attn.k_proj(x)), shd)
    v = constrain(attn.v_proj(x), shd)
    q = _rotate(attn, q, positions, qwen3_lib)
    k = _rotate(attn, k, positions, qwen3_lib)
    return q * attn.scale, k, v


def _qwen2_qkv(attn, x, sin, cos):
    dtype = attn.config.dtype

    def biased(proj, bias):
        y = proj(x)
        b, t, n, h = y.shape
        return (y.reshape(b, t, n * h) + bias.astype(dtype)).reshape(b, t, n, h)

    shd = attn.shd_config.act_btnh
    q = constrain(biased(attn.q_proj, attn.q_bias), shd)
    k = constrain(biased(attn.k_proj, attn.k_bias), shd)
    v = constrain(biased(attn.v_proj, attn.v_bias), shd)
    q = qwen2_lib.apply_rotary_embedding(q, sin, cos)
    k = qwen2_lib.apply_rotary_embedding(k, sin, cos)
    return q * attn.scale, k, v


def _gemma_projections(attn, x):
    if attn.use_qkv_einsum:
        return attn.qkv_einsum(x)
    k, v = attn.kv_einsum(x)
    return attn.q_einsum(x), k, v


def _gemma2_qkv(attn, x, positions):
    shd = attn.shd_config.act_btnh
    q, k, v = (constrain(p, shd) for p in _gemma_projections(attn, x))
    q = gemma2_lib.apply_rope(q, positions, head_dim=attn.head_dim)
    k = gemma2_lib.apply_rope(k, positions, head_dim=attn.head_dim)
    return q * attn.head_dim**-0.5, k, v


def _gemma3_qkv(attn, x, positions):
    shd = attn.shd_config.act_btnh
    q, k, v = (constrain(p, shd) for p in _gemma_projections(attn, x))
    q, k = attn._query_norm(q), attn._key_norm(k)
    rotary = dict(
        head_dim=attn.head_dim,
        base_frequency=attn.rope_base_frequency,
        scale_factor=attn.rope_scale_factor,
    )
    q = gemma3_lib.apply_rope(q, positions, **rotary)
    k = gemma3_lib.apply_rope(k, positions, **rotary)
    return q * attn.query_pre_attn_scalar, k, v


def _window(attn) -> int | None:
    kind = getattr(attn, "attn_type", None)
    if kind is not None and kind.name == "LOCAL_SLIDING":
        return int(attn.sliding_window_size)
    return None


_FAMILIES: dict[type, tuple[Callable, str]] = {
    llama3_lib.Attention: (_llama3_qkv, "o_proj"),
    qwen3_lib.Attention: (_qwen3_qkv, "o_proj"),
    qwen2_lib.Attention: (_qwen2_qkv, "o_proj"),
    gemma2_lib.Attention: (_gemma2_qkv, "attn_vec_einsum"),
    gemma3_lib.Attention: (_gemma3_qkv, "attn_vec_einsum"),
}


def _family_of(cls: type) -> tuple[Callable, str]:
    for tunix_cls, entry in _FAMILIES.items():
        if issubclass(cls, tunix_cls):
            return entry
    raise TypeError(f"posttrain: no flash attention for {cls.__module__}.{cls.__name__}")


def _segment_ids(attn_mask: Any, cache: Any) -> jax.Array | None:
    """The segment ids a train step passed in the mask slot; None for a dense mask or a
    KV cache (Tunix's own path)."""
    if cache is None and attn_mask is not None and getattr(attn_mask, "ndim", 0) == 2:
        return attn_mask
    return None


@functools.cache
def _flash_class(base: type) -> type:
    """``base`` (a Tunix attention class, or posttrain's RoPE subclass of one) whose
    ``block`` runs ``attend`` when given segment ids."""
    qkv, out_name = _family_of(base)
    tunix_block = base.block

    def finish(self, q, k, v, segments, x):
        out = attend(
            q,
            k,
            v,
            segments,
            kernel=self.posttrain_attention,
            window=_window(self),
            soft_cap=getattr(self, "attn_logits_soft_cap", None),
        )
        out = getattr(self, out_name)(out.astype(x.dtype) if out.dtype != x.dtype else out)
        return None, constrain(out, self.shd_config.act_btd)

    if issubclass(base, qwen2_lib.Attention):

        def block(self, x, cache, attn_mask, sin, cos, segment_ids=None):
            segments = _segment_ids(attn_mask, cache)
            if segments is None:
                return tunix_block(self, x, cache, attn_mask, sin, cos, segment_ids)
            return finish(self, *qkv(self, x, sin, cos), segments, x)

    else:

        def block(self, x, segment_pos, cache, attn_mask, *args, **kwargs):
            segments = _segment_ids(attn_mask, cache)
            if segments is None and fast_decode and cache is not None and x.shape[1] == 1:
                return decode_step(self, x, segment_pos, cache, attn_mask)
            if segments is None:
                return tunix_block(self, x, segment_pos, cache, attn_mask, *args, **kwargs)
            return finish(self, *qkv(self, x, segment_pos), segments, x)

    def decode_step(self, x, positions, cache, attn_mask):
        """Tunix's decode step (the new key and value written at the cache's end index,
        the query attending to the cache) with ``decode_attend``."""
        q, k, v = qkv(self, x, positions)
        end = cache["end_index"][0]
        at = (0, end % cache["v"].shape[1], 0, 0)
        keys = jax.lax.dynamic_update_slice(cache["k"], k, at)
        values = jax.lax.dynamic_update_slice(cache["v"], v, at)
        out = decode_attend(q.astype(keys.dtype), keys, values, attn_mask, end + 1)
        out = constrain(getattr(self, out_name)(out.astype(x.dtype)), self.shd_config.act_btd)
        return {"v": values, "k": keys, "end_index": cache["end_index"] + 1}, out

    # Gemma's decode steps (sliding windows, soft-capping) and Qwen2's stay Tunix's own.
    fast_decode = issubclass(base, (llama3_lib.Attention, qwen3_lib.Attention))

    attrs = {"block": block, "posttrain_flash": True, "__module__": __name__}
    return type(base.__name__, (base,), attrs)
