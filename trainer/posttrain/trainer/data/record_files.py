"""One data file as random-access rows, read only when asked for: jsonl (a byte-offset
index), a JSON array (parsed whole: small files), parquet (row groups), arrow IPC
(memory-mapped; what ``datasets`` save_to_disk writes) and ArrayRecord (one JSON
object a record, through Grain).

Every file counts the bytes it reads (``bytes_read``) and names a row for error messages
(``where``): ``file:line`` for jsonl, ``file (row n)`` otherwise.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from posttrain.trainer import storage
from posttrain.trainer.data.errors import DataError

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # bytes per read while indexing a jsonl file
INDEX_WAIT_S = 1800.0  # how long a host waits for process 0 to write a shared index


class RecordFile:
    """A file's rows by index; subclasses read them."""

    path: str
    fmt: str
    columns: list[str]

    def __init__(self) -> None:
        self.bytes_read = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, i: int) -> dict[str, Any]:
        raise NotImplementedError

    def read_many(self, indices: list[int]) -> list[dict[str, Any]]:
        """Rows by index, in that order (formats that read in batches override it)."""
        return [self.read(i) for i in indices]

    def where(self, i: int) -> str:
        return f"{self.path} (row {i})"

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n


def _json_object(raw: bytes, where: Callable[[], str], invalid: str) -> dict[str, Any]:
    """One row's JSON object; a DataError naming where() when it is not one (called
    only then: a jsonl row's line number is counted from the start of the file)."""
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{where()}: {invalid}: {e}") from None
    if not isinstance(row, dict):
        raise _not_an_object(where(), row)
    return row


def _not_an_object(where: str, value: Any) -> DataError:
    return DataError(f"{where}: each line must be a JSON object, got {type(value).__name__}")


# ---------------------------------------------------------------------------- jsonl


def _identity(path: str) -> tuple[int, str]:
    """(size, a stamp that changes when the file does) of a local file or gs:// object."""
    if storage.is_gcs(path):
        blob = storage.blob(path)
        blob.reload()
        return int(blob.size), str(blob.generation)
    st = os.stat(path)
    return st.st_size, str(st.st_mtime_ns)


def _read_range(path: str, start: int, end: int) -> bytes:
    if storage.is_gcs(path):
        return storage.blob(path).download_as_bytes(start=start, end=end - 1)
    with open(path, "rb") as f:
        return os.pread(f.fileno(), end - start, start)


