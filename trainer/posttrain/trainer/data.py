"""The trainer's data pipeline: read, format, tokenize, pack, shard and batch.

    read_dataset(data_spec)            jsonl / parquet / `datasets` save_to_disk, local or gs://
      -> tokenize_sft(...)             chat template + tokenizer -> input_ids, loss_mask
      -> SftRows(...)                  padded or packed rows (segment_ids, positions)
      -> DataLoader(rows, ...)         per-host batches of a global batch, deterministic
                                       shuffle by seed and epoch, get_state()/set_state()

`build_loader(spec, tokenizer, ...)` wires these for a PostTrainJobSpec. Preference rows
(DPO) and prompt rows (GRPO) are row sources for the same DataLoader.

Every host reads and tokenizes the whole dataset (once, up front) and takes its own
slice of each global batch, so hosts need no coordination: all of them compute the same
permutation from the seed. Errors a user can cause raise DataError with the file, the
column and the spec field to fix.
"""

from __future__ import annotations

import bisect
import io
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from posttrain.api.batching import batch_split_error
from posttrain.trainer import storage
from posttrain.trainer.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    read_template_file,
    template_from_tokenizer_config,
)

log = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]

JSONL_EXTS = (".jsonl", ".json", ".ndjson")
PARQUET_EXTS = (".parquet", ".pq")
ARROW_EXTS = (".arrow",)


class DataError(ValueError):
    """Bad training data or data settings: the message names the file, column and field."""


# ======================================================================= tokenizer


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) and tok else None


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's special tokens and chat template.

    encode() does not add special tokens unless asked: chat templates write them.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        origin: str = "tokenizer",
    ) -> None:
        self.tokenizer = tokenizer
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.origin = origin
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = self._id(bos_token)
        self.eos_id = self._id(eos_token)
        pad_id = self._id(pad_token)
        self.pad_token = pad_token if pad_id is not None else eos_token
        self.pad_id: int = pad_id if pad_id is not None else (self.eos_id or 0)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[Any]:
        """`tokenizers.Encoding`s (ids, offsets) of many texts, encoded in parallel."""
        return self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def template(self, override: str | None = None) -> ChatTemplate | None:
        """The chat template to use: the file `override` (spec.data.chatTemplate) when
        given, else the tokenizer's own, else None."""
        try:
            if override:
                source, origin = read_template_file(override), override
            elif self.chat_template:
                source, origin = self.chat_template, f"{self.origin}: chat_template"
            else:
                return None
            return ChatTemplate(
                source, bos_token=self.bos_token, eos_token=self.eos_token, origin=origin
            )
        except ChatTemplateError as e:
            raise DataError(str(e)) from e


def load_tokenizer(model_dir: str) -> Tokenizer:
    """Load tokenizer.json, tokenizer_config.json (special tokens, chat_template) and
    chat_template.jinja from a Hugging Face model directory (local or gs://)."""
    from tokenizers import Tokenizer as HFTokenizer

    tok_path = storage.join(model_dir, "tokenizer.json")
    try:
        tok = HFTokenizer.from_str(storage.read_text(tok_path))
    except FileNotFoundError as e:
        raise DataError(
            f"{tok_path}: not found; the model directory (spec.model.source) needs a "
            "Hugging Face tokenizer.json"
        ) from e
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = storage.join(model_dir, name)
        if storage.exists(path):
            config.update(
                {k: v for k, v in json.loads(storage.read_text(path)).items() if v is not None}
            )
    template = template_from_tokenizer_config(config)
    jinja_path = storage.join(model_dir, "chat_template.jinja")
    if template is None and storage.exists(jinja_path):
        template = storage.read_text(jinja_path)
    return Tokenizer(
        tok,
        bos_token=_token_content(config.get("bos_token")),
        eos_token=_token_content(config.get("eos_token")),
        pad_token=_token_content(config.get("pad_token")),
        chat_template=template,
        origin=str(model_dir),
    )


# ========================================================================= reading


@dataclass
class _FilePart:
    path: str
    columns: list[str]
    start: int  # index of its first row in RawDataset.rows
    lines: list[int] | None = None  # jsonl line number of each row


