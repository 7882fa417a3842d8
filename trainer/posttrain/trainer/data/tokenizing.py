"""Tokenizing SFT rows when a batch needs them: each conversation rendered and tokenized,
with a loss mask on the assistant's tokens (``SftTokenizer`` -> ``Example``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.formatting import (
    Where,
    render_conversation,
    sft_conversation,
    uses_messages,
)
from posttrain.trainer.data.reading import Row
from posttrain.trainer.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PRETOKENIZED = "input_ids"  # a column of token ids: rows are used as they are
PRETOKENIZED_MASK = "loss_mask"  # its optional loss mask (1: learnt); default all ones


@dataclass
class Example:
    """One tokenized SFT example: int32 token ids and loss mask, and its row."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    row: int  # index of its row in the Records it came from
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, key: str) -> np.ndarray:
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask}[key]


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


def encoding_span_mask(enc: Any, spans: Sequence[tuple[int, int]]) -> np.ndarray:
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


class SftTokenizer:
    """Rows -> Examples, a batch of rows at a time: each rendered through the chat
    template and tokenized (in one encode_batch), with the loss mask on the assistant's
    tokens (every token when completion_only_loss is false). Examples are truncated to
    max_length; one with no loss token left is None (dropped, and counted)."""

    def __init__(
        self,
        records: Any,
        tokenizer: Tokenizer,
        *,
        columns: Any = None,
        max_length: int = 1024,
        completion_only_loss: bool = True,
        chat_template: str | None = None,
    ) -> None:
        from posttrain.api.spec import DataColumns

        self.columns = columns or DataColumns()
        self.tokenizer = tokenizer
        self.pretokenized = records.has(PRETOKENIZED)
        self.template = None if self.pretokenized else tokenizer.template(chat_template)
        self.messages = False if self.pretokenized else uses_messages(records, self.columns)
        self.max_length = max_length
        self.completion_only_loss = completion_only_loss
        self.truncated = 0
        self.dropped = 0
        self.tokens = 0

    def __call__(self, rows: Sequence[Row]) -> list[Example | None]:
        if self.pretokenized:
            return [self._keep(row, *self._given(row)) for row in rows]
        texts: list[str] = []
        spans: list[list[tuple[int, int]]] = []
        add_special = False
        for row in rows:
            conv = sft_conversation(row, self.columns, self.messages)
            text, s, add_special = render_conversation(self.template, conv, Where(row))
            texts.append(text)
            spans.append(s)
        if not texts:
            return []
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=add_special)
        eos = self.tokenizer.eos_id if add_special else None
        out: list[Example | None] = []
        for row, enc, sp in zip(rows, encodings, spans, strict=True):
            ids = np.asarray(enc.ids, dtype=np.int32)
            if self.completion_only_loss:
                mask = encoding_span_mask(enc, sp)
            else:
                mask = np.ones(len(ids), dtype=np.int32)
            if eos is not None:  # plain text: end the completion with EOS
                ids = np.append(ids, np.int32(eos))
                mask = np.append(mask, np.int32(1))
            out.append(self._keep(row, ids, mask))
        return out

    def _given(self, row: Row) -> tuple[np.ndarray, np.ndarray]:
        """A pre-tokenized row's input_ids and loss_mask (all ones when absent)."""
        try:
            ids = np.asarray(row.value(PRETOKENIZED, "input_ids"), dtype=np.int64)
            mask_value = row.values.get(PRETOKENIZED_MASK)
            mask = np.ones(len(ids), np.int64) if mask_value is None else np.asarray(mask_value)
        except (TypeError, ValueError) as e:
            raise DataError(
                f"{row.where}: {PRETOKENIZED} must be a list of token ids: {e}"
            ) from None
        if ids.ndim != 1 or mask.shape != ids.shape:
            raise DataError(
                f"{row.where}: {PRETOKENIZED} must be a list of token ids and "
                f"{PRETOKENIZED_MASK} a list of 0/1 of the same length"
            )
        if len(ids) and (ids.min() < 0 or ids.max() >= self.tokenizer.vocab_size):
            raise DataError(
                f"{row.where}: {PRETOKENIZED} holds ids outside the tokenizer's vocabulary "
                f"(0..{self.tokenizer.vocab_size - 1})"
            )
        if not self.completion_only_loss:
            mask = np.ones(len(ids), np.int64)
        return ids.astype(np.int32), (mask != 0).astype(np.int32)

    def _keep(self, row: Row, ids: np.ndarray, mask: np.ndarray) -> Example | None:
        """The example, truncated to max_length; None (counted) with no loss token."""
        cut = len(ids) > self.max_length
        if cut:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            self.truncated += 1
            if self.truncated in (1, 100, 10_000):
                log.warning(
                    "%s: longer than spec.data.maxLength=%d, truncated (%d so far)",
                    row.where,
                    self.max_length,
                    self.truncated,
                )
        if not mask.any():
            self.dropped += 1
            if self.dropped in (1, 100, 10_000):
                log.warning(
                    "%s: no completion tokens within spec.data.maxLength=%d; skipped (%d so far)",
                    row.where,
                    self.max_length,
                    self.dropped,
                )
            return None
        self.tokens += len(ids)
        return Example(ids, mask, row.index, cut)
