"""The ``DataLoader``: per-host batches of a global batch, epoch after epoch, and its
position (``get_state``/``set_state``) that checkpoints save."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from posttrain.api.batching import batch_split_error
from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.rows import Batch, RowSource, build_rows
from posttrain.trainer.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
