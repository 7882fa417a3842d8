"""Run by test_data_processes.py as one host of a multi-process run: joins jax.distributed
from the environment a JobSet pod gets (posttrain.trainer.distributed), builds its data
loader the way the trainer does (data.build_data: the jsonl offset index cached under
output.uri by process 0, the others waiting for it), optionally continues from a saved
position, draws batches and prints RESULT<json>: its process id, the bytes it read for
them, the rows of each batch (packed: the rows of the examples packed into it, in
order), and the position after (packed: every host's window queue, all-gathered).

    python data_host_check.py SPEC_JSON TOKENIZER_DIR STEPS [STATE_JSON]
"""

from __future__ import annotations

import json
import sys

from posttrain.api.spec import PostTrainJobSpec
from posttrain.trainer import data, distributed
from posttrain.trainer.data import build_data


def examples(batch: dict) -> list[int]:
    """The data rows a batch holds: one per row, or, packed, one per packed example."""
    if "example_rows" not in batch:
        return batch["row_index"].tolist()
    seg, origin = batch["segment_ids"], batch["example_rows"]
    return [
        int(origin[r][seg[r] == s][0]) for r in range(len(seg)) for s in range(1, seg[r].max() + 1)
    ]


def main() -> None:
    spec_json, tokenizer_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    process = distributed.process_info()
    distributed.initialize(process)
    spec = PostTrainJobSpec.model_validate(json.loads(spec_json))
    loader, _ = build_data(spec, data.load_tokenizer(tokenizer_dir), process)
    if len(sys.argv) > 4:
        loader.set_state(json.loads(sys.argv[4]))
    records = loader.rows.records
    before = records.bytes_read  # each file's first row, read to learn its columns
    batches = [examples(next(loader)) for _ in range(steps)]
    result = {
        "process": process.process_id,
        "processes": process.num_processes,
        "bytes_read": records.bytes_read - before,
        "batches": batches,
        "state": loader.get_state(),
    }
    print("RESULT" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
