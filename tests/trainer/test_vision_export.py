"""Gemma 3 vision exports in the formats peft and transformers load, against references
that peft and transformers made (CI has no torch; scripts/make_vision_fixtures.py made
them in a venv that has):

- ``peft_adapter/``: a LoRA adapter peft made on the transformers
  ``Gemma3ForConditionalGeneration`` (random nonzero ``lora_B``), and ``peft_golden.npz``:
  peft's logits with it for a prompt with an image and for a text-only prompt;
- ``transformers_layout.json``: the transformers model's ``state_dict`` names and shapes
  and its ``nn.Linear`` modules.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.trainer

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3-vision"
REFERENCE = FIXTURE / "peft_adapter"
TOL = 1e-4  # the text models' logit tolerance
# adapter_config.json fields peft reads when it loads an adapter
LOADING_FIELDS = (
    "peft_type",
    "task_type",
    "r",
    "lora_alpha",
    "lora_dropout",
    "bias",
    "fan_in_fan_out",
    "use_rslora",
    "use_dora",
    "modules_to_save",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "init_lora_weights",
    "inference_mode",
)


def _layout() -> dict:
    return json.loads((FIXTURE / "transformers_layout.json").read_text())


def _peft_selects(target_modules, modules) -> set[str]:
    """The modules PEFT adapts for ``target_modules``: a string is a full-match regex
    over module names, a list of names matches a module's name or its last components."""
    if isinstance(target_modules, str):
        return {m for m in modules if re.fullmatch(target_modules, m)}
    return {m for m in modules if any(m == t or m.endswith(f".{t}") for t in target_modules)}


def assert_like_peft_reference(adapter_dir: Path) -> None:
    """``adapter_dir`` has exactly the reference adapter's tensor names and shapes, the
    same loading fields in adapter_config.json, and target_modules that select the same
    modules of the transformers model."""
    from safetensors.numpy import load_file

    ours, theirs = (
        load_file(adapter_dir / "adapter_model.safetensors"),
        load_file(REFERENCE / "adapter_model.safetensors"),
    )
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    ours_cfg, theirs_cfg = (
        json.loads((d / "adapter_config.json").read_text()) for d in (adapter_dir, REFERENCE)
    )
    assert {f: ours_cfg.get(f) for f in LOADING_FIELDS} == {
        f: theirs_cfg.get(f) for f in LOADING_FIELDS
    }
    modules = _layout()["linear_modules"]
    adapted = _peft_selects(theirs_cfg["target_modules"], modules)
    assert len(adapted) == len(theirs) // 2  # the reference's selection is what it holds
    assert _peft_selects(ours_cfg["target_modules"], modules) == adapted
    assert ours_cfg["base_model_name_or_path"]


@pytest.fixture(scope="module")
def peft_golden():
    return dict(np.load(FIXTURE / "peft_golden.npz"))


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(FIXTURE / "golden.npz"))


def _with_reference_adapter(vision: bool):
    import jax.numpy as jnp

    from posttrain.trainer import lora, models, peft_format

    base, info = models.load_model(FIXTURE, dtype=jnp.float32, vision=vision)
    model = lora.apply_lora(base, 4, 8.0)
    peft_format.load_peft_adapter(model, REFERENCE, info)
    return model, info


@pytest.fixture(scope="module")
def vision_lora(tmp_path_factory):
    """A LoRA job with images whose spec.lora.restoreFrom is peft's adapter."""
    import jax
    from tiny_job import tiny_job, validated

    from posttrain.trainer import models
    from posttrain.trainer.policy import load_policy

    tmp = tmp_path_factory.mktemp("restore")
    doc = tiny_job(FIXTURE, tmp / "train.jsonl", tmp / "out", steps=1, every=1)
    doc["spec"]["lora"]["restoreFrom"] = str(REFERENCE)
    doc["spec"]["data"]["columns"] = {"images": "images"}
    # Late in the trainer tier (hundreds of jobs in this process), qwix's abstract LoRA
    # pass over Gemma 3 once failed in a stale entry of JAX's tracing caches (a jnp.einsum
    # call whose cached signature held a tracer: TracerBoolConversionError); alone, or
    # after any half of the tier, it passes. A job's own process starts with empty caches.
    jax.clear_caches()
    policy = load_policy(validated(doc).spec, models.make_mesh(1, 1, jax.devices()[:1]), tmp)
    return policy.model, policy.info


def test_peft_adapter_loads_with_peft_logits_on_an_image_prompt(vision_lora, peft_golden, golden):
    """spec.lora.restoreFrom of the adapter peft made: peft's logits on a prompt with an
    image."""
    from posttrain.trainer.models import vision

    model, _ = vision_lora
    pixels = golden["pixel_values_one"].transpose(0, 2, 3, 1)[None]
    logits = np.asarray(vision.forward(model, golden["input_ids_one"], pixels))
    expected = peft_golden["logits_one"]
    np.testing.assert_allclose(logits[:, -expected.shape[1] :], expected, atol=TOL, rtol=0)


def test_text_only_job_on_a_vision_checkpoint_uses_peft_names(peft_golden, tmp_path):
    """Without the vision tower (no images column) the model is still a
    Gemma3ForConditionalGeneration to peft: its adapter loads, and exports, under
    ``base_model.model.model.language_model.*`` (not the checkpoint's
    ``language_model.model.*``)."""
    from posttrain.trainer import models, peft_format

    model, info = _with_reference_adapter(vision=False)
    assert info.vision is None and info.hf_prefix == "language_model.model."
    logits = np.asarray(models.forward(model, peft_golden["input_ids_text"]))
    np.testing.assert_allclose(logits, peft_golden["logits_text"], atol=TOL, rtol=0)
    out = peft_format.save_peft_adapter(model, tmp_path / "adapter", info, base_model_name="x")
    assert_like_peft_reference(out)


