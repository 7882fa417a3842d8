"""The fast memory estimate (posttrain.capacity) against the TPU compiler, at published shapes.

Each case is a PostTrainJob at a real model's published config.json shape (every decoder
layer, its vocabulary) on a TPU accelerator and slice count: the trainer's own train step
(posttrain.trainer.step_memory) compiled for the job's topology by the TPU compiler on
this CPU machine (compile-only devices from libtpu, posttrain.trainer.tpu_compile;
nothing runs, no TPU is needed), one case per child process, and the compiler's
per-device total (arguments + temporaries + outputs - aliased outputs). A case over the
chip's HBM does not compile; the compiler's out-of-memory figure (its temporaries alone)
is recorded with `over_hbm`.

The figures are kept in bench/tpu_memory_table.json (a case whose spec is unchanged is not
compiled again), which tests/unit/test_capacity_tpu_table.py holds the estimate to:

    python bench/tpu_calibration.py --compile > /tmp/logs/calibration.log 2>&1 &
    python bench/tpu_calibration.py --compile --case q06-sft-lora-2k-v5e1
    python bench/tpu_calibration.py              # the report: estimate / compiler, admission
    python bench/tpu_calibration.py --list

The report prints each case's estimate, the compiler's figure, their ratio (goal: within
0.8-1.25 on at least 90% of the cases, fitted and held-out sets apart: HELD_OUT) and
posttrain's admission verdict against the compiler (a case the compiler fits within 90%
of HBM must be admitted without a warning, one over HBM refused).

A 28-layer model's step takes one to four minutes to compile on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "bench" / "tpu_memory_table.json"
sys.path.insert(0, str(ROOT / "bench"))
from memory import CONFIGS as _MEMORY_CONFIGS  # noqa: E402
from memory import _merge, compile_in_child, tpu_memory, write_configs  # noqa: E402

# Published config.json numbers (Hugging Face Hub) beside bench/memory.py's.
CONFIGS = {
    **_MEMORY_CONFIGS,
    "Qwen3-4B": {**_MEMORY_CONFIGS["Qwen3-1.7B"], "hidden_size": 2560, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "intermediate_size": 9728},
    "Llama-3.2-3B": {**_MEMORY_CONFIGS["Llama-3.2-1B"], "hidden_size": 3072,
                     "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128},
    "gemma-3-1b-it": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                      "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
                      "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
                      "vocab_size": 262144, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                      "sliding_window": 512, "sliding_window_pattern": 6,
                      "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                      "rope_scaling": None, "hidden_activation": "gelu_pytorch_tanh",
                      "tie_word_embeddings": True, "max_position_embeddings": 32768},
}  # fmt: skip

GRPO = {"technique": "grpo", "grpo": {"numGenerations": 4, "maxPromptLength": 512,
        "maxCompletionLength": 1536, "rewards": [{"type": "exactAnswer"}]}}  # fmt: skip


def _t(**training) -> dict:
    return {"training": training}


# name: (model, accelerator, spec changes). Defaults: SFT, bf16, maxLength 4096, batch 8,
# AdamW with clipping 1.0, remat auto (layer), attention auto (splash on a TPU where the
# trainer runs it), one slice.
CASES = {
    "q06-sft-full-layer-4k-v6e8": ("Qwen3-0.6B", "v6e-8", {}),
    "q06-sft-full-none-2k-v5e4": ("Qwen3-0.6B", "v5e-4", {"data": {"maxLength": 2048},
                                  **_t(remat="none")}),
    "q06-sft-full-block-4k-v5e8": ("Qwen3-0.6B", "v5e-8", _t(remat="block")),
    "q06-sft-full-dots-2k-v5e8": ("Qwen3-0.6B", "v5e-8", {"data": {"maxLength": 2048},
                                  **_t(remat="dots")}),
    "q06-sft-lora-2k-v5e1": ("Qwen3-0.6B", "v5e-1", {"data": {"maxLength": 2048},
                             "lora": {"rank": 16}, **_t(batchSize=2)}),
    "q06-sft-full-2k-v5e1": ("Qwen3-0.6B", "v5e-1", {"data": {"maxLength": 2048},
                             **_t(batchSize=1)}),
    "q06-sft-full-acc4-4k-v6e8": ("Qwen3-0.6B", "v6e-8", _t(batchSize=32,
                                  gradientAccumulation=4)),
    "q06-dpo-full-2k-v6e8": ("Qwen3-0.6B", "v6e-8", {"technique": "dpo",
                             "data": {"maxLength": 2048}, "dpo": {"maxPromptLength": 512}}),
    "q06-dpo-lora-2k-v5e4": ("Qwen3-0.6B", "v5e-4", {"technique": "dpo",
                             "data": {"maxLength": 2048}, "dpo": {"maxPromptLength": 512},
                             "lora": {"rank": 16}}),
    "q06-grpo-full-2k-v6e8": ("Qwen3-0.6B", "v6e-8", GRPO),
    "q06-distill-q17-2k-v6e8": ("Qwen3-0.6B", "v6e-8", {"technique": "distill",
                                "data": {"maxLength": 2048},
                                "distill": {"teacher": {"source": "Qwen3-1.7B"}}}),
    "q06-sft-full-4k-2x-v6e4": ("Qwen3-0.6B", "v6e-4", {"resources": {"slices": 2},
                                **_t(batchSize=16)}),
    "q17-sft-full-layer-4k-v6e8": ("Qwen3-1.7B", "v6e-8", {}),
    "q17-grpo-lora-1k-v6e8": ("Qwen3-1.7B", "v6e-8", {"technique": "grpo", "lora": {"rank": 16},
                              "grpo": {"numGenerations": 8, "maxPromptLength": 256,
                                       "maxCompletionLength": 768,
                                       "rewards": [{"type": "exactAnswer"}]}}),
    "q17-sft-lora-8k-v5p8": ("Qwen3-1.7B", "v5p-8", {"data": {"maxLength": 8192},
                             "lora": {"rank": 16}}),
    "q4b-sft-full-layer-4k-v5p8": ("Qwen3-4B", "v5p-8", {}),
    "q4b-sft-lora-4k-v6e8": ("Qwen3-4B", "v6e-8", {"lora": {"rank": 16}}),
    "l1b-sft-lora-2k-v5e1": ("Llama-3.2-1B", "v5e-1", {"data": {"maxLength": 2048},
                             "lora": {"rank": 16}, **_t(batchSize=2)}),
    "l1b-sft-lora-8k-r64-v6e8": ("Llama-3.2-1B", "v6e-8", {"data": {"maxLength": 8192},
                                 "lora": {"rank": 64, "alpha": 128}}),
    "l1b-dpo-full-block-2k-v5e8": ("Llama-3.2-1B", "v5e-8", {"technique": "dpo",
                                   "data": {"maxLength": 2048}, "dpo": {"maxPromptLength": 512},
                                   **_t(remat="block")}),
    "l1b-dpo-lora-acc4-2k-v6e4": ("Llama-3.2-1B", "v6e-4", {"technique": "dpo",
                                  "data": {"maxLength": 2048}, "dpo": {"maxPromptLength": 512},
                                  "lora": {"rank": 16}, **_t(batchSize=16,
                                                             gradientAccumulation=4)}),
    "l3b-sft-full-4k-2x-v5p8": ("Llama-3.2-3B", "v5p-8", {"resources": {"slices": 2},
                                **_t(batchSize=16)}),
    "l3b-sft-lora-2k-v6e4": ("Llama-3.2-3B", "v6e-4", {"data": {"maxLength": 2048},
                             "lora": {"rank": 16}}),
    "l3b-sft-full-4k-v5e1": ("Llama-3.2-3B", "v5e-1", _t(batchSize=1)),
    "g1b-sft-full-2k-v5e4": ("gemma-3-1b-it", "v5e-4", {"data": {"maxLength": 2048}}),
    "g1b-sft-lora-acc4-4k-v5e8": ("gemma-3-1b-it", "v5e-8", {"lora": {"rank": 16},
                                  **_t(batchSize=32, gradientAccumulation=4)}),
    "g4b-vision-lora-1k-v6e8": ("gemma-3-4b-it", "v6e-8", {"data": {
        "maxLength": 1024, "columns": {"images": "images"}}, "lora": {"rank": 16}}),
    "q06-sft-full-none-8k-v5e1": ("Qwen3-0.6B", "v5e-1", {"data": {"maxLength": 8192},
                                  **_t(remat="none")}),
    # beside l1b-sft-lora-8k-r64-v6e8: the same rows a chip on 4 chips, a short sequence on
    # 8, and the full fine-tune on 8 (what LoRA's MLP term is and is not)
    "l1b-sft-lora-8k-r64-v6e4": ("Llama-3.2-1B", "v6e-4", {"data": {"maxLength": 8192},
                                 "lora": {"rank": 64, "alpha": 128}, **_t(batchSize=4)}),
    "l1b-sft-lora-1k-r64-v6e8": ("Llama-3.2-1B", "v6e-8", {"data": {"maxLength": 1024},
                                 "lora": {"rank": 64, "alpha": 128}}),
    "l1b-sft-full-8k-v6e8": ("Llama-3.2-1B", "v6e-8", {"data": {"maxLength": 8192}}),
    # Gemma 3 text LoRA on 8 v5e chips: the MLP count on another family and generation
    "g1b-sft-lora-2k-v5e8": ("gemma-3-1b-it", "v5e-8", {"data": {"maxLength": 2048},
                             "lora": {"rank": 16}}),
    # the same LoRA step on the other generation: whether its backward holds every layer's
    # activations (capacity.backward_is_deferred: on v6e-8, not on v5e-8)
    "g1b-sft-lora-2k-v6e8": ("gemma-3-1b-it", "v6e-8", {"data": {"maxLength": 2048},
                             "lora": {"rank": 16}}),
    "l1b-sft-lora-2k-v5e8": ("Llama-3.2-1B", "v5e-8", {"data": {"maxLength": 2048},
                             "lora": {"rank": 16}}),
}  # fmt: skip
# Held out of the fit: the estimate's constants (capacity.TPU_CONSTANTS) were fitted on the
# other cases. The first eight were chosen before any case was compiled. The counts of
# capacity.tpu_phases were read from the compiler's dumps of l1b-sft-lora-8k-r64-v6e8,
# l1b-sft-lora-1k-r64-v6e8, l1b-sft-full-8k-v6e8, g1b-sft-lora-2k-v5e8 and the two cases
# beside it (compiled for that: v6e-8 against v5e-8), and of g4b-vision-lora-1k-v6e8 (fit):
# those are held out of the fit, not of the counts.
HELD_OUT = (
    "q06-sft-full-block-4k-v5e8",
    "q06-dpo-lora-2k-v5e4",
    "q06-sft-full-4k-2x-v6e4",
    "q17-sft-lora-8k-v5p8",
    "l1b-sft-lora-8k-r64-v6e8",
    "l3b-sft-lora-2k-v6e4",
    "g1b-sft-lora-acc4-4k-v5e8",
    "q4b-sft-lora-4k-v6e8",
    "l1b-dpo-full-block-2k-v5e8",
    "q06-dpo-full-2k-v6e8",
    "q06-distill-q17-2k-v6e8",
    "q06-sft-full-dots-2k-v5e8",
    "l1b-sft-lora-8k-r64-v6e4",
    "l1b-sft-lora-1k-r64-v6e8",
    "l1b-sft-full-8k-v6e8",
    "g1b-sft-lora-2k-v5e8",
    "g1b-sft-lora-2k-v6e8",
    "l1b-sft-lora-2k-v5e8",
)
NO_WARNING_BELOW = 0.9  # the compiler's total under this share of HBM: admitted, no warning


def spec_doc(name: str, models_dir: Path | None = None) -> dict:
    """The case's spec; model sources as directories under models_dir (by name without)."""
    model, accelerator, changes = CASES[name]
    doc = {
        "technique": "sft",
        "model": {"source": model, "dtype": "bfloat16"},
        "data": {"source": "/data.jsonl", "maxLength": 4096},
        "training": {"batchSize": 8, "remat": "auto"},
        "output": {"uri": "/out"},
        "resources": {"accelerator": accelerator},
    }
    doc = _merge(doc, changes)
    return with_models(doc, models_dir) if models_dir else doc


