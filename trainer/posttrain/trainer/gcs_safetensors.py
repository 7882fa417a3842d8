"""Reading ``*.safetensors`` files on gs:// with ranged requests, so each host fetches only
the rows of the blocks its devices hold (``models.load_model`` reads through
``jax.make_array_from_callback``), never a whole checkpoint.

The format: 8 bytes (little-endian u64) giving the header's length, the JSON header
(``name -> {dtype, shape, data_offsets}``), then the tensors' bytes, row-major.
A block ``[a:b, ...]`` of a tensor is one contiguous byte range over rows ``a..b`` of its
first axis; the other axes are cut in memory. A host thus fetches the rows its devices
hold: for a weight sharded along its first (HF) axis that is its share; for one sharded
across rows (a transposed weight) it is the whole tensor, once.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import ml_dtypes
import numpy as np

from posttrain.trainer import storage

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class GcsSafetensors:
    """One safetensors object on gs://: its tensor names and lazy slices
    (``get_slice(name)[index]``, like ``safetensors.safe_open``)."""

    def __init__(self, uri: str):
        self.uri = uri
        self._blob = storage.blob(uri)
        self._blob.reload()
        self.size: int = self._blob.size
        self.bytes_read = 0
        # The rows fetched last: a host's devices ask for a tensor one after another, and
        # replicated blocks (or blocks cut across rows) then come from one fetch.
        self.last_rows: tuple[str, int, int, np.ndarray] | None = None
        if self.size < 8:
            raise ValueError(f"{uri}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", self._read(0, 8))
        if 8 + length > self.size:
            raise ValueError(f"{uri}: not a safetensors file (its header runs past the end)")
        try:
            header = json.loads(self._read(8, 8 + length))
        except ValueError as e:
            raise ValueError(f"{uri}: not a safetensors file (bad header: {e})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        self._tensors: dict[str, dict[str, Any]] = header
        for name, entry in header.items():
            if entry.get("dtype") not in DTYPES:
                raise ValueError(f"{uri}: tensor {name} has unsupported dtype {entry.get('dtype')}")
            if self._data_start + entry["data_offsets"][1] > self.size:
                raise ValueError(f"{uri}: truncated; tensor {name} runs past the end")

    def _read(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object (fewer at its end)."""
        if stop <= start:
            return b""
        data = self._blob.download_as_bytes(start=start, end=stop - 1)
        self.bytes_read += len(data)
        return data

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, name, self._tensors[name])


class TensorSlice:
    """A tensor of a GcsSafetensors; indexing with slices reads only the rows it covers."""

    def __init__(self, file: GcsSafetensors, name: str, entry: dict[str, Any]):
        self._file, self._name = file, name
        self._dtype = DTYPES[entry["dtype"]]
        self._shape = tuple(entry["shape"])
        self._begin, self._end = entry["data_offsets"]
        expected = math.prod(self._shape) * self._dtype.itemsize
        if self._end - self._begin != expected:
            raise ValueError(
                f"{file.uri}: tensor {name} spans {self._end - self._begin} bytes, "
                f"its shape {list(self._shape)} needs {expected}"
            )

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, index: Any) -> np.ndarray:
        if not isinstance(index, tuple):
            index = (index,)
        if not self._shape:
            return self._rows(0, 1).reshape(())[index]
        first = index[0] if index else slice(None)
        if not isinstance(first, slice) or first.step not in (None, 1):
            raise TypeError(f"{self._name}: only unit-step slices can be read from gs://")
        start, stop, _ = first.indices(self._shape[0])
        stop = max(start, stop)
        block = self._rows(start, stop)
        return block[(slice(None), *index[1:])]

    def _rows(self, start: int, stop: int) -> np.ndarray:
        last = self._file.last_rows
        if last is not None and last[0] == self._name and last[1] <= start and stop <= last[2]:
            return last[3][start - last[1] : stop - last[1]]
        row = math.prod(self._shape[1:]) * self._dtype.itemsize
        base = self._file._data_start + self._begin
        data = self._file._read(base + start * row, base + stop * row)
        if len(data) != (stop - start) * row:
            raise ValueError(f"{self._file.uri}: truncated; tensor {self._name} is cut short")
        rows = np.frombuffer(data, dtype=self._dtype).reshape((stop - start, *self._shape[1:]))
        self._file.last_rows = (self._name, start, stop, rows)
        return rows
