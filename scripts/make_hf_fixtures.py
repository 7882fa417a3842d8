"""Builds the tiny Hugging Face fixtures and goldens under tests/trainer/fixtures/.

For each family (llama3, qwen2, qwen3, gemma2, gemma3, and gemma3-mha: Gemma 3 with as
many kv heads as query heads, which Tunix fuses into one qkv projection): a 2-layer random fp32 model made
with `transformers` (saved with save_pretrained as safetensors), golden logits of a fixed
input (golden.npz), a LoRA adapter exported from JAX in PEFT format (peft_adapter/) and
the JAX logits with that adapter (peft_golden.npz).

torch, transformers and peft are NOT in the project's venv; they live
in a separate venv:

    make torch-venv   # .cache/torch-venv, with the Makefile's pins

Stages (each run by the interpreter that has what it needs):

    # 1. HF models + golden logits                               (torch venv)
    .cache/torch-venv/bin/python scripts/make_hf_fixtures.py --hf
    # 2. PEFT adapters exported from JAX + their JAX logits       (project venv)
    .venv/bin/python scripts/make_hf_fixtures.py --make-peft
    # 3. `peft` loads those adapters onto the HF models and must
    #    reproduce the JAX logits (the cross-check against peft)   (torch venv)
    .cache/torch-venv/bin/python scripts/make_hf_fixtures.py --check-peft

    # or all three, each with its interpreter:
    .venv/bin/python scripts/make_hf_fixtures.py --all

CI only reads the committed files: tests/trainer/test_models.py compares the JAX logits
with golden.npz, tests/trainer/test_lora.py loads peft_adapter/ and compares with
peft_golden.npz.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "trainer" / "fixtures"
TORCH_PYTHON = ROOT / ".cache" / "torch-venv" / "bin" / "python"
JAX_PYTHON = ROOT / ".venv" / "bin" / "python"
SEED = 0
LORA_RANK, LORA_ALPHA = 4, 8.0
TOLERANCE = 1e-4

TINY_DECODER = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)

# family -> (transformers config class, extra kwargs). The settings exercise what the
# loader must get right: RoPE theta and llama3 scaling, tied and untied heads, qkv bias
# (qwen2), q/k norms (qwen3, gemma3), sliding windows shorter than the input (gemma),
# soft-capping (gemma2), per-layer-type RoPE with linear scaling (gemma3).
FAMILIES = {
    "llama3": (
        "LlamaConfig",
        dict(
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0),
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            query_pre_attn_scalar=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            query_pre_attn_scalar=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
            ),
        ),
    ),
    # q, k and v heads equal: Tunix fuses them into one qkv_einsum (and its LoRA)
    "gemma3-mha": (
        "Gemma3TextConfig",
        dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=32,
            num_key_value_heads=4,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}


def input_ids(vocab: int) -> np.ndarray:
    return np.random.RandomState(SEED).randint(0, vocab, size=(2, 10)).astype(np.int64)


# ----------------------------------------------------------------------------- torch side


def randomize(model, init) -> None:
    """Gives every parameter of a torch model, in name order, ``init(name, param, noise)``
    for its draw of one SEED-seeded stream of standard normal noise."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(init(name, p, noise))


def _hf_model(family: str):
    import torch
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**TINY_DECODER, **extra})
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    gemma = family.startswith("gemma")

    def init(name, p, noise):
        if name.endswith("norm.weight"):  # gemma norms scale by (1 + w)
            return 0.2 * noise if gemma else 1.0 + 0.2 * noise
        if name.endswith(".bias"):
            return 0.2 * noise
        if "embed_tokens" in name:
            return 0.25 * noise
        return noise / p.shape[-1] ** 0.5

    randomize(model, init)
    return model.eval()


def make_hf() -> None:
    import torch

    for family in FAMILIES:
        out = FIXTURES / family
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("*.safetensors"):
            stale.unlink()
        model = _hf_model(family)
        model.save_pretrained(out, safe_serialization=True)
        (out / "generation_config.json").unlink(missing_ok=True)
        ids = input_ids(model.config.vocab_size)
        with torch.no_grad():
            logits = model(torch.tensor(ids)).logits.float().numpy()
        np.savez(out / "golden.npz", input_ids=ids, logits=logits)
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(
            f"{family}: logits {logits.shape} |max| {np.abs(logits).max():.2f}; {size / 1024:.0f} KiB"
        )


def check_peft() -> int:
    import torch
    import transformers
    from peft import PeftModel

    failed = 0
    for name in FAMILIES:
        out = FIXTURES / name
        golden = np.load(out / "peft_golden.npz")
        base = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager", dtype=torch.float32
        )
        model = PeftModel.from_pretrained(base, out / "peft_adapter").eval()
        with torch.no_grad():
            logits = model(torch.tensor(golden["input_ids"])).logits.float().numpy()
        diff = float(np.abs(logits - golden["logits"]).max())
        base_diff = float(np.abs(np.load(out / "golden.npz")["logits"] - golden["logits"]).max())
        ok = diff < TOLERANCE and base_diff > 100 * TOLERANCE
        failed += not ok
        print(
            f"{name}: peft vs JAX max|diff| {diff:.2e} (adapter moves logits by {base_diff:.2f}) {'ok' if ok else 'FAIL'}"
        )
    return 1 if failed else 0


# ------------------------------------------------------------------------------- JAX side


def make_peft() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from posttrain.trainer import lora as lora_lib
    from posttrain.trainer import models, peft_format

    for i, name in enumerate(FAMILIES):
        out = FIXTURES / name
        model, info = models.load_model(out, dtype=jnp.float32)
        lora = lora_lib.apply_lora(model, LORA_RANK, LORA_ALPHA)
        key = jax.random.key(SEED + i)
        for _, var in sorted(
            nnx.to_flat_state(nnx.state(lora, nnx.LoRAParam)), key=lambda kv: str(kv[0])
        ):
            key, sub = jax.random.split(key)
            var.set_value(0.3 * jax.random.normal(sub, var.shape, var.get_value().dtype))
        peft_format.save_peft_adapter(
            lora, out / "peft_adapter", info, base_model_name=f"posttrain-fixtures/tiny-{name}"
        )
        ids = np.load(out / "golden.npz")["input_ids"]
        logits = np.asarray(models.forward(lora, ids))
        np.savez(out / "peft_golden.npz", input_ids=ids, logits=logits)
        cfg = json.loads((out / "peft_adapter" / "adapter_config.json").read_text())
        print(f"{name}: adapter for {cfg['target_modules']}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--hf", action="store_true", help="stage 1 (torch venv)")
    group.add_argument("--make-peft", action="store_true", help="stage 2 (project venv)")
    group.add_argument("--check-peft", action="store_true", help="stage 3 (torch venv)")
    group.add_argument("--all", action="store_true", help="run the three stages")
    args = parser.parse_args()
    if args.make_peft:
        make_peft()
        return 0
    if args.check_peft:
        return check_peft()
    if args.all:
        script = str(Path(__file__).resolve())
        for python, flag in (
            (TORCH_PYTHON, "--hf"),
            (JAX_PYTHON, "--make-peft"),
            (TORCH_PYTHON, "--check-peft"),
        ):
            if subprocess.call([str(python), script, flag]) != 0:
                return 1
        return 0
    make_hf()
    return 0


if __name__ == "__main__":
    sys.exit(main())