@dataclass
class RawDataset:
    """Rows (dicts) of a dataset and where each came from."""

    source: str
    rows: list[dict[str, Any]]
    parts: list[_FilePart]
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

    def _part(self, i: int) -> _FilePart:
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
    parts: list[_FilePart] = []
    for path, fmt in data_files(source, format=format, split=split):
        if fmt == "jsonl":
            file_rows, lines = _read_jsonl(path)
            columns = list(file_rows[0]) if file_rows else []
            parts.append(_FilePart(path, columns, len(rows), lines))
        else:
            table = _read_table(path, fmt)
            file_rows = table.to_pylist()
            parts.append(_FilePart(path, list(table.column_names), len(rows)))
        rows.extend(file_rows)
    if not rows:
        raise DataError(f"{source}: the dataset is empty (no rows) (spec.data.source)")
    return RawDataset(source=str(source), rows=rows, parts=[p for p in parts if p.columns])


# ====================================================================== formatting


def _as_messages(value: Any, role: str, where: str, field_name: str) -> list[dict[str, Any]]:
    """A string as one message of `role`, or a validated list of {role, content}."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if hasattr(value, "tolist"):  # numpy arrays from some readers
        value = value.tolist()
    if not isinstance(value, list | tuple):
        raise DataError(
            f"{where}: spec.data.columns.{field_name} must be text or a list of "
            f"{{role, content}} messages, got {type(value).__name__}"
        )
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise DataError(
                f"{where}: message {j} of spec.data.columns.{field_name} must be an object "
                f"with 'role' and 'content', got {str(m)[:80]!r}"
            )
        out.append(dict(m))
    return out


def _messages_value(ds: RawDataset, i: int, column: str, field_name: str) -> Any:
    v = ds.value(i, column, field_name)
    if isinstance(v, str) and v.lstrip().startswith("["):  # messages stored as JSON text
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise DataError(f"{ds.where(i)}: column {column!r} is not valid JSON: {e}") from e
    return v


def sft_conversations(ds: RawDataset, columns: Any) -> list[list[dict[str, Any]]]:
    """Each row as a conversation: the messages column when the data has it, else
    prompt/completion as a user turn and an assistant turn."""
    if ds.has(columns.messages):
        ds.require(columns.messages, "messages")
        convs = []
        for i in range(len(ds)):
            msgs = _as_messages(
                _messages_value(ds, i, columns.messages, "messages"),
                "user",
                ds.where(i),
                "messages",
            )
            if not any(m.get("role") == "assistant" for m in msgs):
                raise DataError(
                    f"{ds.where(i)}: column {columns.messages!r} (spec.data.columns.messages)"
                    " has no assistant message to learn"
                )
            convs.append(msgs)
        return convs
    if not ds.has(columns.prompt):
        part = ds.parts[0]
        raise DataError(
            f"{part.path}: column {columns.messages!r} (spec.data.columns.messages) not "
            f"found, nor column {columns.prompt!r} (spec.data.columns.prompt) with "
            f"{columns.completion!r} (spec.data.columns.completion); columns are: "
            f"{', '.join(part.columns) or '(none)'}"
        )
    ds.require(columns.prompt, "prompt")
    ds.require(columns.completion, "completion")
    convs = []
    for i in range(len(ds)):
        where = ds.where(i)
        prompt = _as_messages(ds.value(i, columns.prompt, "prompt"), "user", where, "prompt")
        completion = _as_messages(
            ds.value(i, columns.completion, "completion"), "assistant", where, "completion"
        )
        convs.append(prompt + completion)
    return convs


# ==================================================================== tokenization


@dataclass
class TokenizedExamples:
    """Token ids and loss masks of many examples, stored flat (ragged) for speed."""

    input_ids: np.ndarray  # int32 [total tokens]
    loss_mask: np.ndarray  # int32 [total tokens]
    offsets: np.ndarray  # int64 [n + 1]: example i is [offsets[i], offsets[i+1])
    example_ids: np.ndarray  # int64 [n]: row index in the dataset
    truncated: int = 0  # examples cut to max_length
    dropped: int = 0  # examples left with no loss tokens

    @classmethod
    def from_lists(
        cls,
        ids: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        example_ids: Sequence[int],
        **kw: Any,
    ) -> TokenizedExamples:
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        cat = (lambda xs: np.concatenate(xs).astype(np.int32)) if ids else None
        return cls(
            input_ids=cat(ids) if cat else np.zeros(0, np.int32),
            loss_mask=cat(masks) if cat else np.zeros(0, np.int32),
            offsets=offsets,
            example_ids=np.asarray(example_ids, dtype=np.int64),
            **kw,
        )

    def __len__(self) -> int:
        return len(self.example_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> Batch:
        """Example i as {'input_ids', 'loss_mask'} int32 arrays (views)."""
        a, b = self.offsets[i], self.offsets[i + 1]
        return {"input_ids": self.input_ids[a:b], "loss_mask": self.loss_mask[a:b]}


def _span_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for tokens that hold a character of one of the spans (so a token that straddles
    the prompt/completion boundary, like BPE's " Answer" after "assistant:", is learnt)."""
    if not len(offsets):
        return np.zeros(0, dtype=np.int32)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        mask |= (ends > a) & (starts < b)
    return mask.astype(np.int32)


