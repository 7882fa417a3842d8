"""What each host of a multi-host run reads, and resuming on another number of hosts.

A run of P hosts is P DataLoaders with process_index 0..P-1, each over its own Records
(so each counts its own bytes), exactly what each host process builds; the packed
position is gathered the way get_state gathers it across processes."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from posttrain.trainer.data import (
    DataError,
    DataLoader,
    Rows,
    SftBatcher,
    SftTokenizer,
    open_records,
)
from tests.trainer.data_helpers import make_tokenizer_dir, remaining
from tests.trainer.data_host_check import examples

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "red",
    "birds",
    "sing",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from posttrain.trainer.data import load_tokenizer

    return load_tokenizer(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """400 chat rows of varied length (20-200 bytes of text each)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    lines = []
    for i in range(400):
        reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Question {i}?"},
                        {"role": "assistant", "content": reply},
                    ]
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def host_rows(path: Path, tok, index_dir: Path, max_length: int = 128) -> Rows:
    records = open_records(str(path), index_dir=str(index_dir))
    tokenize = SftTokenizer(records, tok, max_length=max_length)
    return Rows(records, SftBatcher(tokenize, max_length=max_length, pad_id=tok.pad_id))


def test_each_of_four_hosts_reads_a_quarter_of_the_bytes(chats, tok, tmp_path):
    total = chats.stat().st_size
    index_dir = tmp_path / "index"
    host_rows(chats, tok, index_dir)  # process 0 builds the offset index once
    assert len(list(index_dir.iterdir())) == 1
    read = []
    for p in range(4):
        rows = host_rows(chats, tok, index_dir)  # the other hosts only load it
        before = rows.records.bytes_read  # the first row, read to learn the columns
        loader = DataLoader(rows, batch_size=16, process_index=p, process_count=4, threads=0)
        for _ in range(400 // 16):  # one epoch
            next(loader)
        read.append(rows.records.bytes_read - before)
    assert sum(read) == total  # together: every row once
    for p in range(4):
        assert abs(read[p] - total / 4) <= 0.15 * total / 4, (p, read, total)


def run_hosts(rows: Rows, hosts: int, steps: int, state=None):
    """`steps` steps of `hosts` packed loaders from `state`: (example rows each emitted,
    the loaders, the state after)."""
    loaders: list[DataLoader] = []

    def gather(_):
        return [ld.host_state() for ld in loaders]

    for p in range(hosts):
        ld = DataLoader(
            rows, batch_size=4, process_index=p, process_count=hosts, seed=1, packing=True,
            window=8, threads=0, gather=gather,
        )  # fmt: skip
        if state is not None:
            ld.set_state(json.loads(json.dumps(state)))
        loaders.append(ld)
    emitted = [i for _ in range(steps) for ld in loaders for i in examples(next(ld))]
    return emitted, loaders, loaders[0].get_state()


@pytest.mark.parametrize(("before", "after"), [(2, 4), (4, 2)])
def test_packed_resume_on_another_host_count_repeats_and_skips_nothing(
    chats, tok, tmp_path, before, after
):
    rows = host_rows(chats, tok, tmp_path / "index")
    first, _, state = run_hosts(rows, before, 3)
    second, loaders, final = run_hosts(rows, after, 5, state)
    consumed = first + second
    assert len(consumed) == len(set(consumed)) and len(consumed) < len(rows)  # one epoch
    left, frontier = remaining(loaders[0], final)
    assert not set(left) & set(consumed)
    window_rows = loaders[0].epoch_order(0)[: frontier * 8]
    assert sorted(consumed + left) == sorted(window_rows.tolist())  # nothing skipped
    # and the same host count continues exactly where it stopped
    again, _, _ = run_hosts(rows, after, 2, final)
    more, _, _ = run_hosts(rows, after, 7, state)
    assert more[len(second) :] == again


def test_bad_rows_deep_in_a_file_are_named_when_reached_or_skipped(tok, tmp_path):
    lines = [json.dumps({"prompt": f"q {i}?", "completion": f"a {i}."}) for i in range(40)]
    lines[25] = '{"prompt": "cut off'  # invalid JSON on line 26
    lines[30] = json.dumps({"prompt": "no completion"})  # line 31
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")

    def loader(max_bad_rows: int) -> DataLoader:
        return DataLoader(
            host_rows(path, tok, tmp_path / "index"),
            batch_size=4,
            shuffle=False,
            max_bad_rows=max_bad_rows,
        )  # prefetching threads: the error still reaches the caller as one line

    strict = loader(0)
    for _ in range(6):  # rows 0-23 are fine
        next(strict)
    with pytest.raises(DataError, match=rf"^{path}:26: invalid JSON"):
        next(strict)
    lenient = loader(2)
    batches = [next(lenient) for _ in range(6)]
    time.sleep(0.2)  # the threads prefetch batches 6 and 7: their bad rows are not taken yet
    assert lenient.bad_rows == 0
    batches += [next(lenient) for _ in range(4)]
    assert lenient.bad_rows == 2 and lenient.metrics()["bad_rows"] == 2.0
    assert not batches[6]["loss_mask"][1].any() and not batches[7]["loss_mask"][2].any()
    assert all(batches[6]["loss_mask"][r].any() for r in (0, 2, 3))
    for _ in range(5):  # the same row goes over the limit every run, prefetched or not
        over = loader(1)
        with pytest.raises(DataError, match=rf"{path}:31: .*\(2 malformed rows, more than spec"):
            for _ in range(10):
                next(over)
