"""Gemma 3's vision tower: Hugging Face ``Gemma3ForConditionalGeneration`` -> Tunix.

Tunix's Gemma 3 carries a SigLIP encoder (``tunix.models.gemma3.vision``) and the
multimodal projector (``Embedder.mm_soft_embedding_norm`` / ``mm_input_projection``) when
its ``ModelConfig.vision_config`` is set; this module builds that config from the
checkpoint's ``config.json`` (``vision_config``, ``mm_tokens_per_image``, the image token
ids) and maps the vision tensors to Tunix's params, so that the loader in
``posttrain.trainer.models`` builds them with the same per-host
``jax.make_array_from_callback`` reads as the decoder's.

Checkpoint layouts: the original one (``vision_tower.vision_model.*``,
``multi_modal_projector.*``, ``language_model.model.*``), the one ``transformers`` 5 writes
(``vision_tower.*`` without ``vision_model.``), and ``model.``-prefixed variants of both.

The forward pass (``forward``) runs the decoder with Gemma 3's attention mask for images:
causal, and the soft tokens of one image attend to each other both ways (as
``transformers`` does from ``token_type_ids``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.gemma3 import merge_embeddings as merge_lib
from tunix.models.gemma3 import vision as siglip_lib

from posttrain.trainer.mesh import ACTIVATION_BATCH


def _install_merge_cast() -> None:
    """Tunix's ``merge_embeddings`` scatters the float32 soft tokens of the images into
    the text embeddings of a bfloat16 model, a cast JAX deprecates (a FutureWarning now,
    an error in later releases): the soft tokens are cast to the text embeddings' dtype
    first, as transformers does. Installed on import, once."""
    original = merge_lib.merge_embeddings
    if getattr(original, "posttrain_cast", False):
        return

    def merge_embeddings(*, text_embeddings, vision_embeddings, mask):
        vision_embeddings = jnp.asarray(vision_embeddings).astype(text_embeddings.dtype)
        return original(
            text_embeddings=text_embeddings, vision_embeddings=vision_embeddings, mask=mask
        )

    merge_embeddings.posttrain_cast = True
    merge_lib.merge_embeddings = merge_embeddings


_install_merge_cast()

# Where the vision tower's and the projector's tensors can live in a checkpoint.
_TOWER_PREFIXES = (
    "vision_tower.vision_model.",
    "model.vision_tower.vision_model.",
    "vision_tower.",
    "model.vision_tower.",
)
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


@dataclasses.dataclass(frozen=True)
class VisionInfo:
    """What the loader, the image processor and the data pipeline need of a Gemma 3
    vision checkpoint's config.json."""

    image_size: int
    patch_size: int
    num_channels: int
    width: int  # the vision tower's hidden size
    depth: int
    mlp_dim: int
    num_heads: int
    tokens_per_image: int  # soft tokens after pooling
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    layer_norm_eps: float = 1e-6
    tower_prefix: str = "vision_tower.vision_model."
    projector_prefix: str = "multi_modal_projector."

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def _first(cfg: dict, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _side(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"spec.model: non-square vision size {value} is not supported")
        return int(value[0])
    return int(value)


def vision_info(hf: dict) -> VisionInfo | None:
    """VisionInfo of a ``Gemma3ForConditionalGeneration`` config.json; None when the
    checkpoint has no vision tower (text-only Gemma 3 and the other families)."""
    vc = hf.get("vision_config")
    if hf.get("model_type") != "gemma3" or not isinstance(vc, dict):
        return None
    act = vc.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"spec.model: vision tower hidden_act={act!r} is not supported")
    if vc.get("vision_use_head"):
        raise ValueError("spec.model: a vision tower with a pooling head is not supported")
    eps = float(vc.get("layer_norm_eps", 1e-6))
    if abs(eps - 1e-6) > 1e-12:
        raise ValueError(f"spec.model: vision layer_norm_eps={eps} (Tunix's SigLIP uses 1e-6)")
    image_size, patch = _side(vc.get("image_size", 224)), _side(vc.get("patch_size", 16))
    tokens = int(hf.get("mm_tokens_per_image", 256))
    per_side, pooled = image_size // patch, int(round(tokens**0.5))
    if pooled * pooled != tokens or per_side % pooled:
        raise ValueError(
            f"spec.model: mm_tokens_per_image={tokens} does not pool {per_side}x{per_side} patches"
        )
    width = int(vc.get("hidden_size", 768))
    return VisionInfo(
        image_size=image_size,
        patch_size=patch,
        num_channels=int(vc.get("num_channels", 3)),
        width=width,
        depth=int(vc.get("num_hidden_layers", 12)),
        mlp_dim=int(vc.get("intermediate_size", 4 * width)),
        num_heads=int(vc.get("num_attention_heads", 12)),
        tokens_per_image=tokens,
        image_token_id=int(_first(hf, "image_token_id", "image_token_index", default=262144)),
        boi_token_id=int(_first(hf, "boi_token_id", "boi_token_index", default=255999)),
        eoi_token_id=int(_first(hf, "eoi_token_id", "eoi_token_index", default=256000)),
        layer_norm_eps=eps,
    )


