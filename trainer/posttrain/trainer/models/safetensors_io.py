"""safetensors files: read lazily a slice at a time, written one tensor in memory at a time.

``SafetensorsDir`` reads the ``*.safetensors`` files of a directory, local or gs:// (with
ranged requests), so that each host reads only its own shards; ``write_safetensors``
streams tensors into one file; ``host_array`` is the full value of a (possibly
multi-host) array on this host, for writing.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from typing import Any

import jax
import ml_dtypes  # (registers bfloat16 with numpy for safetensors' numpy reader)
import numpy as np
from safetensors import safe_open

from posttrain.trainer import storage
from posttrain.trainer.gcs_safetensors import GcsSafetensors


class SafetensorsDir:
    """Tensor name -> lazy slice over all ``*.safetensors`` files of a directory (local, or
    gs:// read with ranged requests)."""

    def __init__(self, model_dir: str):
        index = storage.join(model_dir, "model.safetensors.index.json")
        if storage.exists(index):
            weight_map = json.loads(storage.read_text(index))["weight_map"]
            files = sorted({storage.join(model_dir, f) for f in weight_map.values()})
        else:
            files = [
                f
                for f in storage.list_uri(model_dir)
                if f.endswith(".safetensors") and storage.basename(f) != "adapter_model.safetensors"
            ]
        if not files:
            raise FileNotFoundError(f"spec.model.source: no *.safetensors files in {model_dir}")
        self._handles = [
            GcsSafetensors(f) if storage.is_gcs(f) else safe_open(f, framework="numpy")
            for f in files
        ]
        self._where: dict[str, Any] = {}
        for handle in self._handles:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                self._where[name] = handle
        self._slices: dict[str, Any] = {}

    def keys(self) -> set[str]:
        return set(self._where)

    def fetched(self) -> tuple[int, int] | None:
        """(bytes fetched, total bytes) of the files on gs://; None for local files."""
        remote = [h for h in self._handles if isinstance(h, GcsSafetensors)]
        if not remote:
            return None
        return sum(h.bytes_read for h in remote), sum(h.size for h in remote)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).get_shape())

    def get(self, name: str):
        if name not in self._slices:
            self._slices[name] = self._where[name].get_slice(name)
        return self._slices[name]

    def close(self) -> None:
        self._slices.clear()
        for handle in self._handles:
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)


def detect_prefix(keys: set[str]) -> str:
    for prefix in ("model.", "model.language_model.", "language_model.model."):
        if f"{prefix}embed_tokens.weight" in keys:
            return prefix
    raise ValueError("spec.model.source: no embed_tokens.weight tensor in the checkpoint")


def host_array(x: Any) -> np.ndarray:
    """The full value of a (possibly multi-host) array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}


def write_safetensors(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Streams tensors into a safetensors file, one in memory at a time.

    ``tensors``: (name, shape, dtype, produce) with ``produce()`` returning the array.
    """
    entries = list(tensors)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": _ST_DTYPES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for name, shape, dtype, produce in entries:
            arr = np.ascontiguousarray(produce(), dtype=dtype)
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"{name}: produced {arr.shape}, declared {shape}")
            out.write(arr.tobytes())