def with_models(doc: dict, models_dir: Path) -> dict:
    """The spec with its model (and teacher) sources as directories of config.json files."""
    doc = json.loads(json.dumps(doc))
    doc["model"]["source"] = str(models_dir / doc["model"]["source"])
    if "distill" in doc:
        teacher = doc["distill"]["teacher"]
        teacher["source"] = str(models_dir / teacher["source"])
    return doc


def child(doc: dict, out: Path) -> None:
    """Compile the case's step for its TPU topology (compile-only devices)."""
    from posttrain import capacity, catalog
    from posttrain.api.spec import PostTrainJobSpec

    spec = PostTrainJobSpec.model_validate(doc)
    lay = capacity.layout(spec, catalog.resolve(spec.resources.accelerator))
    memory, program = tpu_memory(spec)
    memory.pop("over", None)  # the compiler's message: not kept in the table
    if program.memory is None:  # over HBM: the compiler's figure for its temporaries alone
        found = {"memory": memory, "over_hbm": True, "hbm": program.available}
    else:
        found = {"memory": memory, "over_hbm": False}
    found.update(seconds=round(program.seconds, 1), flops=program.flops,
                 mesh=[lay.slices, lay.per_slice])  # fmt: skip
    out.write_text(json.dumps(found))


def load_table(path: Path = TABLE) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"configs": {}, "cases": {}}