def scan_line_offsets(path: str) -> np.ndarray:
    """Where the rows of a JSON-lines file start, and where the file ends: int64
    [rows + 1]; row i is bytes [offsets[i], offsets[i + 1]) (blank lines after a row are
    part of its bytes: JSON ignores them). One pass in numpy, CHUNK bytes at a time."""
    starts: list[np.ndarray] = []
    pos = 0
    next_start = 0  # where the line after the last newline seen starts
    with storage.open_uri(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            buf = np.frombuffer(chunk, dtype=np.uint8)
            nl = np.flatnonzero(buf == 10)
            if len(nl):
                line_starts = np.concatenate(([next_start - pos], nl[:-1] + 1))
                length = nl + 1 - line_starts
                blank = length == 1
                two = np.flatnonzero(length == 2)
                ok = two[line_starts[two] >= 0]  # a "\r\n" line inside this chunk
                blank[ok] = buf[line_starts[ok]] == 13
                starts.append(line_starts[~blank].astype(np.int64) + pos)
                next_start = pos + int(nl[-1]) + 1
            pos += len(chunk)
    if pos > next_start:  # a last line without a newline
        with storage.open_uri(path, "rb") as f:
            f.seek(next_start)
            if f.read().strip():
                starts.append(np.array([next_start], np.int64))
    starts.append(np.array([pos], np.int64))
    return np.concatenate(starts)


def _load_index(index_path: str) -> np.ndarray:
    """A cached offset index, memory-mapped (a gs:// one from a local copy): opening it
    reads its header only, and a row's offsets are paged in when the row is read, so
    neither the time nor the memory to open it grows with the rows."""
    local = _local_copy(index_path) if storage.is_gcs(index_path) else index_path
    return np.load(local, mmap_mode="r")


class JsonlFile(RecordFile):
    """JSON lines, read a line at a time through a byte-offset index (int64 numpy: the
    only thing kept per row). The index is built in one pass and, with an index
    directory, written there once and memory-mapped by every later run and every other
    host."""

    fmt = "jsonl"

    def __init__(self, path: str, index_dir: str | None = None, *, process_index: int = 0) -> None:
        super().__init__()
        self.path = path
        self._offsets = self._index(index_dir, process_index)
        self.columns = list(self.read(0)) if len(self) else []

    def _index(self, index_dir: str | None, process_index: int) -> np.ndarray:
        if index_dir is None:
            return scan_line_offsets(self.path)
        size, stamp = _identity(self.path)
        key = hashlib.sha1(f"{self.path}\0{size}\0{stamp}".encode()).hexdigest()[:20]
        index_path = storage.join(index_dir, f"{key}.npy")
        if process_index != 0:
            deadline = time.monotonic() + INDEX_WAIT_S
            while not storage.exists(index_path) and time.monotonic() < deadline:
                time.sleep(0.5)
        if storage.exists(index_path):
            try:
                return _load_index(index_path)
            except (OSError, ValueError) as e:
                log.warning("%s: unreadable index (%s); indexing again", index_path, e)
        started = time.monotonic()
        offsets = scan_line_offsets(self.path)
        log.info(
            "indexed %s: %d rows in %.1fs", self.path, len(offsets) - 1, time.monotonic() - started
        )
        if process_index == 0:
            buf = io.BytesIO()
            np.save(buf, offsets)
            try:
                storage.write_bytes(index_path, buf.getvalue())
            except OSError as e:
                log.warning("cannot cache the index of %s at %s: %s", self.path, index_path, e)
        return offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def line_of(self, i: int) -> int:
        """The 1-based line number of row i (counted when asked: errors only)."""
        start = int(self._offsets[i])
        count = 0
        with storage.open_uri(self.path, "rb") as f:
            done = 0
            while done < start:
                chunk = f.read(min(CHUNK, start - done))
                if not chunk:
                    break
                count += chunk.count(b"\n")
                done += len(chunk)
        return count + 1

    def where(self, i: int) -> str:
        return f"{self.path}:{self.line_of(i)}"

    def read(self, i: int) -> dict[str, Any]:
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        raw = _read_range(self.path, a, b)
        self._count(len(raw))
        if a == 0:
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        return _json_object(raw, lambda: self.where(i), "invalid JSON")


class JsonArrayFile(RecordFile):
    """A .json file holding one JSON array of objects: parsed whole (such files are
    small; large data belongs in jsonl, parquet or ArrayRecord)."""

    fmt = "json"

    def __init__(self, path: str, raw: bytes) -> None:
        super().__init__()
        self.path = path
        try:
            rows = json.loads(raw.decode("utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: invalid JSON: {e}") from None
        self.bytes_read = len(raw)
        self._rows = rows
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise _not_an_object(self.where(i), row)
        self.columns = list(rows[0]) if rows else []

    def __len__(self) -> int:
        return len(self._rows)

    def where(self, i: int) -> str:
        return f"{self.path}:{i + 1}"

    def read(self, i: int) -> dict[str, Any]:
        return self._rows[i]


def open_json(path: str, index_dir: str | None, process_index: int) -> RecordFile:
    """A jsonl file, or a JSON array file when its first character is '['."""
    with storage.open_uri(path, "rb") as f:
        head = f.read(4096)
    if head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"["):
        return JsonArrayFile(path, storage.read_bytes(path))
    return JsonlFile(path, index_dir, process_index=process_index)


# --------------------------------------------------------------- parquet and arrow


class _CountingFile(io.RawIOBase):
    """A binary file that counts the bytes read through it."""

    def __init__(self, f: Any, owner: RecordFile) -> None:
        self._f, self._owner = f, owner

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        b[: len(data)] = data
        self._owner._count(len(data))
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


def _open_binary(path: str) -> Any:
    if storage.is_gcs(path):
        return storage.blob(path).open("rb")
    return open(path, "rb")


class ParquetFile(RecordFile):
    """Parquet, read a row group at a time (the last few are kept decoded). Row groups
    are the unit of random access: files with small row groups (or ArrayRecord) suit a
    global shuffle of large data best."""

    fmt = "parquet"
    CACHED_GROUPS = 4

    def __init__(self, path: str) -> None:
        super().__init__()
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        try:
            self._file = pq.ParquetFile(_CountingFile(_open_binary(path), self))
        except (pa.ArrowInvalid, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise DataError(f"{path}: not a readable parquet file: {e}") from None
        meta = self._file.metadata
        counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._group_starts = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=self._group_starts[1:])
        self.columns = list(self._file.schema_arrow.names)
        self._groups: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._read_lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._group_starts[-1])

    def _group(self, g: int) -> Any:
        with self._lock:
            table = self._groups.get(g)
            if table is not None:
                self._groups.move_to_end(g)
                return table
        with self._read_lock:  # one reader of the file object at a time (seek + read)
            table = self._file.read_row_group(g)
        with self._lock:
            self._groups[g] = table
            while len(self._groups) > self.CACHED_GROUPS:
                self._groups.popitem(last=False)
        return table

    def where(self, i: int) -> str:
        g = int(np.searchsorted(self._group_starts, i, side="right")) - 1
        return f"{self.path} (row group {g}, row {i - int(self._group_starts[g])})"

    def read(self, i: int) -> dict[str, Any]:
        g = int(np.searchsorted(self._group_starts, i, side="right")) - 1
        return self._group(g).slice(i - int(self._group_starts[g]), 1).to_pylist()[0]


