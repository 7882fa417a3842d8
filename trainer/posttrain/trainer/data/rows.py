"""The rows a technique trains on (``Rows``: records and a batcher that turns rows into a
batch when it is needed): ``SftBatcher`` (tokenized examples padded, or packed several to
a row), ``PreferenceBatcher`` (DPO/ORPO: prompt, chosen, rejected) and ``PromptBatcher``
(GRPO: prompt and answer); ``build_rows`` picks the one of a PostTrainJobSpec."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from posttrain.trainer.chat_template import ChatTemplate, ChatTemplateError
from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.formatting import Where, as_messages, prompt_messages, render_prompt
from posttrain.trainer.data.reading import Row, open_records
from posttrain.trainer.data.tokenizer import Tokenizer
from posttrain.trainer.data.tokenizing import Example, SftTokenizer

Batch = dict[str, np.ndarray]


class Batcher(Protocol):
    """Rows -> a host batch of fixed-shape numpy arrays."""

    def batch(self, rows: Sequence[Row]) -> Batch: ...


class Rows:
    """A technique's rows: Records (read by index when a batch needs them) and the
    batcher that formats and tokenizes them. ``batch(indices)`` builds one batch;
    the DataLoader draws indices (shuffled, sharded by host) and packs SFT examples."""

    def __init__(self, records: Any, batcher: Any) -> None:
        self.records = records
        self.batcher = batcher

    def __len__(self) -> int:
        return len(self.records)

    @property
    def packable(self) -> bool:
        return isinstance(self.batcher, SftBatcher)

    def read(self, indices: Sequence[int] | np.ndarray) -> list[Row]:
        return self.records.read_many([int(i) for i in indices])

    def batch(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The batch of these rows (row i of the batch is row indices[i])."""
        return self.batcher.batch(self.read(indices))


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


class SftBatcher:
    """Fixed-length rows of tokenized examples: one example per row padded to
    max_length (`batch`), or several packed per row (`packed`).

    A batch holds int32 arrays of shape [b, max_length]: input_ids (pad_id after the
    tokens), loss_mask (0 on padding), segment_ids (1..n per example in the row, 0 on
    padding) and positions (from 0 within each example, 0 on padding); and
    example_rows int32 [b, max_length], the row index of each token's example (-1 on
    padding). An example dropped for having no loss token is a row of padding.
    """

    def __init__(self, tokenize: SftTokenizer, *, max_length: int, pad_id: int) -> None:
        self.tokenize = tokenize
        self.max_length = max_length
        self.pad_id = int(pad_id)
        self._arange = np.arange(max_length, dtype=np.int32)

    pads_missing_rows = True  # a None row (skipped as malformed) is a row of padding

    def batch(self, rows: Sequence[Row | None]) -> Batch:
        examples = iter(self.tokenize([r for r in rows if r is not None]))
        members = [[] if r is None else [e] if (e := next(examples)) else [] for r in rows]
        return self.packed(members)

    def packed(self, members: Sequence[Sequence[Example]]) -> Batch:
        """A batch with row r holding the examples members[r], in order."""
        b, L = len(members), self.max_length
        ids = np.full((b, L), self.pad_id, dtype=np.int32)
        mask = np.zeros((b, L), dtype=np.int32)
        seg = np.zeros((b, L), dtype=np.int32)
        pos = np.zeros((b, L), dtype=np.int32)
        origin = np.full((b, L), -1, dtype=np.int32)
        for r, row in enumerate(members):
            o = 0
            for s, ex in enumerate(row, 1):
                n = len(ex.input_ids)
                ids[r, o : o + n] = ex.input_ids
                mask[r, o : o + n] = ex.loss_mask
                seg[r, o : o + n] = s
                pos[r, o : o + n] = self._arange[:n]
                origin[r, o : o + n] = ex.row
                o += n
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "segment_ids": seg,
            "positions": pos,
            "example_rows": origin,
        }


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