def require_vision_info(hf: dict, family: str, model_dir: Any) -> VisionInfo:
    """vision_info of a checkpoint that must have a vision tower."""
    vi = vision_info(hf) if family == "gemma3" else None
    if vi is None:
        raise ValueError(
            f"spec.data.columns.images: {model_dir} has no vision tower (images need a "
            f"Gemma3ForConditionalGeneration checkpoint; this one is {family}"
            f"{', text only' if family == 'gemma3' else ''})"
        )
    return vi


def with_prefixes(vi: VisionInfo, keys: set[str]) -> VisionInfo:
    """``vi`` with the tensor prefixes this checkpoint uses."""
    tower = next(
        (p for p in _TOWER_PREFIXES if f"{p}embeddings.patch_embedding.weight" in keys), None
    )
    projector = next(
        (p for p in _PROJECTOR_PREFIXES if f"{p}mm_input_projection_weight" in keys), None
    )
    if tower is None or projector is None:
        raise ValueError(
            "spec.model.source: the checkpoint's config.json has a vision_config but its "
            "safetensors have no vision tower (embeddings.patch_embedding.weight) or no "
            "multi_modal_projector.mm_input_projection_weight"
        )
    return dataclasses.replace(vi, tower_prefix=tower, projector_prefix=projector)


def siglip_config(vi: VisionInfo) -> siglip_lib.SigLIPConfig:
    return siglip_lib.SigLIPConfig(
        num_mm_tokens_per_image_prepool=vi.patches_per_side**2,
        num_mm_tokens_per_image=vi.tokens_per_image,
        image_height=vi.image_size,
        image_width=vi.image_size,
        image_channels=vi.num_channels,
        soft_token_placeholder=vi.image_token_id,
        patch_size=(vi.patch_size, vi.patch_size),
        width=vi.width,
        depth=vi.depth,
        mlp_dim=vi.mlp_dim,
        num_heads=vi.num_heads,
        dropout=0.0,
    )


def with_vision(config: Any, vi: VisionInfo) -> Any:
    """A Tunix Gemma 3 ``ModelConfig`` that builds the vision tower of ``vi``; the
    tower's activations have their batch over ``('dp', 'fsdp')`` like the decoder's."""
    shd = config.shd_config
    siglip = shd.siglip
    if siglip is not None:
        changes = {
            f.name: (ACTIVATION_BATCH, *getattr(siglip, f.name)[1:])
            for f in dataclasses.fields(siglip)
            if f.name.startswith("act_") and getattr(siglip, f.name)[:1] == ("fsdp",)
        }
        shd = dataclasses.replace(shd, siglip=dataclasses.replace(siglip, **changes))
    return dataclasses.replace(config, vision_config=siglip_config(vi), shd_config=shd)