class ArrowFile(RecordFile):
    """An arrow IPC stream or file (``datasets`` save_to_disk), memory-mapped: a row
    read touches only its own pages. A gs:// file is fetched whole first."""

    fmt = "arrow"

    def __init__(self, path: str) -> None:
        super().__init__()
        import pyarrow as pa
        import pyarrow.ipc

        self.path = path

        def source() -> Any:
            if storage.is_gcs(path):
                raw = storage.read_bytes(path)
                self.bytes_read = len(raw)
                return pa.BufferReader(raw)
            return pa.memory_map(path)

        try:
            try:
                self._table = pa.ipc.open_stream(source()).read_all()
            except pa.ArrowInvalid:
                self._table = pa.ipc.open_file(source()).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise DataError(f"{path}: not a readable arrow file: {e}") from None
        self.columns = list(self._table.column_names)

    def __len__(self) -> int:
        return self._table.num_rows

    def read(self, i: int) -> dict[str, Any]:
        row = self._table.slice(i, 1)
        self._count(row.nbytes)
        return row.to_pylist()[0]


class ArrayRecordFile(RecordFile):
    """An ArrayRecord file: one JSON object (UTF-8) a record, read by index without
    readahead, a batch of rows in one call. The reader keeps the file's index of record
    groups in memory, one entry a group, read at open; a larger group_size (64-128)
    keeps it small for files of many millions of rows (10 M rows in groups of 128: 78 k
    entries, about 10 ms to open), each read then decompressing its row's group. (The
    reader's `index_storage_option:offloaded` leaves the index on disk but then reads
    it anew for every record: 32 random reads of that file take 0.5 s instead of 5 ms.)"""

    fmt = "arrayrecord"
    READER_OPTIONS = "readahead_buffer_size:0"

    def __init__(self, path: str) -> None:
        super().__init__()
        from array_record.python.array_record_module import ArrayRecordReader

        self.path = path
        local = path
        if storage.is_gcs(path):  # the reader takes local files: fetch it once
            local = _local_copy(path)
        try:
            self._reader = ArrayRecordReader(local, self.READER_OPTIONS)
        except Exception as e:  # noqa: BLE001 - the C++ reader raises plain errors
            raise DataError(f"{path}: not a readable ArrayRecord file: {e}") from None
        self._length = int(self._reader.num_records())
        self.columns = list(self.read(0)) if self._length else []

    def __len__(self) -> int:
        return self._length

    def _row(self, i: int, raw: bytes) -> dict[str, Any]:
        self._count(len(raw))
        return _json_object(raw, lambda: self.where(i), "invalid JSON record")

    def read(self, i: int) -> dict[str, Any]:
        return self.read_many([i])[0]

    def read_many(self, indices: list[int]) -> list[dict[str, Any]]:
        raws = self._reader.read([int(i) for i in indices])
        return [self._row(i, raw) for i, raw in zip(indices, raws, strict=True)]


def _local_copy(path: str) -> str:
    """A local copy of a gs:// file under the temporary directory (kept for the run),
    downloaded to disk without passing through memory."""
    import tempfile

    key = hashlib.sha1(path.encode()).hexdigest()[:16]
    local = os.path.join(tempfile.gettempdir(), f"posttrain-{key}-{storage.basename(path)}")
    if not os.path.exists(local):
        tmp = f"{local}.{os.getpid()}.tmp"
        storage.blob(path).download_to_filename(tmp)
        os.replace(tmp, local)
    return local
