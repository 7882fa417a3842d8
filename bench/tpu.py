"""Train-step speed on an accelerator: tokens/s, MFU and peak memory of posttrain's own
SFT step (full fine-tune and LoRA) at published shapes, against a bare-JAX step of the
same model measured in the same run.

For each case it builds the model at its published config.json shape with random
weights made on the device (nothing is read or downloaded), compiles posttrain's train
step (``sft.make_train_step``: spec.training's AdamW with clipping, the model and the
optimizer donated) and prints:

- compile seconds, step milliseconds, tokens/s;
- MFU = tokens/s x (6 N + 12 layers x heads x head_dim x seq) / peak FLOP/s (N: every
  parameter, embeddings once; the same formula for LoRA, as the field quotes it);
- the compiled program's size (as the persistent compilation cache stores it);
- the compiler's peak (memory_analysis: arguments + temporaries + outputs - aliased, and
  its own ``peak_memory_in_bytes``) and
  the step's runtime peak (``bytes_in_use`` after the steps + ``peak_bytes_reserved``:
  the runtime reserves a program's temporaries apart from the buffers in use; each case
  runs in a process of its own) and the process's high-water mark of buffers in use
  (``peak_bytes_in_use``: the load's when above the step's, as a scanned model's stacking
  once was; what a step may reserve is the HBM less that mark);
- the ratio to the reference: ``jax.jit`` over the model's pure state (params, optimizer
  state donated), ``optax.adamw`` without clipping, the same forward and loss.

    python bench/tpu.py                                  # the default table
    python bench/tpu.py --case qwen3-0.6b-lora --batch 4 --remat dots
    python bench/tpu.py --case qwen3-0.6b-full --seq 2048 --batch 1 2 4 --remat layer dots
    python bench/tpu.py --case qwen3-0.6b-lora --layer-loop unroll scan   # spec.training.layerLoop

Without an accelerator it compiles for a v5e chip with libtpu's compile-only client
(``posttrain[tpu-compile]``) and prints the compiler's memory and FLOPs only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

GIB = 1024**3
# (model at bench/memory.py's published shapes, LoRA rank or None)
CASES = {
    "qwen3-0.6b-full": ("Qwen3-0.6B", None),
    "qwen3-0.6b-lora": ("Qwen3-0.6B", 16),
    "llama-3.2-1b-lora": ("Llama-3.2-1B", 16),
    "llama-3.2-1b-full": ("Llama-3.2-1B", None),
    "qwen3-1.7b-lora": ("Qwen3-1.7B", 16),
}
PEAK_FLOPS = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v6 lite": 918e12,
              "TPU v5p": 459e12, "TPU v4": 275e12}  # fmt: skip


def model_flops_per_token(info, seq: int) -> float:
    """6 N + 12 x layers x heads x head_dim x seq (the attention's score and value
    matmuls, forward and backward, causal masking not discounted)."""
    c = info
    attn = c.num_heads * c.head_dim
    kv = c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (attn + 2 * kv) + attn * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    n = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    if not c.tie_word_embeddings:
        n += c.vocab_size * c.hidden_size
    return 6 * n + 12 * c.num_layers * c.num_heads * c.head_dim * seq


def _sharding_tree(state, mesh):
    import jax
    from flax import nnx

    from posttrain.trainer import models

    specs = nnx.get_partition_spec(state)

    def place(x, spec):
        fitted = models.fit_spec(tuple(spec), tuple(x.shape), mesh)
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*fitted))

    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    return jax.tree.map(place, state, specs, is_leaf=is_spec)


def random_model(
    model_dir: Path,
    mesh,
    lora_rank: int | None,
    remat: str,
    attention: str,
    compile_only: bool,
    layer_loop: str = "unroll",
):
    """The model at model_dir's config.json shape: random weights made on the devices (norm
    scales 1, the rest N(0, 0.02)), or abstract ones (compile-only devices)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from posttrain.trainer import lora, models

    compute = jnp.bfloat16
    info, extras = models.model_info(
        model_dir, dtype=compute if lora_rank else jnp.float32, compute_dtype=compute, remat=remat
    )
    if compile_only and attention == "flash":  # the kernel a TPU would get
        attention = "splash"
    model = models.abstract_model(info, extras, mesh, attention)
    state = nnx.state(model)
    shardings = _sharding_tree(state, mesh)
    if compile_only:
        nnx.update(
            model,
            jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         state, shardings),
        )  # fmt: skip
    else:

        def init(state):
            leaves, tree = jax.tree.flatten(state)
            keys = jax.random.split(jax.random.key(0), len(leaves))
            out = [
                jnp.ones(x.shape, x.dtype)
                if x.ndim == 1
                else (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
                for x, k in zip(leaves, keys, strict=True)
            ]
            return jax.tree.unflatten(tree, out)

        nnx.update(model, jax.jit(init, out_shardings=shardings)(state))
    wrt = nnx.Param
    if lora_rank:
        model = lora.apply_lora(model, lora_rank, 2.0 * lora_rank, None, mesh,
                                abstract=compile_only)  # fmt: skip
        wrt = nnx.LoRAParam
    if layer_loop == "scan":
        from posttrain.trainer.models import scan

        scan.stack(model)
    return model, info, wrt


def make_batch(batch: int, seq: int, vocab: int, mesh, compile_only: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from posttrain.trainer.mesh import BATCH_AXES

    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_AXES))
    if compile_only:
        s = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows)
        return {k: s for k in ("input_ids", "loss_mask", "segment_ids", "positions")}
    rng = np.random.default_rng(0)
    host = {
        "input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int32),
        "loss_mask": np.ones((batch, seq), np.int32),
        "segment_ids": np.ones((batch, seq), np.int32),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
    }
    return {k: jax.device_put(v, rows) for k, v in host.items()}


