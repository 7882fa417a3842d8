"""Parameter mapping: which Hugging Face tensor(s) each Tunix parameter is made of, and how.

A ``ParamMap`` reads the block of a Tunix parameter that one device needs straight from
the HF tensor(s) (``read``) and turns a whole value back into HF tensors (``to_hf``);
``param_maps`` lists them for every parameter of a family's model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from posttrain.trainer.models.config import ModelInfo


@dataclasses.dataclass(frozen=True)
class ParamMap:
    """One Tunix param made from HF tensor(s).

    Each source is an HF tensor whose axes split into ``split`` groups (e.g. q_proj
    ``[N*H, D]`` -> ``((N, H), (D,))``); the split tensor is transposed by ``perm`` to the
    Tunix layout. With several sources, the results are stacked on a new leading axis
    (Gemma's ``kv_einsum`` = stack(k, v)).
    """

    path: tuple
    sources: tuple[str, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.split)

    @property
    def split_shape(self) -> tuple[int, ...]:
        return tuple(d for g in self.split for d in g)

    @property
    def shape(self) -> tuple[int, ...]:
        one = tuple(self.split_shape[p] for p in self.perm)
        return (len(self.sources), *one) if len(self.sources) > 1 else one

    def read(self, get: Callable[[str], Any], index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of the Tunix param, reading only what it needs."""
        index = tuple(
            slice(*s.indices(dim))
            for s, dim in zip(_pad_index(index, len(self.shape)), self.shape, strict=True)
        )
        if len(self.sources) > 1:
            names = self.sources[index[0]]
            return np.stack([self._read_one(get(n), index[1:]) for n in names])
        return self._read_one(get(self.sources[0]), index)

    def _read_one(self, tensor: Any, index: tuple[slice, ...]) -> np.ndarray:
        split_index: list[slice] = [slice(None)] * len(self.perm)
        for j, p in enumerate(self.perm):
            split_index[p] = index[j]
        hf_index, block_shape, post = [], [], []
        k = 0
        for group in self.split:
            outer = split_index[k]
            inner = math.prod(group[1:])
            hf_index.append(slice(outer.start * inner, outer.stop * inner))
            block_shape.extend([outer.stop - outer.start, *group[1:]])
            post.extend([slice(None), *split_index[k + 1 : k + len(group)]])
            k += len(group)
        block = np.asarray(tensor[tuple(hf_index)]).reshape(block_shape)
        return block[tuple(post)].transpose(self.perm)

    def to_hf(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """The HF tensor(s) of a full Tunix param value."""
        inverse = tuple(np.argsort(self.perm))
        parts = value if len(self.sources) > 1 else [value]
        return {
            name: np.ascontiguousarray(np.asarray(part).transpose(inverse).reshape(self.hf_shape))
            for name, part in zip(self.sources, parts, strict=True)
        }


def _pad_index(index: tuple, ndim: int) -> tuple:
    index = tuple(index) if isinstance(index, tuple) else (index,)
    return index + (slice(None),) * (ndim - len(index))


def param_maps(info: ModelInfo) -> list[ParamMap]:
    """Every Tunix param of the family and the HF tensor(s) it is made of."""
    p, fam = info.hf_prefix, info.family
    d, n, k, h = info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim
    f, v = info.intermediate_size, info.vocab_size
    maps = [
        ParamMap(
            ("embedder", "input_embedding"), (f"{p}embed_tokens.weight",), ((v,), (d,)), (0, 1)
        )
    ]
    gemma = fam.startswith("gemma")
    for i in range(info.num_layers):
        hf, t = f"{p}layers.{i}.", ("layers", i)

        def vec(path: tuple, name: str, size: int, hf=hf, t=t) -> ParamMap:
            return ParamMap(t + path, (hf + name,), ((size,),), (0,))

        mlp = [
            ParamMap(
                t + ("mlp", "gate_proj", "kernel"),
                (hf + "mlp.gate_proj.weight",),
                ((f,), (d,)),
                (1, 0),
            ),
            ParamMap(
                t + ("mlp", "up_proj", "kernel"), (hf + "mlp.up_proj.weight",), ((f,), (d,)), (1, 0)
            ),
            ParamMap(
                t + ("mlp", "down_proj", "kernel"),
                (hf + "mlp.down_proj.weight",),
                ((d,), (f,)),
                (1, 0),
            ),
        ]
        q, kk, vv, o = (hf + f"self_attn.{x}_proj.weight" for x in "qkvo")
        if not gemma:
            maps += [
                ParamMap(t + ("attn", "q_proj", "w"), (q,), ((n, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "k_proj", "w"), (kk,), ((k, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "v_proj", "w"), (vv,), ((k, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "o_proj", "w"), (o,), ((d,), (n, h)), (1, 2, 0)),
                *mlp,
                vec(("input_layernorm", "w"), "input_layernorm.weight", d),
                vec(("post_attention_layernorm", "w"), "post_attention_layernorm.weight", d),
            ]
            if fam == "qwen2":
                maps += [
                    vec(("attn", "q_bias"), "self_attn.q_proj.bias", n * h),
                    vec(("attn", "k_bias"), "self_attn.k_proj.bias", k * h),
                    vec(("attn", "v_bias"), "self_attn.v_proj.bias", k * h),
                ]
            if fam == "qwen3":
                maps += [
                    vec(("attn", "q_norm", "w"), "self_attn.q_norm.weight", h),
                    vec(("attn", "k_norm", "w"), "self_attn.k_norm.weight", h),
                ]
            continue
        if n == k:
            maps.append(
                ParamMap(t + ("attn", "qkv_einsum", "w"), (q, kk, vv), ((n, h), (d,)), (0, 2, 1))
            )
        else:
            maps += [
                ParamMap(t + ("attn", "q_einsum", "w"), (q,), ((n, h), (d,)), (0, 2, 1)),
                ParamMap(t + ("attn", "kv_einsum", "w"), (kk, vv), ((k, h), (d,)), (0, 2, 1)),
            ]
        post_attn = "post_attn_norm" if fam == "gemma2" else "post_attention_norm"
        maps += [
            ParamMap(t + ("attn", "attn_vec_einsum", "w"), (o,), ((d,), (n, h)), (1, 2, 0)),
            *mlp,
            vec(("pre_attention_norm", "scale"), "input_layernorm.weight", d),
            vec((post_attn, "scale"), "post_attention_layernorm.weight", d),
            vec(("pre_ffw_norm", "scale"), "pre_feedforward_layernorm.weight", d),
            vec(("post_ffw_norm", "scale"), "post_feedforward_layernorm.weight", d),
        ]
        if fam == "gemma3":
            maps += [
                vec(("attn", "_query_norm", "scale"), "self_attn.q_norm.weight", h),
                vec(("attn", "_key_norm", "scale"), "self_attn.k_norm.weight", h),
            ]
    norm = ("final_norm", "scale") if gemma else ("final_norm", "w")
    maps.append(ParamMap(norm, (f"{p}norm.weight",), ((d,),), (0,)))
    if not info.tie_word_embeddings:
        head = (
            "language_model.lm_head.weight" if p.startswith("language_model.") else "lm_head.weight"
        )
        maps.append(ParamMap(("lm_head", "w"), (head,), ((v,), (d,)), (1, 0)))
    if info.vision is not None:  # Gemma 3's vision tower and projector
        from posttrain.trainer import vision

        maps += vision.param_maps(info.vision, info.hidden_size)
    return maps
