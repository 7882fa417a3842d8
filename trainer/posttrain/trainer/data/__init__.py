"""The trainer's data pipeline: streamed on Grain, read and tokenized as batches need it.

    open_records(source)               reading + record_files: random-access rows of
                                       jsonl / json / parquet / arrow / ArrayRecord files,
                                       local or gs:// (a jsonl byte-offset index, cached)
      -> build_rows(spec, tokenizer)   rows: the technique's batcher (formatting +
                                       tokenizing: chat template, loss mask; padding)
      -> DataLoader(rows, ...)         loader: a Grain index dataset (Feistel shuffle per
                                       epoch), this host's rows of each global batch,
                                       streaming packing in bounded windows,
                                       get_state()/set_state()

`build_loader(spec, tokenizer, ...)` wires these for a PostTrainJobSpec;
`build_data(spec, tokenizer, process)` (host_data) is what each process of a job builds:
its loader and the held-out rows. Each host reads
only the rows it trains on; all hosts agree on the order because it is a function of the
seed. Errors a user can cause raise DataError with the file, the row, the column and the
spec field to fix, when the row is reached.
"""

from __future__ import annotations

from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.formatting import (
    generation_prompts,
    render_conversation,
    sft_conversation,
    uses_messages,
)
from posttrain.trainer.data.host_data import DATA_INDEX, build_data
from posttrain.trainer.data.loader import DataLoader, build_loader
from posttrain.trainer.data.mixing import MixedRows, mixed_counts, open_mixture
from posttrain.trainer.data.reading import (
    Records,
    RecordsView,
    Row,
    data_files,
    held_out_split,
    open_records,
    open_train_and_eval,
)
from posttrain.trainer.data.rows import (
    Batch,
    PreferenceBatcher,
    PromptBatcher,
    Rows,
    SftBatcher,
    build_rows,
    pack_examples,
)
from posttrain.trainer.data.tokenizer import Tokenizer, load_tokenizer
from posttrain.trainer.data.tokenizing import Example, SftTokenizer, encoding_span_mask

__all__ = [
    "DATA_INDEX",
    "Batch",
    "DataError",
    "DataLoader",
    "Example",
    "MixedRows",
    "PreferenceBatcher",
    "PromptBatcher",
    "Records",
    "RecordsView",
    "Row",
    "Rows",
    "SftBatcher",
    "SftTokenizer",
    "Tokenizer",
    "build_data",
    "build_loader",
    "build_rows",
    "data_files",
    "encoding_span_mask",
    "generation_prompts",
    "held_out_split",
    "load_tokenizer",
    "mixed_counts",
    "open_mixture",
    "open_records",
    "open_train_and_eval",
    "pack_examples",
    "render_conversation",
    "sft_conversation",
    "uses_messages",
]
