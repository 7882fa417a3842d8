"""``ParamMap``: one Tunix parameter made of Hugging Face tensor(s), read a block at a time
(``read``) and turned back into HF tensors (``to_hf``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np


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
