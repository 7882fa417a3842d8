"""A data source as random-access rows (``Records``): jsonl / json / parquet / arrow /
ArrayRecord files, a directory of them, or a ``datasets`` save_to_disk directory; local
or gs://. Nothing is read until a row is asked for, except what finds the rows: a
jsonl file's byte-offset index (built once, cached), parquet footers, arrow schemas.

``Records`` is a Grain random-access data source (``__len__``, ``__getitem__``).
``held_out_split`` takes spec.eval's held-out rows out of it without reading any.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from posttrain.trainer import storage
from posttrain.trainer.data import record_files
from posttrain.trainer.data.errors import DataError

JSONL_EXTS = (".jsonl", ".json", ".ndjson")
PARQUET_EXTS = (".parquet", ".pq")
ARROW_EXTS = (".arrow",)
ARRAY_RECORD_EXTS = (".array_record", ".arrayrecord")
FORMATS_NAMED = "jsonl, json, parquet, arrow or arrayrecord"


@dataclass(frozen=True)
class Row:
    """A row's values, its index in its Records, and where it is (for messages)."""

    index: int
    values: dict[str, Any]
    records: Any

    @property
    def where(self) -> str:
        return self.records.where(self.index)

    def value(self, column: str, field_name: str) -> Any:
        """values[column], or DataError naming the row when missing or null."""
        v = self.values.get(column)
        if v is None:
            raise DataError(
                f"{self.where}: column {column!r} (spec.data.columns.{field_name}) is "
                "missing or null in this row"
            )
        return v


class Records:
    """The rows of a data source, by index across its files (Grain's
    RandomAccessDataSource): the files' row counts are all it keeps."""

    def __init__(self, source: str, files: Sequence[record_files.RecordFile]) -> None:
        self.source = source
        self.files = [f for f in files if len(f)]
        self._starts = np.zeros(len(self.files) + 1, np.int64)
        np.cumsum([len(f) for f in self.files], out=self._starts[1:])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[record_files.RecordFile, int]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.files[k], i - int(self._starts[k])

    def __getitem__(self, i: int) -> Row:
        f, j = self._locate(i)
        return Row(int(i), f.read(j), self)

    def read_many(self, indices: Sequence[int]) -> list[Row]:
        """Rows by index, in that order, read a file at a time (one call per file for
        formats that read in batches)."""
        out: list[Row | None] = [None] * len(indices)
        by_file: dict[int, list[tuple[int, int]]] = {}
        for k, i in enumerate(indices):
            i = int(i)
            if not 0 <= i < len(self):
                raise IndexError(f"row {i} of {len(self)}")
            f = int(np.searchsorted(self._starts, i, side="right")) - 1
            by_file.setdefault(f, []).append((k, i))
        for f, wanted in by_file.items():
            start = int(self._starts[f])
            values = self.files[f].read_many([i - start for _, i in wanted])
            for (k, i), v in zip(wanted, values, strict=True):
                out[k] = Row(i, v, self)
        return out  # type: ignore[return-value]

    def where(self, i: int) -> str:
        """'file:line' (jsonl) or 'file (row n)' of row i, for error messages."""
        f, j = self._locate(i)
        return f.where(j)

    @property
    def bytes_read(self) -> int:
        """Bytes read from the files so far (rows, and row groups for parquet)."""
        return sum(f.bytes_read for f in self.files)

    @property
    def columns(self) -> list[str]:
        """Columns of the first file."""
        return self.files[0].columns if self.files else []

    def has(self, column: str) -> bool:
        return column in self.columns

    def require(self, column: str, field_name: str) -> None:
        """Raise DataError naming the first file without `column`."""
        for f in self.files:
            if column not in f.columns:
                raise DataError(
                    f"{f.path}: column {column!r} (spec.data.columns.{field_name}) not "
                    f"found; columns are: {', '.join(f.columns) or '(none)'}"
                )


class RecordsView:
    """Some rows of a Records, by a map from view index to row index: an index array
    (`indices`), or the rows at positions [offset, offset + length) of a seeded
    Feistel permutation (nothing kept per row)."""

    def __init__(
        self,
        records: Records,
        *,
        indices: np.ndarray | None = None,
        offset: int = 0,
        length: int = 0,
        seed: int = 0,
    ) -> None:
        self.records = records
        self.source = records.source
        self.files = records.files
        self._indices = indices
        self._offset, self._length, self._seed = offset, length, seed

    def __len__(self) -> int:
        return len(self._indices) if self._indices is not None else self._length

    def origin(self, i: int) -> int:
        """The row index in the whole Records of view row i."""
        if self._indices is not None:
            return int(self._indices[i])
        if not 0 <= i < self._length:
            raise IndexError(f"row {i} of {self._length}")
        return _permuted(self._offset + int(i), len(self.records), self._seed)

    def __getitem__(self, i: int) -> Row:
        row = self.records[self.origin(i)]
        return Row(int(i), row.values, self)

    def read_many(self, indices: Sequence[int]) -> list[Row]:
        rows = self.records.read_many([self.origin(int(i)) for i in indices])
        return [Row(int(i), r.values, self) for i, r in zip(indices, rows, strict=True)]

    def where(self, i: int) -> str:
        return self.records.where(self.origin(i))

    @property
    def bytes_read(self) -> int:
        return self.records.bytes_read

    @property
    def columns(self) -> list[str]:
        return self.records.columns

    def has(self, column: str) -> bool:
        return self.records.has(column)

    def require(self, column: str, field_name: str) -> None:
        self.records.require(column, field_name)


