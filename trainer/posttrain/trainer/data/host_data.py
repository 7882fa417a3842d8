"""This host's data for a job: its training loader and the held-out rows, built the
same way by every process of the job (what the training loop and the multi-process data
tests call)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from posttrain.trainer import storage
from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.loader import DataLoader, build_loader, row_count_error
from posttrain.trainer.data.mixing import MixedRows, open_mixture
from posttrain.trainer.data.reading import open_train_and_eval
from posttrain.trainer.data.rows import build_rows
from posttrain.trainer.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from posttrain.trainer.distributed import ProcessInfo

log = logging.getLogger("posttrain.trainer")
DATA_INDEX = "data-index"  # under output.uri: cached offset indexes of jsonl data


def check_row_count(spec: Any, process: ProcessInfo) -> None:
    """Before the model loads: a dataset with fewer training rows than one step takes
    (unpacked, one source) is refused now, with the DataError the loader would raise
    once everything had loaded. Opening the rows reads only what finds them (a jsonl
    file's offset index is built once and cached for build_data)."""
    if spec.data.sources or spec.data.packing:
        return
    where = {"index_dir": storage.join(spec.output.uri, DATA_INDEX)}
    train_rows, _ = open_train_and_eval(spec, **where, process_index=process.process_id)
    if len(train_rows) < spec.training.batch_size:
        raise DataError(row_count_error(len(train_rows), spec.training.batch_size))


def build_data(spec: Any, tokenizer: Tokenizer, process: ProcessInfo) -> tuple[DataLoader, Any]:
    """This host's training loader, and the held-out rows of spec.eval (or None; per
    source for a mixture). Nothing is read but what finds the rows; jsonl offset indexes
    are cached under output.uri/data-index (built by process 0)."""
    where = {"index_dir": storage.join(spec.output.uri, DATA_INDEX)}
    where["process_index"] = process.process_id
    if spec.data.sources:  # a weighted mixture
        parts, held_out = open_mixture(spec, **where)
        rows: Any = MixedRows([(name, build_rows(spec, tokenizer, r), w) for name, r, w in parts])
    else:
        train_rows, held_out = open_train_and_eval(spec, **where)
        rows = build_rows(spec, tokenizer, train_rows)
    loader = build_loader(
        spec,
        tokenizer,
        process_index=process.process_id,
        process_count=process.num_processes,
        rows=rows,
    )
    log.info(
        "data: %d rows, %d per host a step%s",
        len(rows),
        loader.per_host_batch_size,
        ", packed" if loader.packing else "",
    )
    return loader, held_out
