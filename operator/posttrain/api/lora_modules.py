"""Module names spec.lora.targetModules may list, per model family (no JAX here, so the
admission webhook and the trainer share one table)."""

from __future__ import annotations

import re

MLP = ("gate_proj", "up_proj", "down_proj")
TUNIX_NAMES = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", *MLP, "lm_head"),
    "gemma": ("q_einsum", "kv_einsum", "qkv_einsum", "attn_vec_einsum", *MLP),
}
# Hugging Face / PEFT module names -> Tunix module names, per kind of family.
HF_TO_TUNIX = {
    "llama": {n: n for n in TUNIX_NAMES["llama"]},
    "gemma": {
        "q_proj": "q_einsum",
        "k_proj": "kv_einsum",
        "v_proj": "kv_einsum",
        "o_proj": "attn_vec_einsum",
        **{n: n for n in TUNIX_NAMES["gemma"]},
    },
}
# A comma-separated list of names (anything else is a regex over module paths).
NAME_LIST = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*(\s*,\s*[A-Za-z_][A-Za-z0-9_]*)*\s*")


def kind(family: str) -> str:
    return "gemma" if family.startswith("gemma") else "llama"


def unknown_names(family: str, target_modules: str) -> list[str]:
    """Names in a comma list that the family lacks ([] for a regex or all-linear); with
    family auto, a name any family has is accepted."""
    if target_modules.strip() == "all-linear" or not NAME_LIST.fullmatch(target_modules):
        return []
    known = (
        set(HF_TO_TUNIX[kind(family)])
        if family != "auto"
        else {n for m in HF_TO_TUNIX.values() for n in m}
    )
    return [n.strip() for n in target_modules.split(",") if n.strip() not in known]
