"""The memory estimate (posttrain.capacity) against XLA at published shapes and full depth.

Each case is a PostTrainJob at a real model's published config.json shape (every decoder
layer, its vocabulary), on a real accelerator's device count: the trainer's own train step
(posttrain.trainer.step_memory: spec.training's optimizer with clipping, its accumulation,
remat, reference or teacher, LoRA) compiled ahead of time from abstract arrays on simulated
CPU devices, one case per child process, and ``memory_analysis()`` of one device. It prints
the estimate, XLA's figure and their ratio (goal: every ratio within 0.8-1.25), the
estimate's terms, and posttrain's admission verdict on the case's accelerator
(posttrain.capacity.admission: refuse, warn or admit) against where XLA puts the case: a
case XLA puts over the device's memory must be refused or warned, one it puts under 75% of
it admitted without a warning. For each accumulation case it prints XLA's peak with
accumulation 4 over the peak of the case with the same micro-batch and accumulation 1
(goal: at most 1.15).

One compile takes minutes (the models unroll their layers: compile time grows with depth);
run it in the background:

    python bench/memory.py > memory.txt 2>&1 &      # every case
    python bench/memory.py --case lora-8k-r64       # one case
    python bench/memory.py --list
    python bench/memory.py --tpu --accumulation Qwen3-0.6B        # accumulation 4 / 1
    python bench/memory.py --tpu --accumulation Qwen3-0.6B:4 --only sft-full  # 4 layers

--accumulation compiles, for SFT, DPO, GRPO and distillation, full fine-tune and LoRA
rank 16, each step with accumulation 1 and with accumulation 4 of the same micro-batch
(remat layer, bf16, one v5e chip unless --accelerator), and prints both peaks and their
ratio (goal: at most 1.15) with the model and the depth compiled.

Rematerialised steps compile with XLA's memory-minimising CPU scheduler (see
docs/user-guide.md, "Will it fit?": where XLA on CPU schedules differently from TPU/GPU).
On a machine with an accelerator, bench/device_memory.py reads the same figures from the
accelerator's own compiler.
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
DEVICES = 8
REMAT_XLA_FLAGS = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

# Published config.json numbers (Hugging Face Hub), the fields the trainer reads.
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
         "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
         "vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8}  # fmt: skip
CONFIGS = {
    "Qwen3-0.6B": {**QWEN3, "hidden_size": 1024, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "intermediate_size": 3072,
                   "tie_word_embeddings": True},
    "Qwen3-1.7B": {**QWEN3, "hidden_size": 2048, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "intermediate_size": 6144,
                   "tie_word_embeddings": True},
    "Llama-3.2-1B": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "hidden_act": "silu", "hidden_size": 2048, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "intermediate_size": 8192, "vocab_size": 128256, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True, "max_position_embeddings": 131072,
                     "bos_token_id": 128000, "eos_token_id": 128001,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                      "low_freq_factor": 1.0, "rope_type": "llama3",
                                      "original_max_position_embeddings": 8192},
                     "rope_theta": 500000.0},
    "gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                        "num_hidden_layers": 34, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240,
                        "vocab_size": 262208, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                        "sliding_window": 1024, "rope_theta": 1000000.0,
                        "rope_local_base_freq": 10000.0,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                          "num_hidden_layers": 27, "num_attention_heads": 16,
                          "intermediate_size": 4304, "image_size": 896, "patch_size": 14,
                          "num_channels": 3, "layer_norm_eps": 1e-6, "vision_use_head": False,
                          "hidden_act": "gelu_pytorch_tanh"},
    },
}  # fmt: skip

SFT = {"technique": "sft", "data": {"maxLength": 4096}}
# name: (model, accelerator, spec changes); training defaults: batch 8, AdamW, clipping 1.0
CASES = {
    "sft-4k-remat": ("Qwen3-0.6B", "v6e-8", {**SFT, "training": {"remat": "layer"}}),
    "sft-4k-no-remat": ("Qwen3-0.6B", "v6e-8", {**SFT, "training": {"remat": "none"}}),
    "sft-4k-remat-no-clipping": ("Qwen3-0.6B", "v6e-8", {**SFT, "training": {
        "remat": "layer", "maxGradNorm": 0}}),
    "lora-8k-r64": ("Llama-3.2-1B", "v6e-8", {"technique": "sft", "data": {"maxLength": 8192},
                    "lora": {"rank": 64, "alpha": 128}}),
    "sft-4k-accumulation-4": ("Qwen3-0.6B", "v6e-8", {**SFT, "training": {
        "batchSize": 32, "gradientAccumulation": 4}}),
    "sft-4k-no-remat-accumulation-4": ("Qwen3-0.6B", "v6e-8", {**SFT, "training": {
        "remat": "none", "batchSize": 32, "gradientAccumulation": 4}}),
    "grpo-full": ("Qwen3-0.6B", "v6e-8", {"technique": "grpo", "grpo": {
        "numGenerations": 4, "maxPromptLength": 512, "maxCompletionLength": 1536,
        "rewards": [{"type": "exactAnswer"}]}}),
    "grpo-lora": ("Qwen3-1.7B", "v6e-8", {"technique": "grpo", "lora": {"rank": 16},
                  "grpo": {"numGenerations": 8, "maxPromptLength": 256,
                           "maxCompletionLength": 768, "rewards": [{"type": "exactAnswer"}]}}),
    "dpo-full-2k": ("Qwen3-0.6B", "v6e-8", {"technique": "dpo", "data": {"maxLength": 2048},
                    "dpo": {"maxPromptLength": 512}}),
    "dpo-lora-2k": ("Qwen3-0.6B", "v6e-8", {"technique": "dpo", "data": {"maxLength": 2048},
                    "dpo": {"maxPromptLength": 512}, "lora": {"rank": 16}}),
    "distill-larger-teacher": ("Qwen3-0.6B", "v6e-8", {"technique": "distill",
                               "data": {"maxLength": 2048},
                               "distill": {"teacher": {"source": "Qwen3-1.7B"}}}),
    "sft-2-slices": ("Qwen3-0.6B", "v6e-4", {**SFT, "resources": {"slices": 2},
                     "training": {"batchSize": 16}}),
    "vision-lora": ("gemma-3-4b-it", "v6e-8", {"technique": "sft", "data": {
        "maxLength": 1024, "columns": {"images": "images"}}, "lora": {"rank": 16}}),
}  # fmt: skip
# accumulation 4 of a micro-batch: the case with that micro-batch and accumulation 1
ACCUMULATED = {"sft-4k-accumulation-4": "sft-4k-remat",
               "sft-4k-no-remat-accumulation-4": "sft-4k-no-remat"}  # fmt: skip
# --accumulation: technique changes, the micro-batch of one row (GRPO: one prompt's 4
# completions) at 2k tokens
ACCUMULATION_TECHNIQUES = {
    "sft": {"technique": "sft"},
    "dpo": {"technique": "dpo", "dpo": {"maxPromptLength": 512}},
    "grpo": {"technique": "grpo", "grpo": {"numGenerations": 4, "maxPromptLength": 512,
             "maxCompletionLength": 1536, "rewards": [{"type": "exactAnswer"}]}},
    "distill": {"technique": "distill", "distill": {"teacher": {}}},  # the same model
}  # fmt: skip
WARN_SHARE = 0.75  # XLA's peak under this share of memory: admitted without a warning


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for k, v in changes.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def spec_doc(name: str, models_dir: Path) -> dict:
    model, accelerator, changes = CASES[name]
    doc = {
        "technique": "sft",
        "model": {"source": str(models_dir / model), "dtype": "bfloat16"},
        "data": {"source": "/data.jsonl", "maxLength": 4096},
        "training": {"batchSize": 8, "remat": "auto"},
        "output": {"uri": "/out"},
        "resources": {"accelerator": accelerator},
    }
    doc = _merge(doc, changes)
    if not os.environ.get("POSTTRAIN_BENCH_TPU"):  # XLA:CPU has no flash kernel: dense
        doc["training"].setdefault("attention", "dense")
    if "distill" in doc:
        doc["distill"]["teacher"]["source"] = str(models_dir / doc["distill"]["teacher"]["source"])
    return doc


def write_configs(models_dir: Path, configs: dict | None = None) -> None:
    """A directory of config.json files, one a model (CONFIGS by default), as local
    checkpoints with no weights: what the compiles read."""
    for model, config in (CONFIGS if configs is None else configs).items():
        (models_dir / model).mkdir(parents=True, exist_ok=True)
        (models_dir / model / "config.json").write_text(json.dumps(config))


def child(doc: dict, out: Path) -> None:
    """Compile the case's step (this process has the simulated devices)."""
    from posttrain import capacity, catalog
    from posttrain.api.spec import PostTrainJobSpec
    from posttrain.trainer import step_memory

    spec = PostTrainJobSpec.model_validate(doc)
    placement = catalog.resolve(spec.resources.accelerator)
    lay = capacity.layout(spec, placement)
    started = time.monotonic()
    if os.environ.get("POSTTRAIN_BENCH_TPU"):  # --tpu: the TPU compiler, compile-only
        memory, _ = tpu_memory(spec)
    else:
        memory = step_memory.compiled_memory(spec, step_memory.mesh_of(lay.slices, lay.per_slice))
    out.write_text(json.dumps({**memory, "seconds": time.monotonic() - started}))


