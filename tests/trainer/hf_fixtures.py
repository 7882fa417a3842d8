"""The committed tiny Hugging Face checkpoints under tests/trainer/fixtures (one a family,
made by scripts/make_hf_fixtures.py with transformers goldens), and loading them once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ("llama3", "qwen2", "qwen3", "gemma2", "gemma3")
# fixture directory -> family; gemma3-mha has as many kv heads as query heads (fused qkv)
FIXTURE_FAMILY = {**{f: f for f in FAMILIES}, "gemma3-mha": "gemma3"}


def fixture_loader() -> Callable[[str], tuple[Any, Any]]:
    """``get(fixture)``: ``models.load_model`` of that fixture directory in float32, loaded
    the first time it is asked for."""
    import jax.numpy as jnp

    from posttrain.trainer import models

    cache: dict[str, tuple[Any, Any]] = {}

    def get(family: str) -> tuple[Any, Any]:
        if family not in cache:
            cache[family] = models.load_model(FIXTURES / family, dtype=jnp.float32)
        return cache[family]

    return get