def compile_case(name: str, table: dict, models_dir: Path) -> dict | None:
    """The case's compiler figures: the table's when its spec is unchanged, else compiled."""
    doc = spec_doc(name)
    model = CASES[name][0]
    found = table["cases"].get(name)
    configs_same = all(
        table["configs"].get(m) == CONFIGS[m]
        for m in (model, doc.get("distill", {}).get("teacher", {}).get("source"))
        if m
    )
    if found and found["spec"] == doc and configs_same:
        return found
    started = time.monotonic()
    compiled = compile_in_child(__file__, with_models(doc, models_dir))
    if "error" in compiled:
        print(f"{name}: failed after {time.monotonic() - started:.0f} s:\n"
              + "\n".join(compiled["error"]), flush=True)  # fmt: skip
        return None
    found = {"model": model, "spec": doc, **compiled}
    from importlib.metadata import version

    table["libtpu"], table["jax"] = version("libtpu"), version("jax")
    table["cases"][name] = found
    for m in (model, doc.get("distill", {}).get("teacher", {}).get("source")):
        if m:
            table["configs"][m] = CONFIGS[m]
    return found


def report(table: dict) -> int:
    """Estimate / compiler for every case in the table, and admission against it."""
    from posttrain import capacity

    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from tpu_table import admission_check, rows

    results = rows(table)
    bad = 0
    for r in results:
        tag = "held out" if r.name in HELD_OUT else "fit"
        note = " (over HBM: the compiler's temporaries)" if r.over_hbm else ""
        check = admission_check(r)
        bad += check == "WRONG"
        print(f"{r.name:<29} {tag:<8} estimate {r.estimate:6.2f} GiB  TPU {r.compiler:6.2f} GiB"
              f"{note}  ratio {r.ratio:4.2f}  HBM {r.hbm:g}: {r.verdict} ({check})  "
              f"peak: {r.peak}")  # fmt: skip
        terms = ", ".join(f"{k} {v:.2f}" for k, v in r.terms.items() if v >= 0.005)
        print(f"{'':<29} {terms}")
    compiled = [r for r in results if not r.over_hbm]  # over HBM: a floor, admission only
    for tag, chosen in (("fit", [r for r in compiled if r.name not in HELD_OUT]),
                        ("held out", [r for r in compiled if r.name in HELD_OUT])):  # fmt: skip
        inside = sum(0.8 <= r.ratio <= 1.25 for r in chosen)
        print(f"{tag}: {inside} of {len(chosen)} within 0.8-1.25")
    inside = sum(0.8 <= r.ratio <= 1.25 for r in compiled)
    print(f"all compiled: {inside} of {len(compiled)} within 0.8-1.25 "
          f"({len(results) - len(compiled)} more over HBM); the estimate's fitted constants: "
          f"{len(capacity.TPU_CONSTANTS)} ({', '.join(capacity.TPU_CONSTANTS)}); the rest "
          f"counts (capacity.tpu_phases: the peak phase's temporaries, "
          f"{capacity.TPU_OVERHEAD_GIB} GiB of compiler overhead)")  # fmt: skip
    print(f"admission: {bad} wrong of {len(results)}")
    return 1 if bad or inside < 0.9 * len(compiled) else 0


