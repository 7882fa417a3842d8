"""Architectures of well-known checkpoints, and of any checkpoint whose config.json is at hand.

One table serves the LoRA-rank check (a rank above the hidden size is refused) and the
memory estimate (`posttrain.capacity`). A shape comes from, in order:

1. the checkpoint's own `config.json` when spec.model.source is a local directory
   (`posttrain validate` / `posttrain estimate` on the machine that holds it; the operator
   never reads the network),
2. the table below, by the model name (the last part of the source: Qwen3-0.6B,
   SmolLM2-135M-Instruct, gemma-3-1b-it...).

The numbers are those of the models' published config.json files on the Hugging Face Hub
(for Gemma 3 4B and larger, its `text_config`). Checked against copies of those configs
in public code: SmolLM2 1.7B (24 layers, 32 heads and 32 KV heads of 64, MLP 8192,
vocabulary 49152) as torchtune's SmolLM2 builders give it; Gemma 2 27B (46 layers, 32
heads, 16 KV heads of 128, MLP 36864) as maxtext's Hugging Face configs give it; Gemma 3
4B and 12B from their config.json's text_config (vocabulary 262208, 64 more than the
262144 of the text-only 270M and 1B; the image token is 262144); Gemma 3 27B (62
layers, 32 heads, 16 KV heads of 128, MLP 21504) from its text_config, with the
multimodal vocabulary of the 4B and 12B.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int
    intermediate: int  # intermediate_size
    vocab: int  # vocab_size
    tied: bool  # tie_word_embeddings
    origin: str = "table"  # "config.json" or "table": where the numbers came from

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention, MLP and its norms)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate + 4 * self.hidden

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embeddings + self.hidden


def _s(hidden, layers, heads, kv, head_dim, ffw, vocab, tied) -> ModelShape:
    return ModelShape(hidden, layers, heads, kv, head_dim, ffw, vocab, tied)


# name prefix -> shape (hidden, layers, heads, kv heads, head dim, intermediate, vocab, tied)
SHAPES: dict[str, ModelShape] = {
    "qwen3-0.6b": _s(1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": _s(2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": _s(2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": _s(4096, 36, 32, 8, 128, 12288, 151936, False),
    "qwen3-14b": _s(5120, 40, 40, 8, 128, 17408, 151936, False),
    "qwen3-32b": _s(5120, 64, 64, 8, 128, 25600, 151936, False),
    "qwen2.5-0.5b": _s(896, 24, 14, 2, 64, 4864, 151936, True),
    "qwen2.5-1.5b": _s(1536, 28, 12, 2, 128, 8960, 151936, True),
    "qwen2.5-3b": _s(2048, 36, 16, 2, 128, 11008, 151936, True),
    "qwen2.5-7b": _s(3584, 28, 28, 4, 128, 18944, 152064, False),
    "llama-3.2-1b": _s(2048, 16, 32, 8, 64, 8192, 128256, True),
    "llama-3.2-3b": _s(3072, 28, 24, 8, 128, 8192, 128256, True),
    "llama-3.1-8b": _s(4096, 32, 32, 8, 128, 14336, 128256, False),
    "llama-3.1-70b": _s(8192, 80, 64, 8, 128, 28672, 128256, False),
    "meta-llama-3-8b": _s(4096, 32, 32, 8, 128, 14336, 128256, False),
    "meta-llama-3-70b": _s(8192, 80, 64, 8, 128, 28672, 128256, False),
    "llama-3.3-70b": _s(8192, 80, 64, 8, 128, 28672, 128256, False),
    "gemma-3-270m": _s(640, 18, 4, 1, 256, 2048, 262144, True),
    "gemma-3-1b": _s(1152, 26, 4, 1, 256, 6912, 262144, True),
    "gemma-3-4b": _s(2560, 34, 8, 4, 256, 10240, 262208, True),
    "gemma-3-12b": _s(3840, 48, 16, 8, 256, 15360, 262208, True),
    "gemma-3-27b": _s(5376, 62, 32, 16, 128, 21504, 262208, True),
    "gemma-2-2b": _s(2304, 26, 8, 4, 256, 9216, 256000, True),
    "gemma-2-9b": _s(3584, 42, 16, 8, 256, 14336, 256000, True),
    "gemma-2-27b": _s(4608, 46, 32, 16, 128, 36864, 256000, True),
    "smollm2-135m": _s(576, 30, 9, 3, 64, 1536, 49152, True),
    "smollm2-360m": _s(960, 32, 15, 5, 64, 2560, 49152, True),
    "smollm2-1.7b": _s(2048, 24, 32, 32, 64, 8192, 49152, True),
}


def from_name(source: str) -> ModelShape | None:
    """The shape of the model `source` names, when the name is a known one."""
    name = source.rstrip("/").rsplit("/", 1)[-1].lower().partition("@")[0]
    for known in sorted(SHAPES, key=len, reverse=True):
        if re.match(re.escape(known) + r"(?![0-9.])", name):
            return SHAPES[known]
    return None


# config.json keys read for a shape: where present, positive integers within int32, as
# the trainer's model configs take them (a larger one would overflow the memory
# estimate's floats). A key left out is no error: transformers has defaults for some
# (Gemma 3's text_config lists few), and without it the shape comes from the name.
_INT_MAX = 2**31 - 1
CONFIG_MAX_BYTES = 1024 * 1024
_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "intermediate_size", "vocab_size")  # fmt: skip
_VISION_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "image_size", "patch_size", "num_channels")  # fmt: skip


class ConfigError(ValueError):
    """A config.json at hand that does not describe a model; the message names the file
    and the key."""


def _config_path(source: str) -> Path | None:
    return None if "://" in source else Path(source) / "config.json"


def read_config(source: str) -> dict | None:
    """The config.json of a local model directory; None when there is none at hand (a
    path only the trainer pods see, a gs:// or hf:// source). ConfigError, naming the
    file and the key, when there is one and it is not a model's config."""
    path = _config_path(source)
    try:
        if path is None or not path.is_file():  # not a FIFO or a device either
            return None
        with path.open("rb") as f:
            text = f.read(CONFIG_MAX_BYTES + 1)
    except OSError:
        return None
    if len(text) > CONFIG_MAX_BYTES:
        raise ConfigError(f"{path}: larger than {CONFIG_MAX_BYTES // 1024} KiB")
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: not JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(config).__name__}")
    _check_section(path, "", config, _KEYS)
    for section, keys in (("text_config", _KEYS), ("vision_config", _VISION_KEYS)):
        if section in config:
            if not isinstance(config[section], dict):
                raise ConfigError(f"{path}: {section}: expected an object")
            _check_section(path, f"{section}.", config[section], keys)
    return config


