"""Hidden sizes of well-known checkpoints, read from the model name (the last part of
spec.model.source). Where the name is known, a LoRA rank above the hidden size is
refused at admission: the adapter would be larger than the layer it adapts."""

from __future__ import annotations

import re

HIDDEN_SIZES: dict[str, int] = {
    "qwen3-0.6b": 1024, "qwen3-1.7b": 2048, "qwen3-4b": 2560, "qwen3-8b": 4096,
    "qwen3-14b": 5120, "qwen3-32b": 5120,
    "qwen2.5-0.5b": 896, "qwen2.5-1.5b": 1536, "qwen2.5-3b": 2048, "qwen2.5-7b": 3584,
    "llama-3.2-1b": 2048, "llama-3.2-3b": 3072, "llama-3.1-8b": 4096, "llama-3.1-70b": 8192,
    "meta-llama-3-8b": 4096, "meta-llama-3-70b": 8192,
    "gemma-3-270m": 640, "gemma-3-1b": 1152, "gemma-3-4b": 2560, "gemma-3-12b": 3840,
    "gemma-3-27b": 5376, "gemma-2-2b": 2304, "gemma-2-9b": 3584, "gemma-2-27b": 4608,
    "smollm2-135m": 576, "smollm2-360m": 960, "smollm2-1.7b": 2048,
}  # fmt: skip


def hidden_size(source: str) -> int | None:
    """The hidden size of the model `source` names, when the name is a known one."""
    name = source.rstrip("/").rsplit("/", 1)[-1].lower().partition("@")[0]
    for known in sorted(HIDDEN_SIZES, key=len, reverse=True):
        if re.match(re.escape(known) + r"(?![0-9.])", name):
            return HIDDEN_SIZES[known]
    return None