def tpu_memory(spec) -> tuple[dict, object]:
    """The job's train step compiled by the TPU compiler for its topology and slices
    (compile-only devices: posttrain.trainer.tpu_compile): its memory_analysis() as a
    dict of bytes, and the compiled program's figures. Over HBM the step does not
    compile: the compiler's figure for its temporaries alone, with its message in "over"."""
    from posttrain import capacity, catalog
    from posttrain.trainer import tpu_compile

    placement = catalog.resolve(spec.resources.accelerator)
    lay = capacity.layout(spec, placement)
    devices = tpu_compile.tpu_devices(placement, spec.resources.slices)
    mesh = tpu_compile.trainer_mesh(devices, lay)
    program = tpu_compile.compile_program("train step", spec, mesh)
    if program.memory is None:
        memory = {"argument": 0, "output": 0, "alias": 0, "temp": program.required or 0,
                  "over": program.error}  # fmt: skip
        return memory, program
    return dict(program.memory), program


def compile_in_child(script: str | Path, doc: dict, xla_flags: str | None = None) -> dict:
    """`script --child DOC OUT` in a child process (JAX fixes its devices when it starts,
    and a compile's memory is the child's own): the JSON the child writes to OUT, or
    {"error": the last lines of its stderr}. xla_flags: the child's XLA_FLAGS (this
    process's when None)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compiled.json"
        run = subprocess.run([sys.executable, str(script), "--child", json.dumps(doc), str(out)],
                             env=env, capture_output=True, text=True)  # fmt: skip
        if run.returncode:
            return {"error": run.stderr.strip().splitlines()[-5:] or ["?"]}
        return json.loads(out.read_text())


def run_case(name: str, models_dir: Path, saved: dict) -> dict:
    from posttrain import capacity, catalog
    from posttrain.api.spec import PostTrainJobSpec
    from posttrain.trainer import step_memory

    doc = spec_doc(name, models_dir)
    spec = PostTrainJobSpec.model_validate(doc)
    placement = catalog.resolve(spec.resources.accelerator)
    # the estimate calibrated to the compiler this run compares with
    compiler = "tpu" if os.environ.get("POSTTRAIN_BENCH_TPU") else "xla-cpu"
    est = capacity.estimate(spec, placement, compiler=compiler)
    flags = REMAT_XLA_FLAGS if capacity.remat_of(spec) != "none" else ""
    # the case as a key, its models by name (not by this run's temporary directory)
    key = json.dumps(spec_doc(name, Path()), sort_keys=True)
    if os.environ.get("POSTTRAIN_BENCH_TPU"):
        key = "tpu " + key
    if key in saved:  # --saved: XLA's figures of an earlier run of the same case
        memory = saved[key]
    else:
        xla_flags = f"--xla_force_host_platform_device_count={DEVICES} {flags}".strip()
        memory = compile_in_child(__file__, doc, xla_flags)
        if "error" in memory:
            return {"name": name, "error": memory["error"][-1:]}
    saved[key] = memory
    xla = step_memory.peak_bytes(memory) / capacity.GIB
    verdict, _ = capacity.admission(spec, placement, compiler)
    return {"name": name, "estimate": est.total_gib, "xla": xla, "ratio": est.total_gib / xla,
            "seconds": memory["seconds"], "terms": est.terms, "line": est.explain(),
            "memory": est.available_gib, "verdict": verdict,
            "admission": admission_check(xla, est.available_gib, verdict)}  # fmt: skip


def accumulation_doc(technique: str, lora: bool, accumulation: int, model: Path,
                     layers: int | None, accelerator: str) -> dict:  # fmt: skip
    """The --accumulation case: `accumulation` micro-batches of one row each."""
    doc = {
        "model": {"source": str(model), "dtype": "bfloat16", "layers": layers},
        "data": {"source": "/data.jsonl", "maxLength": 2048},
        "training": {"batchSize": accumulation, "gradientAccumulation": accumulation,
                     "remat": "layer"},
        "output": {"uri": "/out"},
        "resources": {"accelerator": accelerator},
    }  # fmt: skip
    doc = _merge(doc, ACCUMULATION_TECHNIQUES[technique])
    if technique == "distill":
        doc["distill"]["teacher"] = {"source": str(model), "layers": layers}
    if lora:
        doc["lora"] = {"rank": 16}
    if not os.environ.get("POSTTRAIN_BENCH_TPU"):
        doc["training"]["attention"] = "dense"
    return doc


def compile_peak(doc: dict) -> dict:
    """The case's per-device memory_analysis() in a child process (its peak in 'peak'),
    or its error."""
    xla_flags = f"--xla_force_host_platform_device_count={DEVICES} {REMAT_XLA_FLAGS}"
    memory = compile_in_child(__file__, doc, xla_flags)
    if "error" in memory:
        return {"error": memory["error"][-1]}
    from posttrain.trainer import step_memory

    return {**memory, "peak": step_memory.peak_bytes(memory)}


def accumulation_table(model: str, layers: int | None, accelerator: str, only: list[str],
                       models_dir: Path) -> float:  # fmt: skip
    """Prints accumulation 4 against 1 per technique, full and LoRA; the worst ratio."""
    depth = layers or CONFIGS[model]["num_hidden_layers"]
    where = "the TPU compiler" if os.environ.get("POSTTRAIN_BENCH_TPU") else "XLA:CPU"
    print(f"{model}, {depth} layers, {accelerator}, {where}: peak per device, remat layer, "
          "bf16, micro-batch of one row at 2k (GRPO: 4 completions of 512 + 1536)", flush=True)  # fmt: skip
    worst = 0.0
    for technique in ACCUMULATION_TECHNIQUES:
        for lora in (False, True):
            name = f"{technique}-{'lora' if lora else 'full'}"
            if only and name not in only:
                continue
            peaks = [compile_peak(accumulation_doc(technique, lora, k, models_dir / model,
                                                   layers, accelerator))
                     for k in (1, 4)]  # fmt: skip
            if any("error" in p for p in peaks):
                print(f"{name:<14} failed: {[p.get('error') for p in peaks]}", flush=True)
                worst = float("inf")
                continue
            one, four = (p["peak"] / 2**30 for p in peaks)
            over = any("over" in p for p in peaks)
            over = " (over HBM: the compiler's temporaries)" if over else ""
            worst = max(worst, four / one)
            print(f"{name:<14} accumulation 1 {one:6.2f} GiB  4 {four:6.2f} GiB  ratio "
                  f"{four / one:.2f}  (compiled in {peaks[0]['seconds']:.0f} + "
                  f"{peaks[1]['seconds']:.0f} s){over}", flush=True)  # fmt: skip
    return worst


def admission_check(xla: float, memory: float, verdict: str) -> str:
    """'right' or 'WRONG' where XLA puts the case over the device's memory (refused or
    warned is right) or under WARN_SHARE of it (admitted without a warning is right);
    '-' in between, where either is."""
    if xla > memory:
        return "right" if verdict in ("refuse", "warn") else "WRONG"
    if xla < WARN_SHARE * memory:
        return "right" if verdict == "admit" else "WRONG"
    return "-"


def main() -> int:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        child(json.loads(sys.argv[i + 1]), Path(sys.argv[i + 2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--tpu", action="store_true", help="compile with the TPU compiler for "
                        "each case's topology (compile-only, libtpu: the tpu-compile extra) "
                        "instead of XLA:CPU on simulated devices")  # fmt: skip
    parser.add_argument("--saved", type=Path, help="a JSON file of XLA's figures, read and "
                        "updated: a case compiled before (same spec) is not compiled again, so "
                        "a changed estimate is compared at once")  # fmt: skip
    parser.add_argument("--accumulation", metavar="MODEL[:LAYERS]", help="accumulation 4 "
                        "against 1 of the same micro-batch, per technique, full and LoRA, at "
                        "the model's full depth or LAYERS")  # fmt: skip
    parser.add_argument("--accelerator", default="v5e-1", help="with --accumulation")
    parser.add_argument("--only", action="append", default=[], help="with --accumulation: "
                        "sft-full, sft-lora, dpo-full, ... (repeatable)")  # fmt: skip
    args = parser.parse_args()
    if args.accumulation:
        if args.tpu:
            os.environ["POSTTRAIN_BENCH_TPU"] = "1"
        model, _, layers = args.accumulation.partition(":")
        with tempfile.TemporaryDirectory() as tmp:
            write_configs(Path(tmp))
            worst = accumulation_table(model, int(layers) if layers else None,
                                       args.accelerator, args.only, Path(tmp))  # fmt: skip
        return 0 if worst <= 1.15 else 1
    if args.list:
        print("\n".join(CASES))
        return 0
    if args.tpu:
        os.environ["POSTTRAIN_BENCH_TPU"] = "1"  # the children compile for the TPU
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = Path(tmp)
        write_configs(models_dir)
        for name in args.case or list(CASES):
            saved = json.loads(args.saved.read_text()) if args.saved and args.saved.exists() else {}
            r = run_case(name, models_dir, saved)
            if args.saved:
                args.saved.write_text(json.dumps(saved, indent=1))
            results.append(r)
            if "error" in r:
                print(f"{name:<24} failed: {r['error']}", flush=True)
                continue
            terms = ", ".join(f"{k} {v:.1f}" for k, v in r["terms"].items() if v >= 0.05)
            print(f"{name:<31} estimate {r['estimate']:6.1f} GiB  XLA {r['xla']:6.1f} GiB  "
                  f"ratio {r['ratio']:.2f}  device {r['memory']:g} GiB: XLA "
                  f"{r['xla'] / r['memory']:4.0%}, {r['verdict']} ({r['admission']})",
                  flush=True)  # fmt: skip
            print(f"{'':<31} compiled in {r['seconds']:.0f} s; {terms}", flush=True)
    ok = {r["name"]: r for r in results if "ratio" in r}
    inside = [r for r in ok.values() if 0.8 <= r["ratio"] <= 1.25]
    print(f"{len(inside)} of {len(results)} cases within 0.8-1.25")
    over = [r for r in ok.values() if r["xla"] > r["memory"]]
    under = [r for r in ok.values() if r["xla"] < WARN_SHARE * r["memory"]]
    wrong = [r["name"] for r in ok.values() if r["admission"] == "WRONG"]
    print(f"admission: {sum(r['verdict'] != 'admit' for r in over)} of {len(over)} cases XLA "
          f"puts over memory refused or warned, {sum(r['verdict'] == 'admit' for r in under)} "
          f"of {len(under)} under {WARN_SHARE:.0%} admitted without a warning"
          + (f"; wrong: {', '.join(wrong)}" if wrong else ""))  # fmt: skip
    worst = 0.0
    for many, one in ACCUMULATED.items():
        if many in ok and one in ok:
            ratio = ok[many]["xla"] / ok[one]["xla"]
            worst = max(worst, ratio)
            print(f"accumulation 4 / 1, the same micro-batch: {many} / {one}: XLA "
                  f"{ok[many]['xla']:.1f} / {ok[one]['xla']:.1f} GiB = {ratio:.2f}")  # fmt: skip
    good = len(inside) == len(results) and not wrong and worst <= 1.15
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