def _encoding_span_mask(enc: Any, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """_span_mask of an Encoding: from the tokens holding each span's first and last
    character (fast), or from all token offsets when a character maps to no token."""
    mask = np.zeros(len(enc.ids), dtype=np.int32)
    for a, b in spans:
        if b <= a:
            continue
        t0, t1 = enc.char_to_token(a), enc.char_to_token(b - 1)
        if t0 is None or t1 is None:
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            return _span_mask(offsets, spans)
        mask[t0 : t1 + 1] = 1
    return mask


def render_conversation(
    template: ChatTemplate | None, conversation: list[dict[str, Any]], where: str
) -> tuple[str, list[tuple[int, int]], bool]:
    """Text, assistant character spans, and whether the tokenizer should add its own
    special tokens (only without a chat template)."""
    if template is None:
        roles = [m.get("role") for m in conversation]
        if roles != ["user", "assistant"] or not all(
            isinstance(m.get("content"), str) for m in conversation
        ):
            raise DataError(
                f"{where}: the tokenizer has no chat template, so only plain prompt/completion "
                "text can be used; set spec.data.chatTemplate to a Jinja chat template file"
            )
        prompt, completion = conversation[0]["content"], conversation[1]["content"]
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))], True
    try:
        text, spans = template.render_with_spans(conversation)
    except ChatTemplateError as e:
        raise DataError(f"{where}: {e}") from e
    return text, spans, False


def tokenize_sft(
    ds: RawDataset,
    tokenizer: Tokenizer,
    *,
    columns: Any = None,
    max_length: int = 1024,
    completion_only_loss: bool = True,
    chat_template: str | None = None,
) -> TokenizedExamples:
    """Render every row through the chat template and tokenize it (in one batch).

    loss_mask is 1 on assistant tokens (all tokens when completion_only_loss is false).
    Examples are truncated to max_length; ones with no loss token left are dropped.
    """
    from posttrain.api.spec import DataColumns

    columns = columns or DataColumns()
    template = tokenizer.template(chat_template)
    conversations = sft_conversations(ds, columns)
    texts: list[str] = []
    spans: list[list[tuple[int, int]]] = []
    add_special = False
    for i, conv in enumerate(conversations):
        text, s, add_special = render_conversation(template, conv, ds.where(i))
        texts.append(text)
        spans.append(s)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=add_special)
    eos = tokenizer.eos_id if add_special else None
    ids_list, mask_list, keep = [], [], []
    truncated = dropped = 0
    for i, enc in enumerate(encodings):
        ids = np.asarray(enc.ids, dtype=np.int32)
        if completion_only_loss:
            mask = _encoding_span_mask(enc, spans[i])
        else:
            mask = np.ones(len(ids), dtype=np.int32)
        if eos is not None:  # plain text: end the completion with EOS
            ids = np.append(ids, np.int32(eos))
            mask = np.append(mask, np.int32(1))
        if len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
            truncated += 1
        if not mask.any():
            dropped += 1
            continue
        ids_list.append(ids)
        mask_list.append(mask)
        keep.append(i)
    if truncated:
        log.warning(
            "%d of %d examples were longer than spec.data.maxLength=%d and were truncated",
            truncated,
            len(encodings),
            max_length,
        )
    if dropped:
        log.warning(
            "%d examples have no completion tokens within spec.data.maxLength=%d; skipped",
            dropped,
            max_length,
        )
    if not keep:
        raise DataError(
            f"{ds.source}: no example has completion tokens within spec.data.maxLength="
            f"{max_length}; raise maxLength"
        )
    return TokenizedExamples.from_lists(
        ids_list, mask_list, keep, truncated=truncated, dropped=dropped
    )


# ============================================================================ rows


