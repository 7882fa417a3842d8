"""The rows a technique trains on, each a ``RowSource`` the ``DataLoader`` batches:
``SftRows`` (tokenized examples padded, or packed several to a row), ``PreferenceRows``
(DPO/ORPO: prompt, chosen, rejected) and ``PromptRows`` (GRPO: prompt and answer);
``build_rows`` picks the one of a PostTrainJobSpec."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from posttrain.trainer.chat_template import ChatTemplate, ChatTemplateError
from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.formatting import as_messages, prompt_messages, render_prompt
from posttrain.trainer.data.reading import RawDataset, read_dataset
from posttrain.trainer.data.tokenizer import Tokenizer
from posttrain.trainer.data.tokenizing import TokenizedExamples, tokenize_sft

Batch = dict[str, np.ndarray]


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
            msgs = prompt_messages(ds.value(i, columns.prompt, "prompt"), where)
            prompt_text = render_prompt(template, msgs, where)
            prompts.append(prompt_text)
            for col, name, out in (
                (columns.chosen, "chosen", chosen),
                (columns.rejected, "rejected", rejected),
            ):
                reply = as_messages(ds.value(i, col, name), "assistant", where, name)
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
            msgs = prompt_messages(ds.value(i, columns.prompt, "prompt"), where)
            self.prompts.append(render_prompt(template, msgs, where))
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
    if getattr(data.columns, "images", None):  # multimodal SFT (Gemma 3 vision)
        from posttrain.trainer.data import image_rows

        return image_rows.rows_from_spec(spec, tokenizer, ds)
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
