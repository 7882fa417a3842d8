"""Weighted mixtures of sources (spec.data.sources): ``MixedRows`` holds each source's
rows and weight; the DataLoader interleaves them with Grain's ``MapDataset.mix``
(deterministic: position k of the mixture is a function of k and the weights).

A mixture's position is kept per source (rows drawn from each, ``mixed_counts``), so a
run may resume with other weights: every source continues where it was, the new
weights decide what comes next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.rows import Rows


class MixedRows:
    """Named sources of rows with weights (the same technique and columns)."""

    def __init__(self, parts: Sequence[tuple[str, Rows, float]]) -> None:
        if not parts:
            raise DataError("spec.data.sources: give at least one source")
        self.names = [name for name, _, _ in parts]
        if len(set(self.names)) != len(self.names):
            raise DataError(
                f"spec.data.sources: names must differ ({', '.join(self.names)}); set name"
            )
        self.parts = [rows for _, rows, _ in parts]
        self.weights = [float(w) for _, _, w in parts]
        self.batcher = self.parts[0].batcher

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def packable(self) -> bool:
        return self.parts[0].packable


def int_proportions(weights: Sequence[float]) -> list[int]:
    """The integer proportions Grain's mix uses for these weights."""
    scale = 100 / min(weights)
    return [int(w * scale) for w in weights]


def mixed_counts(position: int, weights: Sequence[float]) -> list[int]:
    """How many of the first `position` elements of Grain's MapDataset.mix with these
    weights come from each source (its interleaving, counted in closed form)."""
    proportions = int_proportions(weights)
    remaining, current, counts = sum(proportions), position, []
    for p in proportions:
        following = (current * (remaining - p)) // remaining
        counts.append(current - following)
        remaining -= p
        current = following
    return counts


def parts_of(rows: Any) -> tuple[list[Rows], list[str], list[float] | None]:
    """(parts, names, weights): a MixedRows's, or one part without weights."""
    if isinstance(rows, MixedRows):
        return rows.parts, rows.names, rows.weights
    return [rows], ["data"], None


def source_name(uri: str) -> str:
    """A source's default name: its file or directory name without the extension."""
    from posttrain.trainer import storage

    name = storage.basename(str(uri).rstrip("/")) or "data"
    return name.split(".")[0] or name


def open_mixture(
    spec: Any, *, index_dir: str | None = None, process_index: int = 0
) -> tuple[list[tuple[str, Any, float]], list[tuple[str, Any]] | None]:
    """spec.data.sources' (name, training rows, weight), and the held-out (name, rows) of
    spec.eval: each source's own spec.eval.fraction, or spec.eval.source as one."""
    from posttrain.trainer.data.reading import held_out_split, open_records

    data, settings = spec.data, getattr(spec, "eval", None)
    kw = {"index_dir": index_dir, "process_index": process_index}
    train: list[tuple[str, Any, float]] = []
    held: list[tuple[str, Any]] = []
    for k, entry in enumerate(data.sources):
        name = entry.name or source_name(entry.source)
        records = open_records(entry.source, format=data.format, split=data.split, **kw)
        if settings is not None and not settings.source:
            records, held_rows = held_out_split(records, settings.fraction, spec.training.seed + k)
            held.append((name, held_rows))
        train.append((name, records, entry.weight))
    if settings is not None and settings.source:
        held = [
            ("eval", open_records(settings.source, format=data.format, split=settings.split, **kw))
        ]
    return train, (held if settings is not None else None)
