"""Flash against dense attention on a TPU: step time, peak HBM and the loss difference of
posttrain's SFT gradient step at 8k tokens (``spec.training.attention``).

For each model (Qwen3-0.6B, Llama-3.2-1B, Gemma-3-1B decoder shapes from
``posttrain.api.model_shapes``: hidden size, heads, kv heads, head dim, MLP, Gemma 3's
512-token sliding windows on 5 of 6 layers) it builds the model with random weights made
on the device (the same key for both kernels: the same weights), LoRA rank 16, bf16, layer
remat, one packed batch of ``--batch`` rows of ``--seq`` tokens (examples of 300 to 3000
tokens, padding at the end), and runs, each kernel in a process of its own (the runtime's
peak is per process):

- the compile seconds, and the compiler's figures (``memory_analysis``: temporaries and
  arguments + temporaries + outputs - aliased);
- milliseconds per step (``--steps`` dispatched back to back after two warm-up steps) and
  the runtime's ``peak_bytes_in_use``;
- the first step's loss (before any update).

It prints each model's flash/dense ratios (time, peak) and |loss difference| (relative).
``--layers`` keeps the first decoder layers (default 2; Gemma 6: five local layers and
a global one) and ``--vocab`` (default 8192) cuts the vocabulary: the attention is what is
compared, and at 8k tokens a 152k-262k vocabulary's float32 logits and their gradient
(5-8 GiB each) would set the peak whatever the attention; ``--layers -1 --vocab 0`` keeps
the published numbers. A step that does not fit is reported as such.

    python bench/attention.py                 # on a TPU: about 3 minutes on one v5e
    python bench/attention.py --cpu --seq 256 --models qwen3-0.6b --vocab 512  # a check
    python bench/attention.py --models gemma-3-1b --seq 8192 --batch 1

With no TPU it compiles the same steps for a v5e chip with libtpu's compile-only client
(no TPU needed) and prints the compiler's memory figures only.
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
GIB = 1024**3
MODELS = ("qwen3-0.6b", "llama-3.2-1b", "gemma-3-1b")
KERNELS = ("splash", "dense")


def config_json(name: str, layers: int, vocab: int) -> dict:
    """A config.json with the decoder of ``name`` (model_shapes) and its family's fields."""
    from posttrain.api import model_shapes

    s = model_shapes.SHAPES[name]
    if layers >= 0:
        layers = layers or (6 if name.startswith("gemma") else 2)
    else:
        layers = s.layers
    common = {
        "hidden_size": s.hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.intermediate,
        "vocab_size": vocab or s.vocab,
        "tie_word_embeddings": s.tied,
        "max_position_embeddings": 131072,
    }
    if name.startswith("qwen3"):
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}  # fmt: skip
    if name.startswith("llama"):
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                 "low_freq_factor": 1.0, "rope_type": "llama3",
                                 "original_max_position_embeddings": 8192}}  # fmt: skip
    return {**common, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": s.head_dim, "sliding_window": 512,
            "sliding_window_pattern": 6, "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0}  # fmt: skip


def packed(batch: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """Rows of examples of 300 to 3000 tokens, packed, the rest of each row padding."""
    import numpy as np

    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, seq), np.int32)
    pos = np.zeros_like(seg)
    for r in range(batch):
        start, s = 0, 1
        while start < seq - 300:
            n = min(int(rng.integers(300, 3000)), seq - 64 - start)
            seg[r, start : start + n] = s
            pos[r, start : start + n] = np.arange(n)
            start, s = start + n, s + 1
    ids = rng.integers(0, vocab, seg.shape).astype(np.int32)
    return {"input_ids": ids, "loss_mask": (seg != 0).astype(np.int32), "segment_ids": seg,
            "positions": pos}  # fmt: skip


def compile_only_mesh():
    """A one-chip v5e mesh of libtpu's compile-only devices (as `posttrain estimate
    --compile` makes them)."""
    from posttrain import catalog
    from posttrain.trainer import step_memory, tpu_compile

    return step_memory.mesh_of(1, 1, tpu_compile.tpu_devices(catalog.resolve("v5e-1", None)))