def test_exported_vision_adapter_is_peft_s(vision_lora, tmp_path):
    from safetensors.numpy import load_file

    from posttrain.trainer import peft_format

    model, info = vision_lora
    out = peft_format.save_peft_adapter(model, tmp_path / "adapter", info, base_model_name="x")
    assert_like_peft_reference(out)
    # the tensors loaded from peft's adapter come back unchanged
    ours, theirs = (
        load_file(out / "adapter_model.safetensors"),
        load_file(REFERENCE / "adapter_model.safetensors"),
    )
    assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)


def test_merged_export_fills_transformers_state_dict(vision_lora, golden, tmp_path):
    """save_hf of the model with the adapter merged: every tensor of transformers'
    Gemma3ForConditionalGeneration, with its shape (transformers 5 holds SigLIP without
    the ``vision_model`` wrapper that checkpoints keep; the tied lm_head is not saved), and
    the adapter's effect (it loads back with the LoRA model's logits)."""
    from safetensors import safe_open

    from posttrain.trainer import models
    from posttrain.trainer.models import vision
    from posttrain.trainer.models.saving import save_hf

    model, info = vision_lora
    out = save_hf(model, tmp_path / "hf", info)
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        shapes = {
            k.replace("vision_tower.vision_model.", "vision_tower."): f.get_slice(k).get_shape()
            for k in f.keys()  # noqa: SIM118
        }
    expected = dict(_layout()["state_dict"])
    assert expected.pop("lm_head.weight") == expected["model.language_model.embed_tokens.weight"]
    assert shapes == expected
    pixels = golden["pixel_values_one"].transpose(0, 2, 3, 1)[None]
    merged, _ = models.load_model(out, vision=True)
    np.testing.assert_allclose(
        np.asarray(vision.forward(merged, golden["input_ids_one"], pixels)),
        np.asarray(vision.forward(model, golden["input_ids_one"], pixels)),
        atol=TOL,
        rtol=0,
    )


def test_text_only_merged_export_is_a_gemma3_for_causal_lm(peft_golden, tmp_path):
    """A text-only job on the vision checkpoint, merged (docs/user-guide.md: a text-only
    Gemma3ForCausalLM): the decoder's tensors of transformers' Gemma3ForCausalLM layout
    and shapes (no tower, no projector), a gemma3_text config, and, loaded back, peft's
    logits with its adapter on a text prompt."""
    from safetensors import safe_open

    from posttrain.trainer import models
    from posttrain.trainer.models.saving import save_hf

    model, info = _with_reference_adapter(vision=False)
    out = save_hf(model, tmp_path / "hf", info)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["model_type"] == "gemma3_text" and "vision_config" not in cfg
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    decoder = "model.language_model."
    expected = {
        "model." + k.removeprefix(decoder): v
        for k, v in _layout()["state_dict"].items()
        if k.startswith(decoder)
    }
    assert shapes == expected
    merged, again = models.load_model(out)
    assert again.vision is None and again.family == info.family
    logits = np.asarray(models.forward(merged, peft_golden["input_ids_text"]))
    np.testing.assert_allclose(logits, peft_golden["logits_text"], atol=TOL, rtol=0)


def test_generate_loads_peft_s_adapter_onto_the_vision_checkpoint(peft_golden, tmp_path):
    """`posttrain generate ADAPTER_DIR` (text prompts): the adapter's modules come from its
    tensors (peft's target_modules is a regex over transformers' module names), its base
    from base_model_name_or_path; the logits are peft's."""
    import shutil

    from posttrain.trainer import generate, models

    adapter = tmp_path / "adapter"
    shutil.copytree(REFERENCE, adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(
        json.dumps({**cfg, "base_model_name_or_path": str(FIXTURE)})
    )
    model, tokenizer = generate.load(str(adapter), tmp_path)
    logits = np.asarray(models.forward(model, peft_golden["input_ids_text"]))
    np.testing.assert_allclose(logits, peft_golden["logits_text"], atol=TOL, rtol=0)
    assert tokenizer.origin == str(FIXTURE)


def test_adapter_export_carries_what_transformers_needs_for_images(vision_lora, tmp_path):
    """The adapter export of a job with images holds the checkpoint's processor, tokenizer
    and chat template files, as the merged export does: transformers' AutoProcessor loads
    from the adapter directory alone and makes the same model inputs of a conversation
    with an image as from the checkpoint."""
    from PIL import Image
    from tiny_job import tiny_job, validated
    from transformers import AutoProcessor

    from posttrain.trainer.export import export_model

    model, info = vision_lora
    doc = tiny_job(FIXTURE, tmp_path / "train.jsonl", tmp_path / "out", steps=1, every=1)
    doc["spec"]["data"]["columns"] = {"images": "images"}
    adapter = Path(export_model(validated(doc), model, info, tmp_path, kind="adapter"))
    assert_like_peft_reference(adapter)
    files = {p.name for p in adapter.iterdir()}
    processor_files = {"processor_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert processor_files | {"chat_template.jinja"} <= files
    assert "config.json" not in files  # an adapter directory, not a model's
    conversation = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What shape is it?"}],
        }
    ]
    shapes = Path(__file__).resolve().parents[2] / "examples" / "data" / "shapes" / "images"
    image = Image.open(sorted(shapes.iterdir())[0])
    inputs = []
    for directory in (adapter, FIXTURE):
        processor = AutoProcessor.from_pretrained(str(directory))
        text = processor.apply_chat_template(conversation, add_generation_prompt=True)
        inputs.append(processor(text=[text], images=[[image]], return_tensors="np"))
    ours, theirs = inputs
    assert ours.keys() == theirs.keys() and "pixel_values" in ours
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key])