class RowSource(Protocol):
    """What DataLoader batches: a fixed number of rows, built by index."""

    def __len__(self) -> int: ...

    def batch(self, rows: np.ndarray) -> Batch: ...

    def example_ids(self, row: int) -> tuple[int, ...]: ...


def pack_examples(lengths: Sequence[int] | np.ndarray, max_length: int) -> list[list[int]]:
    """Greedily pack examples into rows of at most max_length tokens (best fit,
    longest first). Returns example indices per row; rows come in the order of their
    first example, examples within a row in index order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > max_length:
        raise ValueError(f"an example has {lengths.max()} tokens, more than {max_length}")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, row)
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            cap, r = free.pop(k)
            rows[r].append(int(i))
        else:
            cap, r = max_length, len(rows)
            rows.append([int(i)])
        if cap - n > 0:
            bisect.insort(free, (cap - n, r))
    for row in rows:
        row.sort()
    rows.sort(key=lambda row: row[0])
    return rows


class SftRows:
    """Fixed-length rows of tokenized examples: one example per row padded to
    max_length, or several packed per row.

    A batch holds int32 arrays of shape [b, max_length]: input_ids (pad_id after the
    tokens), loss_mask (0 on padding), segment_ids (1..n per example in the row, 0 on
    padding) and positions (from 0 within each example, 0 on padding).
    """

    def __init__(
        self,
        examples: TokenizedExamples,
        *,
        max_length: int,
        pad_id: int,
        packing: bool = False,
    ) -> None:
        self.examples = examples
        self.max_length = max_length
        self.pad_id = int(pad_id)
        self.packing = packing
        if packing:
            members = pack_examples(examples.lengths, max_length)
        else:
            members = [[i] for i in range(len(examples))]
        self._members = np.fromiter((m for row in members for m in row), dtype=np.int64)
        self._row_offsets = np.zeros(len(members) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in members], out=self._row_offsets[1:])
        self._arange = np.arange(max_length, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._row_offsets) - 1

    def members(self, row: int) -> np.ndarray:
        """Indices (into examples) of the examples in a row."""
        return self._members[self._row_offsets[row] : self._row_offsets[row + 1]]

    def example_ids(self, row: int) -> tuple[int, ...]:
        """Dataset row indices of the examples in a row."""
        return tuple(int(self.examples.example_ids[m]) for m in self.members(row))

    def fill_ratio(self) -> float:
        """Fraction of row tokens that are real tokens (not padding)."""
        return self.examples.num_tokens / max(1, len(self) * self.max_length)

    def batch(self, rows: np.ndarray) -> Batch:
        b, L = len(rows), self.max_length
        ids = np.full((b, L), self.pad_id, dtype=np.int32)
        mask = np.zeros((b, L), dtype=np.int32)
        seg = np.zeros((b, L), dtype=np.int32)
        pos = np.zeros((b, L), dtype=np.int32)
        ex = self.examples
        for r, row in enumerate(rows):
            o = 0
            for s, m in enumerate(self.members(int(row)), 1):
                a, z = ex.offsets[m], ex.offsets[m + 1]
                n = int(z - a)
                ids[r, o : o + n] = ex.input_ids[a:z]
                mask[r, o : o + n] = ex.loss_mask[a:z]
                seg[r, o : o + n] = s
                pos[r, o : o + n] = self._arange[:n]
                o += n
        return {"input_ids": ids, "loss_mask": mask, "segment_ids": seg, "positions": pos}

    def row(self, i: int) -> Batch:
        """Row i as a dict of [max_length] arrays."""
        return {k: v[0] for k, v in self.batch(np.array([i])).items()}


def _prompt_messages(value: Any, where: str) -> list[dict[str, Any]]:
    return _as_messages(value, "user", where, "prompt")


def _render_prompt(
    template: ChatTemplate | None, messages: list[dict[str, Any]], where: str
) -> str:
    if template is None:
        if len(messages) != 1 or not isinstance(messages[0]["content"], str):
            raise DataError(
                f"{where}: the tokenizer has no chat template, so prompts must be plain "
                "text; set spec.data.chatTemplate"
            )
        return messages[0]["content"]
    try:
        return template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise DataError(f"{where}: {e}") from e


def _left_pad(seqs: Sequence[Sequence[int]], length: int, pad: int) -> tuple[np.ndarray, ...]:
    ids = np.full((len(seqs), length), pad, dtype=np.int32)
    mask = np.zeros((len(seqs), length), dtype=np.int32)
    for r, s in enumerate(seqs):
        s = list(s)[-length:]
        if s:
            ids[r, length - len(s) :] = s
            mask[r, length - len(s) :] = 1
    return ids, mask


def _right_pad(seqs: Sequence[Sequence[int]], length: int, pad: int) -> tuple[np.ndarray, ...]:
    ids = np.full((len(seqs), length), pad, dtype=np.int32)
    mask = np.zeros((len(seqs), length), dtype=np.int32)
    for r, s in enumerate(seqs):
        s = list(s)[:length]
        ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    return ids, mask


class PreferenceRows:
    """DPO/ORPO rows from prompt, chosen and rejected columns (text or messages).

    A batch matches tunix's DPO TrainingInput: prompt_ids/prompt_mask [b, P] left-padded
    (prompts keep their last P tokens), chosen_ids/chosen_mask and
    rejected_ids/rejected_mask [b, C] right-padded (completions keep their first C
    tokens), all int32.
    """

    def __init__(
        self,
        ds: RawDataset,
        tokenizer: Tokenizer,
        *,
        columns: Any = None,
        max_prompt_length: int = 512,
        max_completion_length: int = 512,
        chat_template: str | None = None,
    ) -> None:
        from posttrain.api.spec import DataColumns

        columns = columns or DataColumns()
        for col, name in (
            (columns.prompt, "prompt"),
            (columns.chosen, "chosen"),
            (columns.rejected, "rejected"),
        ):
            ds.require(col, name)
        self.max_prompt_length = max_prompt_length
        self.max_completion_length = max_completion_length
        self.pad_id = tokenizer.pad_id
        template = tokenizer.template(chat_template)
        prompts, chosen, rejected = [], [], []
        for i in range(len(ds)):
            where = ds.where(i)
            msgs = _prompt_messages(ds.value(i, columns.prompt, "prompt"), where)
            prompt_text = _render_prompt(template, msgs, where)
            prompts.append(prompt_text)
            for col, name, out in (
                (columns.chosen, "chosen", chosen),
                (columns.rejected, "rejected", rejected),
            ):
                reply = _as_messages(ds.value(i, col, name), "assistant", where, name)
                out.append(self._completion(template, tokenizer, msgs, reply, prompt_text, where))
        enc = tokenizer.encode_batch
        self.prompt_ids = [e.ids for e in enc(prompts)]
        self.chosen_ids = [e.ids for e in enc(chosen)]
        self.rejected_ids = [e.ids for e in enc(rejected)]
        if template is None and tokenizer.eos_id is not None:
            for seqs in (self.chosen_ids, self.rejected_ids):
                for s in seqs:
                    s.append(tokenizer.eos_id)
        self._example_ids = list(range(len(ds)))

    @staticmethod
    def _completion(
        template: ChatTemplate | None,
        tokenizer: Tokenizer,
        prompt: list[dict[str, Any]],
        reply: list[dict[str, Any]],
        prompt_text: str,
        where: str,
    ) -> str:
        if template is None:
            return "".join(str(m["content"]) for m in reply)
        try:
            full = template.render(prompt + reply)
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from e
        if not full.startswith(prompt_text):
            raise DataError(
                f"{where}: the chat template renders the prompt differently when a reply "
                "follows, so chosen/rejected cannot be split from it"
            )
        return full[len(prompt_text) :]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def example_ids(self, row: int) -> tuple[int, ...]:
        return (self._example_ids[row],)

    def batch(self, rows: np.ndarray) -> Batch:
        P, C, pad = self.max_prompt_length, self.max_completion_length, self.pad_id
        p_ids, p_mask = _left_pad([self.prompt_ids[r] for r in rows], P, pad)
        c_ids, c_mask = _right_pad([self.chosen_ids[r] for r in rows], C, pad)
        r_ids, r_mask = _right_pad([self.rejected_ids[r] for r in rows], C, pad)
        return {
            "prompt_ids": p_ids,
            "prompt_mask": p_mask,
            "chosen_ids": c_ids,
            "chosen_mask": c_mask,
            "rejected_ids": r_ids,
            "rejected_mask": r_mask,
        }


class PromptRows:
    """GRPO rows: the prompt rendered with the generation prompt, and its answer.

    A batch has 'prompts' and 'answer' as object arrays of str [b] (tunix's GRPO learner
    samples from the prompt text; rewards read the answer column).
    """

    def __init__(
        self,
        ds: RawDataset,
        tokenizer: Tokenizer,
        *,
        columns: Any = None,
        chat_template: str | None = None,
    ) -> None:
        from posttrain.api.spec import DataColumns

        columns = columns or DataColumns()
        ds.require(columns.prompt, "prompt")
        ds.require(columns.answer, "answer")
        template = tokenizer.template(chat_template)
        self.prompts: list[str] = []
        self.answers: list[str] = []
        for i in range(len(ds)):
            where = ds.where(i)
            msgs = _prompt_messages(ds.value(i, columns.prompt, "prompt"), where)
            self.prompts.append(_render_prompt(template, msgs, where))
            self.answers.append(str(ds.value(i, columns.answer, "answer")))

    def __len__(self) -> int:
        return len(self.prompts)

    def example_ids(self, row: int) -> tuple[int, ...]:
        return (int(row),)

    def batch(self, rows: np.ndarray) -> Batch:
        prompts = np.empty(len(rows), dtype=object)
        answers = np.empty(len(rows), dtype=object)
        for j, r in enumerate(rows):
            prompts[j] = self.prompts[r]
            answers[j] = self.answers[r]
        return {"prompts": prompts, "answer": answers}


# ========================================================================== loader


@dataclass
class _Position:
    epoch: int = 0
    index: int = 0  # rows of this epoch's permutation already consumed (all hosts)


@dataclass
class DataLoader:
    """Per-host batches of a global batch, forever (epoch after epoch).

    Each step takes the next batch_size rows of the epoch's permutation (drawn from
    numpy's default_rng(seed + epoch) when shuffling); host p gets the p-th contiguous
    slice of batch_size // process_count of them, so the hosts of one step hold
    different rows and no row is used by two hosts in an epoch. The rows left over at
    the end of an epoch (fewer than batch_size) are skipped; the next epoch reshuffles.

    Every batch also carries 'row_index' int32 [b], the rows it holds.
    get_state()/set_state() save and restore the position (JSON-serialisable and the
    same on every host).
    """

    rows: RowSource
    batch_size: int
    process_index: int = 0
    process_count: int = 1
    seed: int = 0
    shuffle: bool = True
    gradient_accumulation: int = 1
    _pos: _Position = field(default_factory=_Position, init=False, repr=False)
    _perm_cache: tuple[int, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        B, P = self.batch_size, self.process_count
        if not 0 <= self.process_index < P:
            raise ValueError(f"process_index {self.process_index} not in [0, {P})")
        if B < 1:
            raise DataError(f"spec.training.batchSize ({B}) must be at least 1")
        if problem := batch_split_error(B, self.gradient_accumulation, P):
            raise DataError(problem)
        if len(self.rows) < B:
            raise DataError(
                f"the dataset has {len(self.rows)} rows (after packing), fewer than "
                f"spec.training.batchSize ({B}); use more data or a smaller batchSize"
            )

    @property
    def per_host_batch_size(self) -> int:
        return self.batch_size // self.process_count

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of all rows used in an epoch (the same on every host)."""
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        n = len(self.rows)
        if self.shuffle:
            order = np.random.default_rng(self.seed + epoch).permutation(n)
        else:
            order = np.arange(n)
        self._perm_cache = (epoch, order)
        return order

    def host_rows(self, epoch: int, index: int) -> np.ndarray:
        """Rows this host takes for the global batch starting at `index` of the epoch."""
        b = self.per_host_batch_size
        start = index + self.process_index * b
        return self.epoch_order(epoch)[start : start + b]

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        pos = self._pos
        if pos.index + self.batch_size > len(self.rows):
            pos.epoch, pos.index = pos.epoch + 1, 0
        rows = self.host_rows(pos.epoch, pos.index)
        batch = self.rows.batch(rows)
        batch["row_index"] = rows.astype(np.int32)
        pos.index += self.batch_size
        return batch

    def take(self, steps: int) -> Iterator[Batch]:
        """The next `steps` batches."""
        for _ in range(steps):
            yield next(self)

    def get_state(self) -> dict[str, int]:
        """The position of the next batch: {'epoch', 'index', 'num_rows'}."""
        return {"epoch": self._pos.epoch, "index": self._pos.index, "num_rows": len(self.rows)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a position returned by get_state() (on any host)."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a data loader state: {state!r}") from e
        if epoch < 0 or index < 0:
            raise ValueError(f"not a data loader state: {state!r}")
        rows_then = state.get("num_rows")
        if rows_then is not None and int(rows_then) != len(self.rows):
            log.warning(
                "the data has %d rows but the checkpoint was taken with %d: the data "
                "changed, so training cannot resume at the same examples",
                len(self.rows),
                rows_then,
            )
        self._pos = _Position(epoch, index)


