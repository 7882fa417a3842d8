"""Gradient accumulation costs no memory beyond its gradient sum, by the TPU compiler's own
figures: each technique's train step (posttrain.trainer.step_memory: the trainer's
optimizer with clipping, remat layer, bf16, LoRA or a full fine-tune with float32
masters) compiled for one compile-only v5e chip (libtpu; nothing runs, no TPU needed)
with accumulation 4 needs at most 1.15x the memory of the same micro-batch with
accumulation 1.

What accumulation must hold is the float32 gradient sum (the scan's carry in
optim.accumulate) beside one micro-batch's activations and logits; a copy of the weights
or a second set of gradients kept through the loop (the compiler hoisting the weights'
casts or gathers out of it, which the loop's optimization barrier stops) would show
here. The model is small but shaped like a fine-tune (its logits and weights of
comparable size), so each compile takes seconds. bench/memory.py --tpu --accumulation
gives the same figures at published shapes (docs/user-guide.md). There, the goal is not
met for full fine-tunes: Qwen3-0.6B (2 of its 28 layers) needs 1.17-1.25x, its float32
gradient sum (4 bytes a parameter) being large beside one micro-batch's logits; this
model holds the step to what it does today."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from posttrain.api.spec import PostTrainJobSpec

pytestmark = [
    pytest.mark.trainer,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu is not installed (pip install 'posttrain[tpu-compile]'): no TPU compiler",
    ),
]
BOUND = 1.15
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
         "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 2048,
         "vocab_size": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "max_position_embeddings": 4096, "rope_theta": 500000.0}  # fmt: skip
TECHNIQUES = {
    "sft": {},
    "dpo": {"dpo": {"maxPromptLength": 64}},
    "grpo": {
        "grpo": {
            "numGenerations": 2,
            "maxPromptLength": 64,
            "maxCompletionLength": 192,
            "rewards": [{"type": "exactAnswer"}],
        }
    },
    "distill": {"distill": {"teacher": {"source": None}}},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llama")
    (root / "config.json").write_text(json.dumps(LLAMA))
    return root


def peak(model_dir: Path, technique: str, lora: bool, accumulation: int) -> int:
    """The TPU compiler's per-device peak for `accumulation` micro-batches of one row."""
    from posttrain import capacity, catalog
    from posttrain.trainer import tpu_compile

    doc = {
        "technique": technique,
        "model": {"source": str(model_dir), "dtype": "bfloat16"},
        "data": {"source": "/data.jsonl", "maxLength": 256},
        "training": {"batchSize": accumulation, "gradientAccumulation": accumulation,
                     "remat": "layer"},
        "output": {"uri": "/out"},
        "resources": {"accelerator": "v5e-1"},
        **json.loads(json.dumps(TECHNIQUES[technique])),
    }  # fmt: skip
    if technique == "distill":
        doc["distill"]["teacher"]["source"] = str(model_dir)
    if lora:
        doc["lora"] = {"rank": 16}
    spec = PostTrainJobSpec.model_validate(doc)
    placement = catalog.resolve("v5e-1")
    mesh = tpu_compile.trainer_mesh(
        tpu_compile.tpu_devices(placement), capacity.layout(spec, placement)
    )
    program = tpu_compile.compile_program("train step", spec, mesh)
    assert program.error is None, program.error
    return program.peak


# SFT full and LoRA; DPO, GRPO and distillation as full fine-tunes (the float32 gradient
# sum is a LoRA step's smallest term: bench/memory.py compiles their LoRA steps too)
CASES = [("sft", False), ("sft", True), ("dpo", False), ("grpo", False), ("distill", False)]


@pytest.mark.parametrize(
    "technique,lora", CASES, ids=[f"{t}-{'lora' if lora else 'full'}" for t, lora in CASES]
)
def test_accumulation_4_needs_at_most_115_percent_of_accumulation_1(model_dir, technique, lora):
    one, four = (peak(model_dir, technique, lora, k) for k in (1, 4))
    assert four <= BOUND * one, f"accumulation 4: {four / one:.3f}x accumulation 1"
