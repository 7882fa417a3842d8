"""Reading a data source: jsonl / json / parquet / arrow files, a directory of them, or a
``datasets`` save_to_disk directory, local or gs://; and the held-out split of spec.eval.

A ``RawDataset`` keeps every row and where it came from (file and line), so that errors
name them.
"""

from __future__ import annotations

import bisect
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from posttrain.trainer import storage
from posttrain.trainer.data.errors import DataError

JSONL_EXTS = (".jsonl", ".json", ".ndjson")
PARQUET_EXTS = (".parquet", ".pq")
ARROW_EXTS = (".arrow",)


@dataclass
class FilePart:
    path: str
    columns: list[str]
    start: int  # index of its first row in RawDataset.rows
    lines: list[int] | None = None  # jsonl line number of each row


@dataclass
class RawDataset:
    """Rows (dicts) of a dataset and where each came from."""

    source: str
    rows: list[dict[str, Any]]
    parts: list[FilePart]
    origin: list[int] | None = None  # a subset's row i is row origin[i] of the files

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, indices: Sequence[int]) -> RawDataset:
        """These rows, in this order; error messages still name their files and lines."""
        origin = [self.origin[i] if self.origin is not None else int(i) for i in indices]
        return RawDataset(self.source, [self.rows[i] for i in indices], self.parts, origin)

    @property
    def columns(self) -> list[str]:
        """Columns of the first file."""
        return self.parts[0].columns if self.parts else []

    def _part(self, i: int) -> FilePart:
        starts = [p.start for p in self.parts]
        return self.parts[bisect.bisect_right(starts, i) - 1]

    def where(self, i: int) -> str:
        """'file:line' (jsonl) or 'file (row n)' of row i, for error messages."""
        i = self.origin[i] if self.origin is not None else i
        part = self._part(i)
        if part.lines is not None:
            return f"{part.path}:{part.lines[i - part.start]}"
        return f"{part.path} (row {i - part.start})"

    def require(self, column: str, field_name: str) -> None:
        """Raise DataError naming the first file without `column`."""
        for part in self.parts:
            if column not in part.columns:
                raise DataError(
                    f"{part.path}: column {column!r} (spec.data.columns.{field_name}) not "
                    f"found; columns are: {', '.join(part.columns) or '(none)'}"
                )

    def has(self, column: str) -> bool:
        return bool(self.parts) and column in self.parts[0].columns

    def value(self, i: int, column: str, field_name: str) -> Any:
        """rows[i][column], or DataError naming the row when missing or null."""
        v = self.rows[i].get(column)
        if v is None:
            raise DataError(
                f"{self.where(i)}: column {column!r} (spec.data.columns.{field_name}) is "
                "missing or null in this row"
            )
        return v


def _fmt_of(path: str, declared: str) -> str | None:
    if declared != "auto":
        return declared
    low = path.lower()
    if low.endswith(JSONL_EXTS):
        return "jsonl"
    if low.endswith(PARQUET_EXTS):
        return "parquet"
    if low.endswith(ARROW_EXTS):
        return "arrow"
    return None


def _read_jsonl(path: str) -> tuple[list[dict[str, Any]], list[int]]:
    text = storage.read_bytes(path).decode("utf-8-sig")
    if text.lstrip().startswith("["):  # a JSON array file
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON: {e}") from e
        lines = list(range(1, len(rows) + 1))
    else:
        rows, lines = [], []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: invalid JSON: {e}") from e
            lines.append(n)
    for row, n in zip(rows, lines, strict=True):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: each line must be a JSON object, got {type(row)}")
    return rows, lines


def _arrow_table_of(path: str) -> Any:
    import pyarrow as pa
    import pyarrow.ipc

    def source() -> Any:
        if storage.is_gcs(path):
            return pa.BufferReader(storage.read_bytes(path))
        return pa.memory_map(path)

    try:
        return pa.ipc.open_stream(source()).read_all()  # what datasets.save_to_disk writes
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source()).read_all()


def _read_table(path: str, fmt: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            if storage.is_gcs(path):
                return pq.read_table(io.BytesIO(storage.read_bytes(path)))
            return pq.read_table(path)
        return _arrow_table_of(path)
    except (pa.ArrowInvalid, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise DataError(f"{path}: not a readable {fmt} file: {e}") from e


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
                "(jsonl, parquet or arrow)"
            )
        return [(source, fmt)]
    if format in ("auto", "arrow") and _is_datasets_dir(source):
        return [(f, "arrow") for f in _datasets_dir_files(source, split)]
    files = []
    for f in storage.list_uri(source):
        fmt = _fmt_of(f, "auto")
        if fmt is not None and (format == "auto" or fmt == format):
            files.append((f, fmt))
    if not files:
        raise DataError(
            f"{source}: the directory holds no .jsonl, .parquet or .arrow files (spec.data.source)"
        )
    return files


def read_dataset(source: str, *, format: str = "auto", split: str = "train") -> RawDataset:
    """Read every row of a jsonl/parquet/arrow file, a directory of them (sorted), or a
    `datasets` save_to_disk directory; local or gs://. Empty data is a DataError."""
    rows: list[dict[str, Any]] = []
    parts: list[FilePart] = []
    for path, fmt in data_files(source, format=format, split=split):
        if fmt == "jsonl":
            file_rows, lines = _read_jsonl(path)
            columns = list(file_rows[0]) if file_rows else []
            parts.append(FilePart(path, columns, len(rows), lines))
        else:
            table = _read_table(path, fmt)
            file_rows = table.to_pylist()
            parts.append(FilePart(path, list(table.column_names), len(rows)))
        rows.extend(file_rows)
    if not rows:
        raise DataError(f"{source}: the dataset is empty (no rows) (spec.data.source)")
    return RawDataset(source=str(source), rows=rows, parts=[p for p in parts if p.columns])


def held_out_split(ds: RawDataset, fraction: float, seed: int) -> tuple[RawDataset, RawDataset]:
    """(training rows, held-out rows): round(fraction * n) rows (at least one, at most
    n - 1) drawn by numpy's default_rng(seed), the same on every host; both keep the
    files' order."""
    n = len(ds)
    if n < 2:
        raise DataError(
            f"{ds.source}: {n} row(s) cannot be split into training and held-out data "
            "(spec.eval.fraction); give spec.eval.source instead"
        )
    k = min(max(1, round(fraction * n)), n - 1)
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng(seed).permutation(n)[:k]] = True
    return ds.subset(np.flatnonzero(~held)), ds.subset(np.flatnonzero(held))


def read_train_and_eval(spec: Any) -> tuple[RawDataset, RawDataset | None]:
    """The training data and the held-out data of spec.eval (None without spec.eval):
    spec.eval.source when given, else spec.eval.fraction of the training data."""
    data = spec.data
    ds = read_dataset(data.source, format=data.format, split=data.split)
    settings = getattr(spec, "eval", None)
    if settings is None:
        return ds, None
    if settings.source:
        return ds, read_dataset(settings.source, format=data.format, split=settings.split)
    return held_out_split(ds, settings.fraction, spec.training.seed)