def reference_step(model, wrt):
    """A bare-JAX step over the model's pure state: grads of the same loss, optax.adamw
    (no clipping), params and optimizer state donated."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from posttrain.trainer import sft

    graphdef, params, rest = nnx.split(model, wrt, ...)
    tx = optax.adamw(1e-5)

    def loss(params, rest, batch):
        total, count = sft.token_nll(nnx.merge(graphdef, params, rest), batch)
        return total / jnp.maximum(count, 1.0)

    @jax.jit
    def step(params, opt_state, rest, batch):
        value, grads = jax.value_and_grad(loss)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    donated = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
    return donated, params, rest, tx


def timed_steps(call, steps: int) -> float:
    """Seconds per step of `steps` calls dispatched back to back (after two warm-up steps)."""
    import jax

    for _ in range(2):
        jax.block_until_ready(call())
    start = time.perf_counter()
    out = None
    for _ in range(steps):
        out = call()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def say(started: float, what: str) -> None:
    print(f"  [{time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)


def run_case(args: argparse.Namespace) -> dict:
    """One case in this process: {name, seq, batch, remat, figures...}."""
    t0 = time.perf_counter()
    import jax
    import memory
    from flax import nnx

    from posttrain.api.spec import TrainingSpec
    from posttrain.trainer import models, optim, sft, step_memory
    from posttrain.trainer.policy import shard_like_params

    compile_only = args.compile_only
    devices = compile_only_devices(args.topology) if compile_only else jax.devices()
    mesh = (
        step_memory.mesh_of(1, 1, devices)
        if compile_only
        else models.make_mesh(devices=devices[:1])
    )
    model_name, rank = CASES[args.case]
    tmp = Path(tempfile.mkdtemp(prefix="bench-tpu-"))
    memory.write_configs(tmp)
    config = json.loads((tmp / model_name / "config.json").read_text())
    if args.layers:
        config["num_hidden_layers"] = args.layers
        (tmp / model_name / "config.json").write_text(json.dumps(config))
    out: dict = {"case": args.case, "seq": args.seq, "batch": args.batch, "remat": args.remat,
                 "attention": args.attention, "layer_loop": args.layer_loop,
                 "device": devices[0].device_kind}  # fmt: skip
    with jax.set_mesh(mesh):
        model, info, wrt = random_model(
            tmp / model_name,
            mesh,
            rank,
            args.remat,
            args.attention,
            compile_only,
            args.layer_loop,
        )
        training = TrainingSpec(batch_size=args.batch, steps=1000)
        if compile_only:
            opt = nnx.eval_shape(lambda m: nnx.Optimizer(m, optim.optimizer(training), wrt=wrt),
                                 model)  # fmt: skip
        else:
            opt = nnx.Optimizer(model, optim.optimizer(training), wrt=wrt)
            shard_like_params(opt, mesh)
        say(t0, f"{args.case}: model and optimizer built")
        batch = make_batch(args.batch, args.seq, info.vocab_size, mesh, compile_only)
        step = sft.make_train_step(wrt, 1)
        start = time.perf_counter()
        compiled = step.lower(model, opt, batch).compile()
        out["compile_s"] = time.perf_counter() - start
        say(t0, f"compiled in {out['compile_s']:.0f} s")
        out["executable_mb"] = executable_bytes(compiled) / 1e6
        m = compiled.memory_analysis()
        peak = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
        out["compiler_peak_gib"] = (peak - m.alias_size_in_bytes) / GIB
        out["temp_gib"] = m.temp_size_in_bytes / GIB
        # the compiler's own peak; on a TPU the temporaries above count a scanned step's
        # loop buffers more than once (docs/tpu.md, 2026-12-07 third session)
        out["own_peak_gib"] = getattr(m, "peak_memory_in_bytes", 0) / GIB
        cost = compiled.cost_analysis() or {}
        out["compiler_tflop"] = float(cost.get("flops", 0.0)) / 1e12
        flops_per_token = model_flops_per_token(info, args.seq)
        tokens = args.batch * args.seq
        out["model_tflop"] = flops_per_token * tokens / 1e12
        if compile_only:
            return out
        peak_flops = PEAK_FLOPS.get(devices[0].device_kind, 0.0)
        seconds = timed_steps(lambda: step(model, opt, batch)[0], args.steps)
        out["step_ms"] = 1e3 * seconds
        say(t0, f"step {1e3 * seconds:.1f} ms")
        out["tokens_per_s"] = tokens / seconds
        out["mfu"] = out["tokens_per_s"] * flops_per_token / peak_flops if peak_flops else None
        if args.reference:
            ref, params, rest, tx = reference_step(model, wrt)
            del opt, step, compiled
            state = {"params": params, "opt": tx.init(params)}

            def call():
                state["params"], state["opt"], loss = ref(
                    state["params"], state["opt"], rest, batch
                )
                return loss

            ref_seconds = timed_steps(call, args.steps)
            out["reference_step_ms"] = 1e3 * ref_seconds
            out["ratio_to_reference"] = ref_seconds / seconds
        stats = devices[0].memory_stats() or {}
        # the runtime reserves each program's temporaries apart from the buffers in use
        peak = stats.get("bytes_in_use", 0) + stats.get("peak_bytes_reserved", 0)
        out["runtime_peak_gib"] = peak / GIB
        out["in_use_mark_gib"] = stats.get("peak_bytes_in_use", 0) / GIB
        out["memory_stats"] = stats
        out["hbm_gib"] = stats.get("bytes_limit", 0) / GIB
    return out


def executable_bytes(compiled) -> int:
    """The size of the compiled program as the persistent compilation cache stores it."""
    return len(compiled.runtime_executable().serialize())


def compile_only_devices(topology: str) -> list:
    """libtpu's compile-only devices of a one-host TPU topology (`v5e:1x1`: one v5e chip),
    as `posttrain estimate --compile` makes them (no chip claimed)."""
    from posttrain import catalog
    from posttrain.trainer import tpu_compile

    kind, shape = topology.split(":")
    chips = 1
    for n in shape.split("x"):
        chips *= int(n)
    return tpu_compile.tpu_devices(catalog.resolve(f"{kind}-{chips}", None))


def show(r: dict) -> str:
    if "error" in r:
        return (
            f"{r['case']:<18} seq {r['seq']:>5} batch {r['batch']:>2} {r['remat']:<5} {r['error']}"
        )
    line = (f"{r['case']:<18} seq {r['seq']:>5} batch {r['batch']:>2} {r['remat']:<5} "
            f"{r.get('attention', ''):<5} {r.get('layer_loop', ''):<6} "
            f"compile {r['compile_s']:5.0f} s ({r.get('executable_mb', 0):.0f} MB)  compiler peak {r['compiler_peak_gib']:5.2f} GiB "
            f"(own {r.get('own_peak_gib', 0):5.2f})")  # fmt: skip
    if "step_ms" not in r:
        return line + f"  compiler {r['compiler_tflop']:.1f} TFLOP (model {r['model_tflop']:.1f})"
    line += (f"  runtime peak {r['runtime_peak_gib']:5.2f} GiB (in use at most "
             f"{r.get('in_use_mark_gib', 0):.2f})  step {r['step_ms']:6.1f} ms  "
             f"{r['tokens_per_s']:8.0f} tokens/s  MFU {100 * (r['mfu'] or 0):4.1f}%")  # fmt: skip
    if "ratio_to_reference" in r:
        line += f"  x{r['ratio_to_reference']:.2f} of the bare-JAX step"
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", choices=sorted(CASES),
                        default=["qwen3-0.6b-full", "qwen3-0.6b-lora", "llama-3.2-1b-lora"])  # fmt: skip
    parser.add_argument("--seq", nargs="+", type=int, default=[2048])
    parser.add_argument("--batch", nargs="+", type=int, default=[2])
    parser.add_argument("--remat", nargs="+", default=["layer"])
    parser.add_argument("--attention", nargs="+", default=["flash"], help="flash, dense")
    parser.add_argument("--layer-loop", nargs="+", default=["unroll"], help="unroll, scan")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=0, help="fewer layers (a quick check)")
    parser.add_argument("--no-reference", dest="reference", action="store_false")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for --topology with libtpu, no accelerator needed")  # fmt: skip
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--json", type=Path, help="append each result as a JSON line here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one case, in this process
        for key, value in json.loads(args.child).items():
            setattr(args, key, value)
        try:
            result = run_case(args)
        except Exception as e:  # noqa: BLE001 - a case that does not fit is a result
            msg = str(e).splitlines()[0][:300]
            result = {"case": args.case, "seq": args.seq, "batch": args.batch,
                      "remat": args.remat, "error": f"{type(e).__name__}: {msg}"}  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    grid = itertools.product(args.case, args.seq, args.batch, args.remat, args.attention,
                             args.layer_loop)  # fmt: skip
    for case, seq, batch, remat, attention, layer_loop in grid:
        child = {"case": case, "seq": seq, "batch": batch, "remat": remat,
                 "attention": attention, "layer_loop": layer_loop}  # fmt: skip
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(child), "--steps", str(args.steps),
             "--layers", str(args.layers), "--topology", args.topology,
             *(["--compile-only"] if args.compile_only else []),
             *([] if args.reference else ["--no-reference"])],
            stdout=subprocess.PIPE, text=True, env=os.environ,
        )  # fmt: skip
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            result = {**child, "error": f"exit {proc.returncode} (its log is above)"}
        else:
            result = json.loads(lines[-1][len("RESULT ") :])
        print(show(result), flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
