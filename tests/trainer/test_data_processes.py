"""Each host reads only what it trains on, in a real multi-process run: 4 processes joined
by jax.distributed (one CPU device each, configured like JobSet pods) build their loaders
the way the trainer does (data_host_check.py) over a jsonl and an ArrayRecord file; then
2 processes continue from the position the 4 saved, to the end of the epoch. Packed, the
position is every host's window queue, all-gathered across the processes: 4 processes
hand it to 2 and the 2 back to 4, and no example is packed twice or left out."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.api.spec import PostTrainJobSpec
from posttrain.trainer.data import DataLoader, Rows, build_loader, load_tokenizer, open_records
from tests.operator_process import free_port
from tests.trainer.data_helpers import make_tokenizer_dir, remaining

pytestmark = pytest.mark.trainer
HERE = Path(__file__).resolve().parent
ROWS, BATCH, SEED = 400, 16, 3
FIRST_STEPS = 15  # on 4 processes; then 2 processes finish the epoch
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "seven", "red")


def chat_rows(count: int) -> list[bytes]:
    rng = random.Random(0)
    rows = []
    for i in range(count):
        reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        row = {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant"}]}
        row["messages"][1]["content"] = reply
        rows.append(json.dumps(row).encode())
    return rows


def write_data(folder: Path) -> list[int]:
    """Half the rows as jsonl, half as ArrayRecord (one source: a directory of both);
    returns the bytes each row takes in its file, by row index."""
    from array_record.python.array_record_module import ArrayRecordWriter

    rows = chat_rows(ROWS)
    folder.mkdir()
    half = ROWS // 2
    (folder / "a.jsonl").write_bytes(b"".join(r + b"\n" for r in rows[:half]))
    writer = ArrayRecordWriter(str(folder / "b.array_record"), "group_size:8")
    for r in rows[half:]:
        writer.write(r)
    writer.close()
    return [len(r) + 1 for r in rows[:half]] + [len(r) for r in rows[half:]]


def hosts(count: int, spec: dict, tok: Path, steps: int, state: dict | None = None) -> list[dict]:
    """Run `count` host processes of one job; their RESULTs in process order."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_", "POSTTRAIN_JOB", "MEGASCALE_", "XLA_FLAGS")) or "CACHE" in k
    }
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
        JAX_NUM_PROCESSES=str(count),
    )
    args = [json.dumps(spec), str(tok), str(steps)] + ([json.dumps(state)] if state else [])
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "data_host_check.py"), *args],
            env={**env, "JAX_PROCESS_ID": str(p)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(count)
    ]
    results = []
    try:
        for proc in procs:
            out = proc.communicate(timeout=180)[0]
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), None)
            assert proc.returncode == 0 and line, out[-5000:]
            results.append(json.loads(line[len("RESULT") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def test_four_processes_each_read_a_quarter_and_two_finish_the_epoch(tmp_path):
    tok = make_tokenizer_dir(tmp_path / "tok")
    sizes = write_data(tmp_path / "data")
    out = tmp_path / "out"
    spec = {
        "model": {"source": str(tok)},
        "data": {"source": str(tmp_path / "data"), "maxLength": 64},
        "training": {"batchSize": BATCH, "steps": FIRST_STEPS, "seed": SEED},
        "output": {"uri": str(out)},
    }
    records = open_records(str(tmp_path / "data"))
    order = DataLoader(Rows(records, None), batch_size=BATCH, seed=SEED).epoch_order(0).tolist()

    four = hosts(4, spec, tok, FIRST_STEPS)
    assert [r["process"] for r in four] == [0, 1, 2, 3]
    assert len(list((out / "data-index").iterdir())) == 1  # built once, by process 0
    for s in range(FIRST_STEPS):  # each process gets its quarter of each global batch
        for r in four:
            start = s * BATCH + r["process"] * BATCH // 4
            assert r["batches"][s] == order[start : start + BATCH // 4], (s, r["process"])
    rows = [set(sum(r["batches"], [])) for r in four]
    assert all(not a & b for i, a in enumerate(rows) for b in rows[i + 1 :])
    read = [r["bytes_read"] for r in four]
    assert read == [sum(sizes[i] for i in own) for own in rows]  # its own rows, nothing more
    total = sum(read)
    for p in range(4):
        assert abs(read[p] - total / 4) <= 0.15 * total / 4, (p, read)
    state = four[0]["state"]
    assert all(r["state"] == state for r in four) and state["position"] == FIRST_STEPS * BATCH

    rest = ROWS // BATCH - FIRST_STEPS
    spec["training"]["steps"] = ROWS // BATCH
    two = hosts(2, spec, tok, rest, state)
    for s in range(rest):
        for r in two:
            start = (FIRST_STEPS + s) * BATCH + r["process"] * BATCH // 2
            assert r["batches"][s] == order[start : start + BATCH // 2], (s, r["process"])
    drawn = [i for r in four + two for batch in r["batches"] for i in batch]
    assert sorted(drawn) == list(range(ROWS))  # the epoch: no row repeated or skipped


def test_packed_position_passes_from_four_processes_to_two_and_back(tmp_path):
    """Windows of 512 examples: 4 hosts each pack one and stop inside it; 2 hosts take
    over the 4 unfinished windows and the ones up to the frontier; 4 hosts take over
    again from the 2."""
    tok = make_tokenizer_dir(tmp_path / "tok")
    (tmp_path / "chats.jsonl").write_bytes(b"".join(r + b"\n" for r in chat_rows(6000)))
    spec = {
        "model": {"source": str(tok)},
        "data": {"source": str(tmp_path / "chats.jsonl"), "maxLength": 64, "packing": True},
        "training": {"batchSize": BATCH, "steps": 100, "seed": SEED},
        "output": {"uri": str(tmp_path / "out")},
    }
    four = hosts(4, spec, tok, 15)
    two = hosts(2, spec, tok, 10, four[0]["state"])
    again = hosts(4, spec, tok, 5, two[0]["state"])
    for run in (four, two, again):  # the state every host saved is the same, gathered
        assert all(r["state"] == run[0]["state"] for r in run)
        assert all(len(b) >= BATCH // len(run) for r in run for b in r["batches"])
    assert [h["stride"] for h in two[0]["state"]["packing"]["hosts"]] == [2, 2]

    consumed = [i for r in four + two + again for b in r["batches"] for i in b]
    assert len(consumed) == len(set(consumed))  # no example packed twice
    loader = build_loader(PostTrainJobSpec.model_validate(spec), load_tokenizer(str(tok)))
    left, frontier = remaining(loader, again[0]["state"])
    assert frontier >= 8 and not set(left) & set(consumed)
    started = loader.epoch_order(0)[: frontier * loader.window]
    assert sorted(consumed + left) == sorted(started.tolist())  # none left out