def _check_section(path: Path, prefix: str, section: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = section.get(key)
        if value is None:
            continue
        where = f"{path}: {prefix}{key}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, found {json.dumps(value)[:40]}")
        if not 0 < value <= _INT_MAX:
            raise ConfigError(f"{where}: {str(value)[:40]} is not between 1 and {_INT_MAX}")


def config_problem(source: str) -> str | None:
    """Why the config.json at hand for `source` is no model's config; None when it is
    one, or when none is at hand."""
    try:
        read_config(source)
    except ConfigError as e:
        return str(e)
    return None


def from_config(config: dict) -> ModelShape:
    """The shape a Hugging Face config.json describes (KeyError/ValueError when it lacks
    one). Gemma 3's multimodal configs keep the decoder's numbers in text_config."""
    if isinstance(config.get("text_config"), dict):
        config = {"model_type": config.get("model_type", ""), **config["text_config"]}
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if hidden <= 0 or heads <= 0:
        raise ValueError("hidden_size and num_attention_heads must be positive")
    gemma = str(config.get("model_type", "")).startswith("gemma")
    return ModelShape(
        hidden=hidden,
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate=int(config["intermediate_size"]),
        vocab=int(config["vocab_size"]),
        tied=bool(config.get("tie_word_embeddings", gemma)),
        origin="config.json",
    )


def local_config(source: str) -> ModelShape | None:
    """The shape from config.json when `source` is a local directory holding a model's
    config (one that is not, `config_problem`, gives none: validate refuses it)."""
    try:
        config = read_config(source)
        return None if config is None else from_config(config)
    except (ValueError, KeyError, TypeError, OverflowError, ZeroDivisionError):
        return None


def shape(source: str, layers: int | None = None) -> ModelShape | None:
    """The architecture of spec.model (a local config.json, else the table), with
    spec.model.layers applied; None when neither knows it."""
    found = local_config(source) or from_name(source)
    if found is not None and layers is not None:
        found = replace(found, layers=min(layers, found.layers))
    return found


def hidden_size(source: str) -> int | None:
    """The hidden size of the model `source` names, when the name is a known one."""
    found = from_name(source)
    return found.hidden if found else None


def has_vision_tower(source: str) -> bool | None:
    """Whether spec.model has an image encoder (Gemma 3 4B and larger): from a local
    config.json (a ``vision_config``), else from a known name; None when unknown."""
    try:
        config = read_config(source)
    except ConfigError:
        config = None
    if config is not None:
        return isinstance(config.get("vision_config"), dict)
    name = source.rstrip("/").rsplit("/", 1)[-1].lower().partition("@")[0]
    if re.match(r"gemma-3-(4b|12b|27b)(?![0-9.])", name):
        return True
    return False if from_name(source) is not None else None


@dataclass(frozen=True)
class VisionShape:
    """Gemma 3's SigLIP vision tower and projector (``vision_config`` of config.json)."""

    width: int  # hidden_size
    depth: int  # num_hidden_layers
    mlp: int  # intermediate_size
    heads: int
    patches: int  # per image: (image_size / patch_size)^2
    patch_weights: int  # channels * patch_size^2 (the patch embedding's input)
    text_hidden: int  # the projector's output

    @property
    def params(self) -> int:
        w, m = self.width, self.mlp
        layer = 4 * (w * w + w) + (w * m + m) + (m * w + w) + 4 * w
        embed = self.patch_weights * w + w + self.patches * w
        return self.depth * layer + embed + 2 * w + w + w * self.text_hidden


# SigLIP-So400m at 896 x 896 in 14 x 14 patches, the tower of Gemma 3 4B, 12B and 27B.
_GEMMA3_TOWER = dict(width=1152, depth=27, mlp=4304, heads=16, patches=64 * 64, patch_weights=588)


def vision_shape(source: str) -> VisionShape | None:
    """The vision tower of spec.model (a local config.json, else Gemma 3's known sizes)."""
    try:
        config = read_config(source)
    except ConfigError:
        config = None
    if config is not None:
        try:
            vc, text = config["vision_config"], config["text_config"]
            size, patch = int(vc.get("image_size", 224)), int(vc.get("patch_size", 16))
            return VisionShape(
                width=int(vc["hidden_size"]),
                depth=int(vc["num_hidden_layers"]),
                mlp=int(vc["intermediate_size"]),
                heads=int(vc["num_attention_heads"]),
                patches=(size // patch) ** 2,
                patch_weights=int(vc.get("num_channels", 3)) * patch * patch,
                text_hidden=int(text["hidden_size"]),
            )
        except (ValueError, KeyError, TypeError, ZeroDivisionError):
            pass
    text = from_name(source)
    if text is None or has_vision_tower(source) is not True:
        return None
    return VisionShape(**_GEMMA3_TOWER, text_hidden=text.hidden)