def one_device_mesh(devices):
    from posttrain.trainer import step_memory

    return step_memory.mesh_of(1, len(devices), devices)


def run(case: dict) -> dict:
    """One model with one kernel: compile, (on a TPU) time and the first loss."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from posttrain.trainer import lora, models, sft
    from posttrain.trainer.mesh import BATCH_AXES

    on_cpu = case.get("cpu", False)  # --cpu: the whole run on CPU (splash interpreted)
    compile_only = not on_cpu and (case["compile_only"] or jax.default_backend() != "tpu")
    mesh = compile_only_mesh() if compile_only else one_device_mesh(jax.devices()[:1])
    where = "compile-only v5e (no TPU: the compiler's figures only)"
    out: dict = {"model": case["model"], "kernel": case["kernel"],
                 "device": where if compile_only else jax.devices()[0].device_kind}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, jax.set_mesh(mesh):
        model_dir = Path(tmp)
        config = config_json(case["model"], case["layers"], case["vocab"])
        (model_dir / "config.json").write_text(json.dumps(config))
        info, extras = models.model_info(model_dir, dtype=jnp.bfloat16, remat="layer")
        kernel = "splash_interpret" if on_cpu and case["kernel"] == "splash" else case["kernel"]
        model = models.abstract_model(info, extras, mesh, kernel)
        state = nnx.state(model)
        specs = nnx.get_partition_spec(state)
        is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731

        def sharding(x, spec):
            fitted = models.fit_spec(tuple(spec), tuple(x.shape), mesh)
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*fitted))

        shardings = jax.tree.map(sharding, state, specs, is_leaf=is_spec)
        if compile_only:
            nnx.update(model, jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
            ))  # fmt: skip
        else:

            def init(state):
                leaves, tree = jax.tree.flatten(state)
                keys = jax.random.split(jax.random.key(0), len(leaves))
                made = [jnp.ones(x.shape, x.dtype) if x.ndim == 1
                        else (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
                        for x, k in zip(leaves, keys, strict=True)]  # fmt: skip
                return jax.tree.unflatten(tree, made)

            nnx.update(model, jax.jit(init, out_shardings=shardings)(state))
        model = lora.apply_lora(model, 16, 32.0, None, mesh, abstract=compile_only)
        optimizer = nnx.eval_shape(
            lambda m: nnx.Optimizer(m, optax.adamw(1e-5), wrt=nnx.LoRAParam), model
        ) if compile_only else nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.LoRAParam)  # fmt: skip
        if compile_only:
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            nnx.update(optimizer, jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
                if hasattr(x, "shape") else x, nnx.state(optimizer)))  # fmt: skip

        def loss(model, batch):
            total, count = sft.token_nll(model, batch)
            return total / count

        def step(model, optimizer, batch):
            value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
                model, batch
            )
            optimizer.update(model, grads)
            return value

        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_AXES))
        host = packed(case["batch"], case["seq"], info.vocab_size)
        if compile_only:
            batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows)
                     for k, v in host.items()}  # fmt: skip
        else:
            batch = {k: jax.device_put(v, rows) for k, v in host.items()}
        jitted = nnx.jit(step, donate_argnames=("optimizer",))
        started = time.perf_counter()
        try:
            compiled = jitted.lower(model, optimizer, batch).compile()
        except Exception as e:  # out of HBM is an answer
            text = " ".join(str(e).split())
            if "RESOURCE_EXHAUSTED" not in text and "exceeds available" not in text:
                raise
            return {**out, "error": text[:300]}
        out["compile_s"] = time.perf_counter() - started
        m = compiled.memory_analysis()
        out["temp"] = m.temp_size_in_bytes
        out["compiler_peak"] = (
            m.argument_size_in_bytes
            + m.temp_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
        )
        if compile_only:
            return out
        out["loss"] = float(nnx.jit(loss)(model, batch))
        for _ in range(2):
            jax.block_until_ready(jitted(model, optimizer, batch))
        started = time.perf_counter()
        value = None
        for _ in range(case["steps"]):
            value = jitted(model, optimizer, batch)
        jax.block_until_ready(value)
        out["step_ms"] = (time.perf_counter() - started) / case["steps"] * 1e3
        stats = jax.devices()[0].memory_stats() or {}
        out["runtime_peak"] = stats.get("peak_bytes_in_use")
        out["tokens"] = int(np.sum(host["segment_ids"] != 0))
    return out


def show(model: str, results: dict) -> list[str]:
    lines = []
    for kernel in KERNELS:
        r = results.get(kernel, {})
        if "error" in r:
            lines.append(f"  {kernel:<7} does not fit: {r['error'][:160]}")
            continue
        if not r:
            continue
        parts = [f"compile {r['compile_s']:5.1f} s", f"temporaries {r['temp'] / GIB:6.2f} GiB",
                 f"compiler peak {r['compiler_peak'] / GIB:6.2f} GiB"]  # fmt: skip
        if "step_ms" in r:
            parts += [f"step {r['step_ms']:7.1f} ms",
                      f"runtime peak {(r['runtime_peak'] or 0) / GIB:6.2f} GiB",
                      f"loss {r['loss']:.5f}"]  # fmt: skip
        lines.append(f"  {kernel:<7} " + ", ".join(parts))
    f, d = results.get("splash", {}), results.get("dense", {})
    if "compiler_peak" in f and "compiler_peak" in d:
        ratios = [f"compiler peak {f['compiler_peak'] / d['compiler_peak']:.3f}",
                  f"temporaries {f['temp'] / max(d['temp'], 1):.3f}"]  # fmt: skip
        if "step_ms" in f and "step_ms" in d:
            ratios.insert(0, f"step time {f['step_ms'] / d['step_ms']:.3f}")
            if f.get("runtime_peak") and d.get("runtime_peak"):
                ratios.insert(1, f"runtime peak {f['runtime_peak'] / d['runtime_peak']:.3f}")
            diff = abs(f["loss"] - d["loss"])
            ratios.append(f"|loss difference| {diff:.2e} ({diff / abs(d['loss']):.1e} relative)")
        lines.append("  flash/dense: " + ", ".join(ratios))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="decoder layers (default: 2, Gemma 6); -1: the published depth",
    )
    parser.add_argument("--vocab", type=int, default=8192, help="0: the published vocabulary")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for a v5e chip with libtpu even where a TPU is")  # fmt: skip
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run everything on CPU, splash interpreted (checks this script)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        # libtpu's one-process lock: not claimed (a compile-only child needs no chip, and
        # only one child runs at a time); this process never starts JAX.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        print("RESULT " + json.dumps(run(json.loads(args.child))), flush=True)
        return 0
    print(f"attention at {args.seq} tokens x {args.batch} rows, LoRA r16, bf16, layer remat, "
          f"{args.layers if args.layers > 0 else 'all' if args.layers < 0 else '2 (Gemma 6)'} "
          f"layers, vocab {args.vocab or 'published'}",
          flush=True)  # fmt: skip
    started, device = time.monotonic(), None
    for model in args.models:
        results = {}
        for kernel in KERNELS:
            case = {"model": model, "kernel": kernel, "seq": args.seq, "batch": args.batch,
                    "layers": args.layers, "vocab": args.vocab, "steps": args.steps,
                    "compile_only": args.compile_only, "cpu": args.cpu}  # fmt: skip
            proc = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(case)],
                capture_output=True, text=True, cwd=ROOT,
            )  # fmt: skip
            found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not found:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                results[kernel] = {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
            else:
                results[kernel] = json.loads(found[-1].removeprefix("RESULT "))
                if device is None:
                    device = results[kernel]["device"]
                    print(f"on {device}", flush=True)
        print(f"{model}:")
        print("\n".join(show(model, results)), flush=True)
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
