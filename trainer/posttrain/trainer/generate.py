"""`posttrain generate`: try a trained model in one command, on CPU or one GPU.

What to load is one argument: a job file (its export under output.uri/hf), a Hugging Face
model directory (a merged export, or any model posttrain loads), or a PEFT adapter
directory (adapter_config.json; the base comes from its base_model_name_or_path). The
prompt is wrapped in the tokenizer's chat template as a user turn, and the reply is
printed token by token as it is decoded: greedy by default, sampled with --temperature.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.api.spec import USER_ERROR_EXIT_CODE
from posttrain.trainer import (
    adapter_base,
    compile_cache,
    data,
    lora,
    models,
    peft_format,
    sources,
    storage,
)


def resolve(target: str) -> str:
    """The model or adapter location a target names: a job file's export, or the target."""
    if target.endswith((".yaml", ".yml")) and Path(target).is_file():
        from posttrain.checks import load_job

        job = load_job(target)
        return storage.join(job.spec.output.uri, "hf")
    return target


def _base_source(config: dict, config_path: Path) -> str:
    """base_model_name_or_path (and revision) as a posttrain source: a gs:// URI or an
    existing path as written, an ``org/name`` Hub id as hf://org/name[@revision]; a path
    that is not there is an error that says how to name the base."""
    name = config.get("base_model_name_or_path")
    if not name:
        raise ValueError(f"MODEL_OR_JOB: {config_path} names no base_model_name_or_path")
    if storage.is_gcs(name) or Path(name).exists() or name.startswith("hf://"):
        return name
    if adapter_base.is_hub_id(name):
        revision = config.get("revision")
        return f"hf://{name}" + (f"@{revision}" if revision else "")
    raise FileNotFoundError(
        f"MODEL_OR_JOB: {config_path}: base model {name} is not a directory here; "
        f"export the adapter naming your copy of it ({adapter_base.BASE_FLAG} PATH)"
    )


def load(target: str, scratch: Path) -> tuple[nnx.Module, data.Tokenizer]:
    """The model (with its adapter, for an adapter directory) and its tokenizer."""
    location = sources.local_model_dir(resolve(target), scratch, field="MODEL_OR_JOB")
    config_path = Path(location) / peft_format.ADAPTER_CONFIG
    if not config_path.is_file():
        model, _ = models.load_model(location)
        return model, data.load_tokenizer(location)
    config = json.loads(config_path.read_text())
    base = _base_source(config, config_path)
    base_dir = sources.local_model_dir(base, scratch, field=f"{config_path}: base")
    model, info = models.load_model(base_dir)
    targets = peft_format.adapter_target_regex(location, info)
    model = lora.apply_lora(model, int(config["r"]), float(config["lora_alpha"]), targets)
    peft_format.load_peft_adapter(model, location, info)
    has_tokenizer = (Path(location) / "tokenizer.json").is_file()
    return model, data.load_tokenizer(location if has_tokenizer else base_dir)


def stream(
    model: nnx.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int = 0,
) -> Iterator[int]:
    """New token ids one at a time (prefill, then one step a token with the KV cache):
    argmax at temperature 0, else drawn from softmax(logits / temperature)."""
    rng = np.random.default_rng(seed)
    length = len(prompt_ids)
    size = length + max_new_tokens
    cache = models.init_cache(model, 1, size)
    slots = jnp.arange(size)
    tokens = jnp.asarray(prompt_ids, jnp.int32)[None]
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    mask = (slots[None, :] <= jnp.arange(length)[:, None])[None]
    for i in range(max_new_tokens):
        logits, cache = models.next_logits(model, tokens, positions, cache, mask)
        if i == 0 and max_new_tokens > 1:  # compile the decoding step before the first token
            at = jnp.full((1, 1), length, jnp.int32)  # the next step's shapes and types
            step_mask = (slots <= length)[None, None, :]
            jax.block_until_ready(models.next_logits(model, at, at, cache, step_mask))
        row = np.asarray(logits[0], np.float64)
        if temperature > 0:
            p = np.exp((row - row.max()) / temperature)
            token = int(rng.choice(len(p), p=p / p.sum()))
        else:
            token = int(row.argmax())
        if token in eos_token_ids:
            return
        yield token
        pos = length + i
        tokens = jnp.full((1, 1), token, jnp.int32)
        positions = jnp.full((1, 1), pos, jnp.int32)
        mask = (slots <= pos)[None, None, :]


def prompt_ids(tokenizer: data.Tokenizer, prompt: str, chat_template: str | None) -> list[int]:
    """The prompt as a user turn in the chat template (plain text without one)."""
    template = tokenizer.template(chat_template)
    if template is None:
        return tokenizer.encode(prompt, add_special_tokens=True)
    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text)


def reply(
    model: nnx.Module, tokenizer: data.Tokenizer, ids: Sequence[int], args: Any
) -> Iterator[str]:
    """The decoded reply, piece by piece (a piece is printed once its tokens decode to
    whole characters)."""
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    out: list[int] = []
    shown = ""
    for token in stream(
        model,
        ids,
        args.max_new_tokens,
        eos_token_ids=eos,
        temperature=args.temperature,
        seed=args.seed,
    ):
        out.append(token)
        text = tokenizer.decode(out, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a multi-byte character still incomplete
            yield text[len(shown) :]
            shown = text


def generate_command(args: argparse.Namespace) -> int:
    if args.temperature < 0 or args.max_new_tokens < 1:
        print("posttrain: --temperature must be >= 0 and --max-new-tokens >= 1", file=sys.stderr)
        return 2
    print(f"posttrain: loading {args.target}", file=sys.stderr, flush=True)
    compile_cache.enable()  # shared with `posttrain run`: a second generate loads its programs
    try:
        with tempfile.TemporaryDirectory(prefix="posttrain-") as scratch:  # a gs:// copy
            model, tokenizer = load(args.target, Path(scratch))
        ids = prompt_ids(tokenizer, args.prompt, args.chat_template)
    except (ValueError, OSError) as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    # The first token compiles the prefill and the decoding step: the longest wait, and
    # the only one (the reply then streams without a pause).
    print("posttrain: compiling, then the reply streams below", file=sys.stderr, flush=True)
    for piece in reply(model, tokenizer, ids, args):
        print(piece, end="", flush=True)
    print()
    return 0