def fit(table: dict) -> dict[str, float]:
    """posttrain.capacity.TPU_CONSTANTS fitted on the table's cases outside HELD_OUT: non-
    negative least squares of the compiler's total less what the estimate holds as it is,
    relative to the compiler's total (each case weighs the same whatever its size).

    What the estimate holds as it is includes the temporaries of the step's peak phase
    (capacity.tpu_phases, counts read from the compiler's dumps) and its overhead, so the
    fit is linear in the constants. The constants in posttrain.capacity are this fit's
    (docs/user-guide.md, "The TPU calibration")."""
    import numpy as np
    from scipy.optimize import nnls

    from posttrain import capacity, catalog

    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from tpu_table import rows

    names = list(capacity.TPU_CONSTANTS)
    a, b = [], []
    for r in rows(table):
        if r.name in HELD_OUT or r.over_hbm:  # over HBM: the temporaries alone, a floor
            continue
        placement = catalog.resolve(r.spec.resources.accelerator)
        lay = capacity.layout(r.spec, placement)
        generation = placement.accelerator.split("-")[0]
        fixed, scaled = capacity.tpu_parts(r.spec, capacity.shape_of(r.spec), lay, generation)
        total = r.compiler * capacity.GIB
        a.append([scaled[n][1] / total for n in names])
        b.append((total - sum(fixed.values())) / total)
    found, _ = nnls(np.array(a), np.array(b))
    return dict(zip(names, (round(float(x), 3) for x in found), strict=True))


