"""How a step's batch splits over hosts, devices and micro-batches: one rule, checked
at admission (from the catalog's host and device counts) and by the trainer (from the
processes and devices it finds)."""

from __future__ import annotations


def batch_split_error(
    batch_size: int,
    accumulation: int,
    hosts: int,
    devices: int | None = None,
    rows_per_example: int = 1,
) -> str | None:
    """Why spec.training.batchSize cannot be split, or None.

    Each host reads batchSize / hosts examples per step, in `accumulation` micro-batches;
    with several hosts, the rows of a step (examples x rows_per_example, e.g. GRPO's
    generations) are sharded over every device, so they must divide by `devices`.
    """
    if batch_size % hosts:
        return (
            f"spec.training.batchSize ({batch_size}) must be a multiple of the number of "
            f"hosts ({hosts}), so that every host gets the same number of rows per step"
        )
    if (batch_size // hosts) % accumulation:
        return (
            f"the per-host batch (spec.training.batchSize {batch_size} / {hosts} hosts = "
            f"{batch_size // hosts}) must be a multiple of spec.training.gradientAccumulation "
            f"({accumulation})"
        )
    rows = batch_size * rows_per_example
    if devices and hosts > 1 and rows % devices:
        return (
            f"spec.training.batchSize: {rows} rows per step do not split over the {devices} "
            f"devices of {hosts} hosts; use a multiple of {devices}"
        )
    return None