class PreferenceBatcher:
    """DPO/ORPO rows from prompt, chosen and rejected columns (text or messages).

    A batch matches tunix's DPO TrainingInput: prompt_ids/prompt_mask [b, P] left-padded
    (prompts keep their last P tokens), chosen_ids/chosen_mask and
    rejected_ids/rejected_mask [b, C] right-padded (completions keep their first C
    tokens), all int32.
    """

    def __init__(
        self,
        records: Any,
        tokenizer: Tokenizer,
        *,
        columns: Any = None,
        max_prompt_length: int = 512,
        max_completion_length: int = 512,
        chat_template: str | None = None,
    ) -> None:
        from posttrain.api.spec import DataColumns

        self.columns = columns = columns or DataColumns()
        for col, name in (
            (columns.prompt, "prompt"),
            (columns.chosen, "chosen"),
            (columns.rejected, "rejected"),
        ):
            records.require(col, name)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.max_completion_length = max_completion_length
        self.pad_id = tokenizer.pad_id
        self.template = tokenizer.template(chat_template)

    def batch(self, rows: Sequence[Row]) -> Batch:
        columns, template, tokenizer = self.columns, self.template, self.tokenizer
        prompts, chosen, rejected = [], [], []
        for row in rows:
            where = Where(row)
            msgs = prompt_messages(row.value(columns.prompt, "prompt"), where)
            prompt_text = render_prompt(template, msgs, where)
            prompts.append(prompt_text)
            for col, name, out in (
                (columns.chosen, "chosen", chosen),
                (columns.rejected, "rejected", rejected),
            ):
                reply = as_messages(row.value(col, name), "assistant", where, name)
                out.append(self._completion(template, msgs, reply, prompt_text, where))
        enc = tokenizer.encode_batch
        prompt_ids = [e.ids for e in enc(prompts)]
        chosen_ids = [e.ids for e in enc(chosen)]
        rejected_ids = [e.ids for e in enc(rejected)]
        if template is None and tokenizer.eos_id is not None:
            for seqs in (chosen_ids, rejected_ids):
                for s in seqs:
                    s.append(tokenizer.eos_id)
        P, C, pad = self.max_prompt_length, self.max_completion_length, self.pad_id
        p_ids, p_mask = _left_pad(prompt_ids, P, pad)
        c_ids, c_mask = _right_pad(chosen_ids, C, pad)
        r_ids, r_mask = _right_pad(rejected_ids, C, pad)
        return {
            "prompt_ids": p_ids,
            "prompt_mask": p_mask,
            "chosen_ids": c_ids,
            "chosen_mask": c_mask,
            "rejected_ids": r_ids,
            "rejected_mask": r_mask,
        }

    @staticmethod
    def _completion(
        template: ChatTemplate | None,
        prompt: list[dict[str, Any]],
        reply: list[dict[str, Any]],
        prompt_text: str,
        where: Any,
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


class PromptBatcher:
    """GRPO rows: the prompt rendered with the generation prompt, and its answer.

    A batch has 'prompts' and 'answer' as object arrays of str [b] (tunix's GRPO learner
    samples from the prompt text; rewards read the answer column).
    """

    def __init__(
        self,
        records: Any,
        tokenizer: Tokenizer,
        *,
        columns: Any = None,
        chat_template: str | None = None,
    ) -> None:
        from posttrain.api.spec import DataColumns

        self.columns = columns = columns or DataColumns()
        records.require(columns.prompt, "prompt")
        records.require(columns.answer, "answer")
        self.template = tokenizer.template(chat_template)

    def batch(self, rows: Sequence[Row]) -> Batch:
        prompts = np.empty(len(rows), dtype=object)
        answers = np.empty(len(rows), dtype=object)
        for j, row in enumerate(rows):
            where = Where(row)
            msgs = prompt_messages(row.value(self.columns.prompt, "prompt"), where)
            prompts[j] = render_prompt(self.template, msgs, where)
            answers[j] = str(row.value(self.columns.answer, "answer"))
        return {"prompts": prompts, "answer": answers}


def build_rows(spec: Any, tokenizer: Tokenizer, records: Any = None) -> Rows:
    """The rows for a PostTrainJobSpec's technique and data settings (over spec.data's
    records unless given)."""
    data = spec.data
    if records is None:
        records = open_records(data.source, format=data.format, split=data.split)
    technique = str(spec.technique)
    if technique == "dpo":
        max_prompt = getattr(spec.dpo, "max_prompt_length", 512) if spec.dpo else 512
        max_prompt = min(max_prompt, data.max_length // 2)
        return Rows(
            records,
            PreferenceBatcher(
                records,
                tokenizer,
                columns=data.columns,
                max_prompt_length=max_prompt,
                max_completion_length=data.max_length - max_prompt,
                chat_template=data.chat_template,
            ),
        )
    if technique == "grpo":
        return Rows(
            records,
            PromptBatcher(
                records, tokenizer, columns=data.columns, chat_template=data.chat_template
            ),
        )
    if getattr(data.columns, "images", None):  # multimodal SFT (Gemma 3 vision)
        from posttrain.trainer.data import image_rows

        return Rows(records, image_rows.batcher_from_spec(spec, tokenizer, records))
    tokenize = SftTokenizer(
        records,
        tokenizer,
        columns=data.columns,
        max_length=data.max_length,
        completion_only_loss=data.completion_only_loss,
        chat_template=data.chat_template,
    )
    return Rows(records, SftBatcher(tokenize, max_length=data.max_length, pad_id=tokenizer.pad_id))