def main() -> int:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        child(json.loads(sys.argv[i + 1]), Path(sys.argv[i + 2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--list", action="store_true")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile every case not in the table (or changed) and save it",
    )
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument(
        "--fit",
        action="store_true",
        help="print posttrain.capacity.TPU_CONSTANTS fitted on the table's cases outside HELD_OUT",
    )
    args = parser.parse_args()
    if args.list:
        print("\n".join(CASES))
        return 0
    table = load_table(args.table)
    if args.compile:
        with tempfile.TemporaryDirectory() as tmp:
            models_dir = Path(tmp)
            write_configs(models_dir, CONFIGS)
            for name in args.case or list(CASES):
                found = compile_case(name, table, models_dir)
                if found is None:
                    continue
                table["cases"] = dict(sorted(table["cases"].items()))
                args.table.write_text(json.dumps(table, indent=1) + "\n")
                peak = found["memory"]
                total = (peak["argument"] + peak["temp"] + peak["output"] - peak["alias"]) / 2**30
                print(f"{name:<29} TPU {total:6.2f} GiB"
                      f"{' over HBM' if found['over_hbm'] else ''} in {found['seconds']:.0f} s",
                      flush=True)  # fmt: skip
    if args.fit:
        for name, value in fit(table).items():
            print(f'    "{name}": {value},')
        return 0
    return report(table)


if __name__ == "__main__":
    sys.exit(main())
