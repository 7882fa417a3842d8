"""Tokenizing SFT rows: each conversation rendered and tokenized, with a loss mask on the
assistant's tokens, stored flat (``TokenizedExamples``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.formatting import render_conversation, sft_conversations
from posttrain.trainer.data.reading import RawDataset
from posttrain.trainer.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
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
            mask = encoding_span_mask(enc, spans[i])
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
