"""The memory estimate of a job with images counts Gemma 3's vision tower."""

from __future__ import annotations

from pathlib import Path

from invalid_jobs import valid_job

from posttrain import capacity, catalog
from posttrain.api import model_shapes
from posttrain.api.spec import PostTrainJobSpec

FIXTURE = Path(__file__).resolve().parents[1] / "trainer" / "fixtures" / "gemma3-vision"


def _spec(images: bool, lora: bool = True, train_tower: bool = False) -> PostTrainJobSpec:
    doc = valid_job()
    doc["spec"].update(
        model={"source": "hf://google/gemma-3-4b-it"}, resources={"accelerator": "v6e-8"}
    )
    if images:
        doc["spec"]["data"]["columns"] = {"images": "images"}
    if lora:
        doc["spec"]["lora"] = {"rank": 16}
    if train_tower:
        doc["spec"]["training"] = {"trainVisionTower": True}
    return PostTrainJobSpec.model_validate(doc["spec"])


def _estimate(images: bool, lora: bool = True, train_tower: bool = False, compiler=None):
    spec = _spec(images, lora, train_tower)
    return capacity.estimate(spec, catalog.resolve("v6e-8", None), compiler=compiler)


def test_vision_shape_counts_every_tensor_of_the_tower_and_projector():
    from safetensors.numpy import load_file

    tensors = load_file(FIXTURE / "model.safetensors")
    tower = sum(v.size for k, v in tensors.items() if k.startswith(("vision_tower", "multi_modal")))
    assert model_shapes.vision_shape(str(FIXTURE)).params == tower
    # SigLIP-So400m and Gemma 3 4B's projector: about 420M weights
    assert 4.1e8 < model_shapes.vision_shape("hf://google/gemma-3-4b-it").params < 4.3e8
    assert model_shapes.vision_shape("hf://google/gemma-3-1b-it") is None


def test_images_add_the_frozen_tower_and_its_activations():
    text, vision = _estimate(images=False), _estimate(images=True)
    assert text.terms["vision tower"] == 0
    params = model_shapes.vision_shape("hf://google/gemma-3-4b-it").params
    fsdp = vision.layout.per_slice
    assert abs(vision.terms["vision tower"] * capacity.GIB - params * 2 / fsdp) < 1
    assert vision.total_gib > text.total_gib
    # XLA's figures: one encoder layer's activations beside the decoder's
    xla_text, xla_vision = _estimate(False, compiler="xla-cpu"), _estimate(True, compiler="xla-cpu")
    assert xla_vision.terms["activations"] > xla_text.terms["activations"]
    # the TPU compiler's: the frozen tower's forward is a phase of its own (its float32
    # [heads, patches, patches] attention one layer at a time), counted where it is the peak
    spec = _spec(images=True)
    lay = capacity.layout(spec, catalog.resolve("v6e-8", None))
    phases = capacity.tpu_phases(spec, capacity.shape_of(spec), lay, "v6e")
    tower = model_shapes.vision_shape("hf://google/gemma-3-4b-it")
    scores = vision.rows * tower.heads * tower.patches**2 * 4
    assert phases["vision tower"]["activations"] > scores
    assert vision.terms["activations"] * capacity.GIB >= phases["vision tower"]["activations"]
    full = _estimate(images=True, lora=False)
    assert abs(full.terms["vision tower"] * capacity.GIB - params * 6 / fsdp) < 1


def test_a_trained_tower_adds_its_optimizer_state_gradient_and_activations():
    frozen, trained = _estimate(images=True, lora=False), _estimate(True, False, True)
    params = model_shapes.vision_shape("hf://google/gemma-3-4b-it").params
    fsdp = trained.layout.per_slice
    # float32 master and its cast (6 bytes) + float32 gradient and adam's 2 moments (12)
    assert abs(trained.terms["vision tower"] * capacity.GIB - params * 18 / fsdp) < 1
    assert trained.terms["activations"] > frozen.terms["activations"]