# ========================================================================== wiring


def build_rows(spec: Any, tokenizer: Tokenizer, ds: RawDataset | None = None) -> RowSource:
    """The row source for a PostTrainJobSpec's technique and data settings."""
    data = spec.data
    ds = ds if ds is not None else read_dataset(data.source, format=data.format, split=data.split)
    technique = str(spec.technique)
    if technique == "dpo":
        max_prompt = getattr(spec.dpo, "max_prompt_length", 512) if spec.dpo else 512
        max_prompt = min(max_prompt, data.max_length // 2)
        return PreferenceRows(
            ds,
            tokenizer,
            columns=data.columns,
            max_prompt_length=max_prompt,
            max_completion_length=data.max_length - max_prompt,
            chat_template=data.chat_template,
        )
    if technique == "grpo":
        return PromptRows(ds, tokenizer, columns=data.columns, chat_template=data.chat_template)
    examples = tokenize_sft(
        ds,
        tokenizer,
        columns=data.columns,
        max_length=data.max_length,
        completion_only_loss=data.completion_only_loss,
        chat_template=data.chat_template,
    )
    return SftRows(
        examples, max_length=data.max_length, pad_id=tokenizer.pad_id, packing=data.packing
    )


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


def generation_prompts(spec: Any, tokenizer: Tokenizer, ds: RawDataset, n: int) -> list[str]:
    """The first n rows' prompts, rendered with the generation prompt: the conversation
    before its last assistant turn (sft, distill) or the prompt column (dpo, grpo)."""
    columns, template = spec.data.columns, tokenizer.template(spec.data.chat_template)
    first = ds.subset(range(min(n, len(ds))))
    if str(spec.technique) in ("dpo", "grpo"):
        first.require(columns.prompt, "prompt")
        messages = [
            _prompt_messages(first.value(i, columns.prompt, "prompt"), first.where(i))
            for i in range(len(first))
        ]
    else:
        messages = []
        for conv in sft_conversations(first, columns):
            last = max(i for i, m in enumerate(conv) if m.get("role") == "assistant")
            messages.append(conv[:last])
    return [_render_prompt(template, m, first.where(i)) for i, m in enumerate(messages)]


def build_loader(
    spec: Any,
    tokenizer: Tokenizer,
    *,
    process_index: int = 0,
    process_count: int = 1,
    rows: RowSource | None = None,
) -> DataLoader:
    """A DataLoader for a PostTrainJobSpec on host process_index of process_count."""
    rows = rows if rows is not None else build_rows(spec, tokenizer)
    return DataLoader(
        rows,
        batch_size=spec.training.batch_size,
        process_index=process_index,
        process_count=process_count,
        seed=spec.training.seed,
        shuffle=spec.data.shuffle,
        gradient_accumulation=spec.training.gradient_accumulation,
    )


def data_summary(rows: RowSource) -> dict[str, Any]:
    """Numbers worth logging once: rows, examples, tokens, fill ratio."""
    out: dict[str, Any] = {"rows": len(rows)}
    if isinstance(rows, SftRows):
        out.update(
            examples=len(rows.examples),
            tokens=rows.examples.num_tokens,
            loss_tokens=int(rows.examples.loss_mask.sum()),
            truncated=rows.examples.truncated,
            fill_ratio=round(rows.fill_ratio(), 4),
        )
    return out


__all__ = [
    "Batch",
    "DataError",
    "DataLoader",
    "PreferenceRows",
    "PromptRows",
    "RawDataset",
    "RowSource",
    "SftRows",
    "TokenizedExamples",
    "Tokenizer",
    "build_loader",
    "build_rows",
    "data_files",
    "data_summary",
    "generation_prompts",
    "held_out_split",
    "load_tokenizer",
    "pack_examples",
    "read_dataset",
    "read_train_and_eval",
    "render_conversation",
    "sft_conversations",
    "tokenize_sft",
]