def _permuted(position: int, n: int, seed: int) -> int:
    from grain._src.python.experimental.index_shuffle.python import (
        index_shuffle_module as index_shuffle,
    )

    return int(index_shuffle.index_shuffle(position, max_index=n - 1, seed=seed, rounds=4))


def _fmt_of(path: str, declared: str) -> str | None:
    if declared != "auto":
        return "jsonl" if declared == "json" else declared
    low = path.lower()
    if low.endswith(JSONL_EXTS):
        return "jsonl"
    if low.endswith(PARQUET_EXTS):
        return "parquet"
    if low.endswith(ARROW_EXTS):
        return "arrow"
    if low.endswith(ARRAY_RECORD_EXTS) or ".array_record-" in low:
        return "arrayrecord"
    return None


def _datasets_dir_files(root: str, split: str) -> list[str]:
    """Arrow files of a `datasets` save_to_disk directory (Dataset or DatasetDict)."""
    dict_json = storage.join(root, "dataset_dict.json")
    if storage.exists(dict_json):
        splits = json.loads(storage.read_text(dict_json)).get("splits", [])
        if split not in splits:
            raise DataError(
                f"{root}: split {split!r} (spec.data.split) not found; splits are: "
                f"{', '.join(splits) or '(none)'}"
            )
        root = storage.join(root, split)
    state_json = storage.join(root, "state.json")
    if storage.exists(state_json):
        state = json.loads(storage.read_text(state_json))
        names = [f["filename"] for f in state.get("_data_files", [])]
        if names:
            return [storage.join(root, n) for n in names]
    return [f for f in storage.list_uri(root) if f.endswith(ARROW_EXTS)]


def _is_datasets_dir(root: str) -> bool:
    return storage.exists(storage.join(root, "dataset_dict.json")) or storage.exists(
        storage.join(root, "state.json")
    )


def data_files(source: str, *, format: str = "auto", split: str = "train") -> list[tuple[str, str]]:
    """The (file, format) pairs that make up a dataset source, in reading order."""
    source = str(source)
    if not storage.exists(source):
        raise DataError(f"{source}: not found (spec.data.source)")
    if not storage.is_dir(source):
        fmt = _fmt_of(source, format)
        if fmt is None:
            raise DataError(
                f"{source}: cannot tell the format from the extension; set spec.data.format "
                f"({FORMATS_NAMED})"
            )
        return [(source, fmt)]
    if format in ("auto", "arrow") and _is_datasets_dir(source):
        return [(f, "arrow") for f in _datasets_dir_files(source, split)]
    files = []
    for f in storage.list_uri(source):
        fmt = _fmt_of(f, "auto")
        if fmt is not None and (format == "auto" or fmt == _fmt_of(f, format)):
            files.append((f, fmt))
    if not files:
        raise DataError(
            f"{source}: the directory holds no .jsonl, .parquet, .arrow or .array_record "
            "files (spec.data.source)"
        )
    return files


def open_file(
    path: str, fmt: str, index_dir: str | None = None, process_index: int = 0
) -> record_files.RecordFile:
    if fmt == "jsonl":
        return record_files.open_json(path, index_dir, process_index)
    if fmt == "parquet":
        return record_files.ParquetFile(path)
    if fmt == "arrow":
        return record_files.ArrowFile(path)
    return record_files.ArrayRecordFile(path)


def open_records(
    source: str,
    *,
    format: str = "auto",
    split: str = "train",
    index_dir: str | None = None,
    process_index: int = 0,
) -> Records:
    """The rows of a file, a directory of files (sorted) or a `datasets` save_to_disk
    directory; local or gs://. jsonl offset indexes are cached under `index_dir` (built
    by process 0, read by the others) when given. Empty data is a DataError."""
    files = [
        open_file(path, fmt, index_dir, process_index)
        for path, fmt in data_files(source, format=format, split=split)
    ]
    records = Records(str(source), files)
    if not len(records):
        raise DataError(f"{source}: the dataset is empty (no rows) (spec.data.source)")
    return records


def held_out_split(records: Records, fraction: float, seed: int) -> tuple[RecordsView, RecordsView]:
    """(training rows, held-out rows): round(fraction * n) rows (at least one, at most
    n - 1), the first positions of a Feistel permutation seeded by `seed` (the same on
    every host, nothing read). The held-out rows keep the files' order; the training
    rows are the rest of the permutation."""
    n = len(records)
    if n < 2:
        raise DataError(
            f"{records.source}: {n} row(s) cannot be split into training and held-out data "
            "(spec.eval.fraction); give spec.eval.source instead"
        )
    k = min(max(1, round(fraction * n)), n - 1)
    held = np.sort(np.fromiter((_permuted(t, n, seed) for t in range(k)), np.int64, count=k))
    return RecordsView(records, offset=k, length=n - k, seed=seed), RecordsView(
        records, indices=held
    )


def open_train_and_eval(
    spec: Any, *, index_dir: str | None = None, process_index: int = 0
) -> tuple[Records | RecordsView, Records | RecordsView | None]:
    """The training rows and the held-out rows of spec.eval (None without spec.eval):
    spec.eval.source when given, else spec.eval.fraction of the training data."""
    data = spec.data
    kw = {"index_dir": index_dir, "process_index": process_index}
    records = open_records(data.source, format=data.format, split=data.split, **kw)
    settings = getattr(spec, "eval", None)
    if settings is None:
        return records, None
    if settings.source:
        held = open_records(settings.source, format=data.format, split=settings.split, **kw)
        return records, held
    return held_out_split(records, settings.fraction, spec.training.seed)
