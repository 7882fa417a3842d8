"""The trainer's data pipeline: read, format, tokenize, pack, shard and batch.

    read_dataset(data_spec)            reading: jsonl / parquet / `datasets` save_to_disk,
                                       local or gs://
      -> tokenize_sft(...)             formatting + tokenizing: chat template + tokenizer
                                       -> input_ids, loss_mask
      -> SftRows(...)                  rows: padded or packed rows (segment_ids, positions)
      -> DataLoader(rows, ...)         loader: per-host batches of a global batch,
                                       deterministic shuffle by seed and epoch,
                                       get_state()/set_state()

`build_loader(spec, tokenizer, ...)` wires these for a PostTrainJobSpec. Preference rows
(DPO) and prompt rows (GRPO) are row sources for the same DataLoader. The tokenizer and
its chat template: `tokenizer`.

Every host reads and tokenizes the whole dataset (once, up front) and takes its own
slice of each global batch, so hosts need no coordination: all of them compute the same
permutation from the seed. Errors a user can cause raise DataError with the file, the
column and the spec field to fix.
"""

from __future__ import annotations

from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.formatting import (
    generation_prompts,
    render_conversation,
    sft_conversations,
)
from posttrain.trainer.data.loader import DataLoader, build_loader
from posttrain.trainer.data.reading import (
    FilePart,
    RawDataset,
    data_files,
    held_out_split,
    read_dataset,
    read_train_and_eval,
)
from posttrain.trainer.data.rows import (
    Batch,
    PreferenceRows,
    PromptRows,
    RowSource,
    SftRows,
    build_rows,
    data_summary,
    pack_examples,
)
from posttrain.trainer.data.tokenizer import Tokenizer, load_tokenizer
from posttrain.trainer.data.tokenizing import (
    TokenizedExamples,
    encoding_span_mask,
    tokenize_sft,
)

__all__ = [
    "Batch",
    "DataError",
    "DataLoader",
    "FilePart",
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
    "encoding_span_mask",
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