def param_maps(vi: VisionInfo, text_hidden: int) -> list:
    """The ParamMaps of the vision tower and the projector (HF tensor -> Tunix param)."""
    from posttrain.trainer.models.param_map import ParamMap

    t, pj = vi.tower_prefix, vi.projector_prefix
    w, f, c, p = vi.width, vi.mlp_dim, vi.num_channels, vi.patch_size
    enc = ("vision_encoder", "siglip_encoder")

    def vec(path: tuple, name: str, size: int) -> ParamMap:
        return ParamMap(path, (name,), ((size,),), (0,))

    def linear(path: tuple, name: str, out: int, inp: int) -> list[ParamMap]:
        return [
            ParamMap(path + ("kernel",), (name + ".weight",), ((out,), (inp,)), (1, 0)),
            vec(path + ("bias",), name + ".bias", out),
        ]

    def layer_norm(path: tuple, name: str) -> list[ParamMap]:
        return [
            vec(path + ("scale",), name + ".weight", w),
            vec(path + ("bias",), name + ".bias", w),
        ]

    maps = [
        # conv [out, in, kh, kw] -> [kh, kw, in, out]
        ParamMap(
            enc + ("embedding", "kernel"),
            (f"{t}embeddings.patch_embedding.weight",),
            ((w,), (c,), (p,), (p,)),
            (2, 3, 1, 0),
        ),
        vec(enc + ("embedding", "bias"), f"{t}embeddings.patch_embedding.bias", w),
        # [patches, width] -> [1, patches, width]
        ParamMap(
            enc + ("pos_embedding",),
            (f"{t}embeddings.position_embedding.weight",),
            ((1, vi.patches_per_side**2), (w,)),
            (0, 1, 2),
        ),
    ]
    for i in range(vi.depth):
        hf, blk = f"{t}encoder.layers.{i}.", enc + ("transformer", "blocks", i)
        maps += layer_norm(blk + ("ln1",), hf + "layer_norm1")
        maps += layer_norm(blk + ("ln2",), hf + "layer_norm2")
        for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "out")):
            maps += linear(blk + ("attn", f"{ours}_proj"), hf + f"self_attn.{theirs}_proj", w, w)
        maps += linear(blk + ("mlp", "fc1"), hf + "mlp.fc1", f, w)
        maps += linear(blk + ("mlp", "fc2"), hf + "mlp.fc2", w, f)
    maps += layer_norm(enc + ("transformer", "encoder_norm"), f"{t}post_layernorm")
    maps += [
        vec(("embedder", "mm_soft_embedding_norm", "scale"), f"{pj}mm_soft_emb_norm.weight", w),
        ParamMap(
            ("embedder", "mm_input_projection", "w"),
            (f"{pj}mm_input_projection_weight",),
            ((w,), (text_hidden,)),
            (0, 1),
        ),
    ]
    return maps


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------


def image_blocks(tokens: jax.Array, image_token_id: int) -> jax.Array:
    """[B, T] tokens -> [B, T, T]: True where both tokens are soft tokens of the same image
    (one unbroken run of them), which attend to each other both ways."""
    is_image = tokens == image_token_id
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    block = jnp.cumsum(starts, axis=-1) * is_image
    return (block[:, :, None] == block[:, None, :]) & (block[:, :, None] > 0)


def attention_mask(tokens: jax.Array, input_mask: jax.Array, image_token_id: int) -> jax.Array:
    """[B, T] tokens and padding mask -> [B, T, T]: causal, and each image's soft tokens
    attending to each other both ways (as transformers does from token_type_ids)."""
    from posttrain.trainer.models.generation import causal_mask

    return causal_mask(input_mask) | image_blocks(tokens, image_token_id)


@nnx.jit
def _forward(model, tokens, positions, mask, images):
    from posttrain.trainer.models.generation import compute_view

    logits, _ = compute_view(model)(tokens, positions, None, mask, images=images)
    return logits.astype(jnp.float32)


def forward(
    model: nnx.Module, input_ids: Any, images: Any, input_mask: Any | None = None
) -> jax.Array:
    """Float32 logits ``[B, T, V]`` of right-padded ``input_ids`` whose image soft tokens
    take the embeddings of ``images`` ``[B, N, H, W, C]`` (processed pixels, in order;
    rows with fewer images are padded at the end with any pixels)."""
    from posttrain.trainer.models.generation import padded_inputs

    soft = image_token_id(model)
    tokens, mask, positions = padded_inputs(input_ids, input_mask)
    pixels = jnp.asarray(np.asarray(images), jnp.float32)
    return _forward(model, tokens, positions, attention_mask(tokens, mask, soft), pixels)


def image_token_id(model: nnx.Module) -> int:
    """The soft-token placeholder id of a Tunix Gemma 3 with a vision tower."""
    vc = getattr(model.config, "vision_config", None)
    if vc is None:
        raise ValueError("spec.data.columns.images: the model was loaded without a vision tower")
    return int(vc.soft_token_placeholder)


def full_finetune_params(train_tower: bool = False) -> Any:
    """The nnx filter of what a full fine-tune of a vision model trains: the projector
    and the language model, and the vision tower only with ``train_tower``
    (spec.training.trainVisionTower; see ``unfreeze_tower``)."""
    if train_tower:
        return nnx.Param
    return nnx.All(nnx.Param, nnx.Not(nnx.PathContains("vision_encoder")))


def unfreeze_tower(model: nnx.Module) -> None:
    """Lets the gradients reach the vision tower: Tunix's SigLIP stops them at its output
    (``apply_stop_gradient``), which freezes the tower whatever the optimizer holds."""
    if getattr(model, "vision_encoder", None) is None:
        raise ValueError("spec.training.trainVisionTower: the model has no vision tower")
    model.vision_encoder.apply_stop_gradient = False
