"""The model families posttrain trains: their names, their Hugging Face names, their Tunix class.

The model code is Tunix's (``tunix.models.<family>.model``); ``llama3`` and ``qwen3`` use
the subclasses of ``posttrain.trainer.models.rope``, which run with the RoPE frequencies
of ``config.json``.
"""

from __future__ import annotations

from tunix.models.gemma import model as gemma2_lib
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.qwen2 import model as qwen2_lib

from posttrain.trainer.models.rope import Llama3, Qwen3

FAMILIES = ("llama3", "qwen2", "qwen3", "gemma2", "gemma3")

# HF `model_type` / `architectures` -> family.
HF_MODEL_TYPES = {
    "llama": "llama3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
HF_ARCH_OUT = {
    "llama3": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}


def model_class(family: str):
    """The Tunix nnx model class of ``family``."""
    return {
        "llama3": Llama3,
        "qwen2": qwen2_lib.Qwen2,
        "qwen3": Qwen3,
        "gemma2": gemma2_lib.Gemma,
        "gemma3": gemma3_lib.Gemma3,
    }[family]
