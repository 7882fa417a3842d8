"""`posttrain run` against its own step: the loop's steady tokens/s over the same compiled
step dispatched back to back (goal >= 0.97), and how soon a restarted run reaches step 1
with the compilation cache warm (goal: within 60 s of process start).

1. Writes a checkpoint at a published shape (bench/tpu.py's cases) with random weights,
   in Hugging Face format, a tokenizer and a dataset whose rows fill every sequence
   (each is longer than --seq and truncated), so a step processes batch x seq tokens.
2. ``posttrain run`` of an SFT job on it (--steps steps, logging every --log-every):
   tokens/s of each logged window from TensorBoard; steady = the tokens of the steps
   after the first two windows (the first holds the compile) over the seconds between
   their first and last log events (a log step's event is written once the device has
   finished it; the mean of the windows' own rates is printed beside it: each window
   ends at a host time, so single windows scatter around the steady rate).
3. The same job again from a fresh output, logging every step: seconds from process
   start to step 1 (its TensorBoard event), the program now in the compilation cache
   the first run wrote (as a pod restarted after a preemption finds it).
4. bench/tpu.py's back-to-back timing of the same step (model, LoRA, batch, sequence,
   remat, attention, layer loop), in a process of its own.

    python bench/tpu_loop.py                                    # Qwen3-0.6B LoRA r16
    python bench/tpu_loop.py --case qwen3-0.6b-full --layers 4 --steps 20
    python bench/tpu_loop.py --layer-loop scan                  # the scanned step (its restart)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "trainer")]


def write_checkpoint(args: argparse.Namespace, root: Path) -> Path:
    """Random weights at the case's shape, saved as a bf16 HF checkpoint with a
    tokenizer (runs in a child process on the host's CPU: the accelerator stays free)."""
    code = f"""
import json, sys
sys.path[:0] = {[str(ROOT / "bench"), str(ROOT / "tests" / "trainer")]!r}
from pathlib import Path
import jax, jax.numpy as jnp, memory, tpu
from data_helpers import make_tokenizer_dir
from posttrain.trainer import models
from posttrain.trainer.models.saving import save_hf
root = Path({str(root)!r}); name = tpu.CASES[{args.case!r}][0]
memory.write_configs(root / "shapes")
config = json.loads((root / "shapes" / name / "config.json").read_text())
if {args.layers}:
    config["num_hidden_layers"] = {args.layers}
    (root / "shapes" / name / "config.json").write_text(json.dumps(config))
mesh = models.make_mesh(devices=jax.devices()[:1])
with jax.set_mesh(mesh):
    model, info, _ = tpu.random_model(root / "shapes" / name, mesh, None, "none", "dense", False)
    save_hf(model, root / "model", info, dtype=jnp.bfloat16)
make_tokenizer_dir(root / "model")
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    sentence = "the quick brown fox jumps over a lazy dog while seven wise owls count stars"
    with (root / "rows.jsonl").open("w") as f:
        for i in range(256):  # each row is longer than --seq tokens: truncated, it fills one
            text = " ".join(f"{sentence} {i + j}" for j in range(args.seq // 8))
            f.write(json.dumps({"prompt": f"Row {i}.", "completion": text}) + "\n")
    return root / "model"


def job_file(args: argparse.Namespace, root: Path, out: Path, log_every: int) -> Path:
    import yaml

    _, rank = __import__("tpu").CASES[args.case]
    spec = {
        # bf16 forward and backward, as the back-to-back step: a full fine-tune's master
        # weights are float32 whatever model.dtype says (policy.load_policy)
        "model": {"source": str(root / "model"), "dtype": "bfloat16"},
        "data": {"source": str(root / "rows.jsonl"), "maxLength": args.seq,
                 "completionOnlyLoss": False},
        "training": {"steps": args.steps, "batchSize": args.batch, "learningRate": 1e-5,
                     "logEverySteps": log_every, "remat": args.remat,
                     # a job file without spec.accelerator validates as a CPU job, where
                     # flash is refused: auto is flash on the accelerator it runs on
                     "attention": "auto" if args.attention == "flash" else args.attention,
                     "layerLoop": args.layer_loop},
        "checkpoint": {"everySteps": args.steps},
        "output": {"uri": str(out)},
    }  # fmt: skip
    if rank:
        spec["lora"] = {"rank": rank, "alpha": 2 * rank}
    doc = {"apiVersion": "posttrain.dev/v1alpha1", "kind": "PostTrainJob",
           "metadata": {"name": "loop-bench"}, "spec": spec}  # fmt: skip
    path = root / f"job-{out.name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def posttrain_run(
    job: Path, out: Path, tag: str = "train/tokens_per_second", env: dict | None = None
) -> dict:
    """Runs the job as a user does; `tag`'s value by step and the seconds from process
    start to each logged step, from its TensorBoard events. Its log (timestamped: where
    the start-up's seconds go) is written as it runs to $OUT/<out's name>.log ($OUT: the
    folder a device run brings back; default beside `out`), so a run cut by a time limit
    still shows how far it got."""
    from tb_events import events

    log = Path(os.environ.get("OUT", out.parent)) / f"{out.name}.log"
    start = time.time()
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", str(job)],
                              stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})})  # fmt: skip
    if proc.returncode:
        print(log.read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"posttrain run exited {proc.returncode}")
    rates, at = {}, {}
    for event in events(out / "tensorboard"):
        for value in event.summary.value:
            if value.tag == tag:
                rates[event.step] = value.simple_value
                at.setdefault(event.step, event.wall_time - start)
    return {"rates": rates, "seconds_to_step": at, "wall_s": time.time() - start,
            "started": start, "log": log}  # fmt: skip


def back_to_back(args: argparse.Namespace) -> dict:
    child = {"case": args.case, "seq": args.seq, "batch": args.batch, "remat": args.remat,
             "attention": args.attention, "layer_loop": args.layer_loop}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tpu.py"), "--child", json.dumps(child),
         "--steps", "20", "--layers", str(args.layers), "--no-reference"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"bench/tpu.py exited {proc.returncode}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> int:
    from tpu import CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="qwen3-0.6b-lora")
    parser.add_argument("--layers", type=int, default=0, help="fewer layers (a quick check)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--remat", default="dots")
    parser.add_argument("--attention", default="flash")
    parser.add_argument("--layer-loop", default="unroll", help="spec.training.layerLoop")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--json", type=Path, help="append the result as a JSON line here")
    parser.add_argument(
        "--no-restart",
        action="store_true",
        help="skip step 3, the warm restart (its minute goes to the ratio)",
    )
    args = parser.parse_args()
    if args.steps < 4 * args.log_every:
        parser.error("--steps must cover at least four logged windows")
    root = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    t = time.time()
    write_checkpoint(args, root)
    print(f"checkpoint written in {time.time() - t:.0f} s", flush=True)

    first = posttrain_run(job_file(args, root, root / "first", args.log_every), root / "first")
    windows = [r for s, r in sorted(first["rates"].items()) if s > 2 * args.log_every]
    at = first["seconds_to_step"]
    steps = args.steps - 2 * args.log_every
    loop_rate = steps * args.batch * args.seq / (at[args.steps] - at[2 * args.log_every])
    print(f"posttrain run: {args.steps} steps in {first['wall_s']:.0f} s; tokens/s by window "
          + ", ".join(f"{s}: {r:,.0f}" for s, r in sorted(first["rates"].items())), flush=True)  # fmt: skip

    ref = back_to_back(args)  # before the restart: a call cut short keeps the ratio
    ratio = loop_rate / ref["tokens_per_s"] if "tokens_per_s" in ref else None
    print(f"back to back: {ref.get('step_ms', float('nan')):.1f} ms a step, "
          f"{ref.get('tokens_per_s', float('nan')):,.0f} tokens/s (compile {ref.get('compile_s', 0):.0f} s)\n"
          f"posttrain run / back to back: {ratio or float('nan'):.3f} "
          f"(steady {loop_rate:,.0f} tokens/s; the windows' mean "
          f"{sum(windows) / len(windows):,.0f})", flush=True)  # fmt: skip
    to_step_1 = None
    if not args.no_restart:
        # JAX logs each program's tracing, lowering and cache hit: where the seconds go
        again = posttrain_run(job_file(args, root, root / "again", 1), root / "again",
                              env={"JAX_LOG_COMPILES": "1"})  # fmt: skip
        to_step_1 = again["seconds_to_step"].get(1)
        print(f"again, compilation cache warm: step 1 at {to_step_1:.1f} s from process start "
              f"(the first run: step {args.log_every} at "
              f"{first['seconds_to_step'].get(args.log_every, float('nan')):.1f} s)", flush=True)  # fmt: skip

        print(f"process started at {time.strftime('%H:%M:%S', time.localtime(again['started']))}; "
              "its log up to step 1:", flush=True)  # fmt: skip
        for line in again["log"].read_text().splitlines():
            if " INFO " in line or " WARNING " in line:
                print("  " + line[:200], flush=True)
            if "step 1" in line:
                break
    result = {
        "case": args.case, "layers": args.layers or "all", "seq": args.seq, "batch": args.batch,
        "remat": args.remat, "attention": args.attention, "layer_loop": args.layer_loop,
        "loop_tokens_per_s": loop_rate,
        "windows_mean_tokens_per_s": sum(windows) / len(windows),
        "back_to_back_tokens_per_s": ref.get("tokens_per_s"),
        "back_to_back_step_ms": ref.get("step_ms"), "mfu_back_to_back": ref.get("mfu"),
        "loop_over_back_to_back": ratio,
        "warm_restart_s_to_step_1": to_step_1,
        "cold_s_to_first_log": first["seconds_to_step"].get(args.log_every),
        "bench_compile_s": ref.get("compile_s"), "windows": first["rates"],
    }  # fmt: skip
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
