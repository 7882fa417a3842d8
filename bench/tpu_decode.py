"""GRPO's sampler on an accelerator: decode tokens/s of the rollout engine GRPO uses
(Tunix's sampler with its KV cache, what ``spec.grpo.rolloutEngine: vanilla`` runs), at
a published shape with random weights made on the device, against the chip's
memory-bandwidth bound for that decode.

A decode step reads every weight once (the embedding table only for the rows it looks
up; the output projection in full) and the KV cache of every sequence up to its current
length. The bound is the time those bytes take at the chip's HBM bandwidth; the goal is
half of it. The time counts the prefill in (a forward over the prompts, small beside
512 decode steps), so the rate is a lower bound on the decode's own. Both are printed, with the KV cache's full size (a sampler that reads the
whole cache every step, padding included, is bound by that instead).

``--attention both`` (the default) times the decode twice in one process: with Tunix's
dense attention, which reads the whole cache every step, and with posttrain's attention
installed (``models.attention``: a decode step reads only the cache's filled slots, in a
few static lengths), and prints the ratio.

    python bench/tpu_decode.py                           # Qwen3-0.6B, 64 x 512, LoRA r16
    python bench/tpu_decode.py --sequences 64 --new-tokens 512 --prompt 64 --lora 0
    python bench/tpu_decode.py --layers 2 --new-tokens 16  # a quick check, any backend
    python bench/tpu_decode.py --attention flash         # posttrain's decode attention only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

GIB = 1024**3
HBM_BANDWIDTH = {"TPU v5 lite": 819e9, "TPU v5e": 819e9, "TPU v6 lite": 1640e9,
                 "TPU v5p": 2765e9, "TPU v4": 1200e9}  # fmt: skip


def bytes_per_decode_step(info, params_bytes: int, sequences: int, context: float) -> dict:
    """What one decode step must read: the weights (minus the embedding table, of which
    it reads ``sequences`` rows, unless tied to the output projection) and the KV cache
    of ``sequences`` sequences ``context`` tokens long (bf16)."""
    embed = info.vocab_size * info.hidden_size * 2
    weights = params_bytes - (0 if info.tie_word_embeddings else embed)
    kv_per_token = info.num_layers * 2 * info.num_kv_heads * info.head_dim * 2
    return {"weights": weights, "kv": sequences * context * kv_per_token,
            "kv_per_token": kv_per_token}  # fmt: skip


def run(args: argparse.Namespace) -> list[dict]:
    import jax
    import memory
    import numpy as np
    from flax import nnx
    from tpu import random_model
    from tunix.generate import sampler as tunix_sampler
    from tunix.rl.rollout import base_rollout

    from posttrain.trainer import models
    from posttrain.trainer.models import attention
    from posttrain.trainer.sampler_memory import StubTokenizer

    device = jax.devices()[0]
    mesh = models.make_mesh(devices=[device])
    tmp = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    memory.write_configs(tmp)
    config_path = tmp / args.model / "config.json"
    config = json.loads(config_path.read_text())
    if args.layers:
        config["num_hidden_layers"] = args.layers
        config_path.write_text(json.dumps(config))
    with jax.set_mesh(mesh):
        model, info, _ = random_model(
            tmp / args.model, mesh, args.lora or None, "none", "dense", compile_only=False
        )
        params_bytes = sum(x.size * x.dtype.itemsize
                           for x in jax.tree.leaves(nnx.state(model, nnx.Param)))  # fmt: skip
        cache = base_rollout.CacheConfig(
            cache_size=args.prompt + args.new_tokens,
            num_layers=info.num_layers,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
        )
        # Every prompt is the same random ids; no token ends a sequence early (1 is the end).
        ids = np.random.default_rng(0).integers(3, info.vocab_size, args.prompt)
        tokenizer = StubTokenizer(ids.tolist())
        prompts = [f"prompt {i}" for i in range(args.sequences)]
        # posttrain's attention on this platform (the kernel serves training calls; what
        # matters here is the decode step every installed kernel shares)
        flash = "splash" if device.platform == "tpu" else "xla"
        kernels = {"dense": ["dense"], "flash": [flash], "both": ["dense", flash]}

        def sample(sampler, new_tokens: int):
            start = time.perf_counter()
            out = sampler(prompts, max_generation_steps=new_tokens,
                          max_prompt_length=args.prompt, temperature=1.0, seed=0,
                          eos_tokens=[tokenizer.eos_id()])  # fmt: skip
            jax.block_until_ready(out.tokens)
            return time.perf_counter() - start, sum(len(t) for t in out.tokens)

        results = []
        for kernel in kernels[args.attention]:
            attention.install(model, kernel)
            sampler = tunix_sampler.Sampler(model, tokenizer, cache)
            compile_s, _ = sample(sampler, args.new_tokens)  # prefill and decode compile
            decode_s, tokens = sample(sampler, args.new_tokens)
            results.append(figures(args, info, params_bytes, device, kernel, compile_s,
                                   decode_s, tokens))  # fmt: skip
            print(show(results[-1]), flush=True)
    return results


def figures(args, info, params_bytes, device, kernel, compile_s, decode_s, tokens) -> dict:
    # The prefill (one forward over the prompts) is counted in: a bound on the decode alone.
    steps = args.new_tokens
    step_s = decode_s / steps
    # The KV read grows from the prompt to prompt + new tokens: its mean over the decode.
    need = bytes_per_decode_step(info, params_bytes, args.sequences,
                                 args.prompt + args.new_tokens / 2)  # fmt: skip
    full_cache = bytes_per_decode_step(info, params_bytes, args.sequences,
                                       args.prompt + args.new_tokens)  # fmt: skip
    bandwidth = HBM_BANDWIDTH.get(device.device_kind, 0.0)
    out = {
        "model": args.model, "layers": info.num_layers, "lora": args.lora,
        "sequences": args.sequences, "prompt": args.prompt, "new_tokens": args.new_tokens,
        "device": device.device_kind, "attention": kernel, "first_call_s": compile_s,
        "decode_s": decode_s, "tokens": tokens, "decode_step_ms": 1e3 * step_s,
        "decode_tokens_per_s": args.sequences * steps / decode_s,
        "weights_gib": need["weights"] / GIB, "kv_mean_gib": need["kv"] / GIB,
        "kv_full_gib": full_cache["kv"] / GIB,
    }  # fmt: skip
    if bandwidth:
        bound_s = (need["weights"] + need["kv"]) / bandwidth
        full_s = (full_cache["weights"] + full_cache["kv"]) / bandwidth
        out["bound_step_ms"] = 1e3 * bound_s
        out["bound_tokens_per_s"] = args.sequences / bound_s
        out["of_bound"] = bound_s / step_s
        out["of_full_cache_bound"] = full_s / step_s
    stats = device.memory_stats() or {}
    out["runtime_peak_gib"] = stats.get("peak_bytes_in_use", 0) / GIB
    return out


def show(r: dict) -> str:
    line = (f"{r['model']} ({r['layers']} layers, LoRA {r['lora'] or 'none'}) on {r['device']}, "
            f"attention {r['attention']}: "
            f"{r['sequences']} sequences x {r['new_tokens']} new tokens after {r['prompt']}\n"
            f"  first call {r['first_call_s']:.1f} s; then {r['tokens']:,} tokens in "
            f"{r['decode_s']:.2f} s (prefill included): {r['decode_step_ms']:.2f} ms a step, "
            f"{r['decode_tokens_per_s']:,.0f} tokens/s\n"
            f"  reads a step: weights {r['weights_gib']:.2f} GiB + KV {r['kv_mean_gib']:.2f} GiB "
            f"(mean; the full cache {r['kv_full_gib']:.2f} GiB)")  # fmt: skip
    if "bound_step_ms" in r:
        line += (f"\n  bandwidth bound {r['bound_step_ms']:.2f} ms a step, "
                 f"{r['bound_tokens_per_s']:,.0f} tokens/s: {100 * r['of_bound']:.0f}% of it "
                 f"({100 * r['of_full_cache_bound']:.0f}% of the full-cache bound)")  # fmt: skip
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen3-0.6B", help="a bench/memory.py shape")
    parser.add_argument("--layers", type=int, default=0, help="fewer layers (a quick check)")
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank (0: none)")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--attention", choices=["both", "dense", "flash"], default="both")
    parser.add_argument("--json", type=Path, help="append each result as a JSON line here")
    args = parser.parse_args()
    results = run(args)
    if len(results) == 2:
        dense, flash = results
        print(f"decode step, posttrain's attention / Tunix's dense: "
              f"{flash['decode_step_ms'] / dense['decode_step_ms']:.3f} "
              f"({flash['decode_step_ms']:.2f} ms against {dense['decode_step_ms']:.2f} ms)")  # fmt: skip
    if args.json:
        with args.json.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
