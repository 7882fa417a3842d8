"""Gemma 3 with its vision tower: image processing and the model against transformers.

The fixture (tests/trainer/fixtures/gemma3-vision/) is a tiny random
Gemma3ForConditionalGeneration, its tokenizer and processor files and a few images, with
goldens that scripts/make_vision_fixtures.py made with transformers' Gemma3Processor and
model: pixel values, token ids and logits of a conversation with one image and of one
with two.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from posttrain.trainer import data
from posttrain.trainer.data import images

pytestmark = pytest.mark.trainer

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3-vision"
TOL = 1e-4  # the text models' logit tolerance
PIXEL_TOL = 1e-6


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(FIXTURE / "golden.npz"))


@pytest.fixture(scope="module")
def conversations():
    return json.loads((FIXTURE / "conversations.json").read_text())


def _processor() -> images.ImageProcessor:
    return images.processor_for(FIXTURE, image_size=32)


@pytest.mark.parametrize("name", ["rgb_50x37", "rgba_20x28", "grey_64x64"])
def test_pixels_match_transformers_processor(name, golden):
    """Resize (bilinear), RGB conversion (RGBA on white, greyscale), rescale, normalise."""
    image = images.load_image(f"images/{name}.png", str(FIXTURE), "row 0", "images")
    pixels = _processor()(image)
    expected = golden[f"pixels_{name}"].transpose(1, 2, 0)  # HF: [C, H, W]
    assert pixels.shape == expected.shape == (32, 32, 3)
    assert pixels.dtype == np.float32
    np.testing.assert_allclose(pixels, expected, atol=PIXEL_TOL, rtol=0)


def test_processor_settings_come_from_the_checkpoint(tmp_path):
    proc = _processor()
    assert (proc.height, proc.width, proc.resample) == (32, 32, 2)
    assert proc.image_mean == proc.image_std == (0.5, 0.5, 0.5)
    # no processor files: the tower's size and Gemma 3's defaults
    assert images.processor_for(tmp_path, image_size=32) == proc
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        images.processor_for(tmp_path, image_size=32)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"height": 64, "width": 64}})
    )
    with pytest.raises(ValueError, match="64x64"):
        images.processor_for(tmp_path, image_size=32)


@pytest.mark.parametrize("key", ["one", "two"])
def test_token_ids_match_transformers_processor(key, golden, conversations):
    """Chat template, then each <start_of_image> expanded into the image's soft tokens
    between begin/end-of-image tokens: the processor's ids exactly."""
    tokenizer = data.load_tokenizer(str(FIXTURE))
    template = tokenizer.template()
    ids, mask, n_images = images.tokenize_with_images(
        tokenizer, template, conversations[key], 16, f"row {key}"
    )
    np.testing.assert_array_equal(ids, golden[f"input_ids_{key}"][0])
    assert n_images == len(golden[f"pixel_values_{key}"])
    soft = tokenizer.token_to_id(images.IMAGE_TOKEN)
    np.testing.assert_array_equal(ids == soft, golden[f"token_type_ids_{key}"][0] == 1)
    # the loss is on the assistant's answer (and its end of turn) only, never an image
    learnt = tokenizer.decode(ids[mask == 1])
    answer = conversations[key][-1]["content"][0]["text"]
    assert learnt.startswith(answer) and learnt[len(answer) :].strip() == "<end_of_turn>"
    image_ids = images.image_token_ids(tokenizer)
    assert not mask[np.isin(ids, image_ids)].any()
    assert np.isin(ids, image_ids).sum() == n_images * 18


def test_whole_conversation_loss_still_skips_images(conversations):
    tokenizer = data.load_tokenizer(str(FIXTURE))
    ids, mask, _ = images.tokenize_with_images(
        tokenizer,
        tokenizer.template(),
        conversations["two"],
        16,
        "row 0",
        completion_only_loss=False,
    )
    image = np.isin(ids, images.image_token_ids(tokenizer))
    assert mask[~image].all() and not mask[image].any()


def test_image_values_of_every_layout(tmp_path, golden):
    """A relative path (resolved against the dataset's directory), an absolute path, raw
    bytes, and datasets' Image feature dict decode to the same pixels."""
    raw = (FIXTURE / "images" / "rgb_50x37.png").read_bytes()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(raw)
    values = [
        "sub/a.png",
        str(tmp_path / "sub" / "a.png"),
        raw,
        {"bytes": raw, "path": None},
        {"bytes": None, "path": "sub/a.png"},
    ]
    expected = golden["pixels_rgb_50x37"].transpose(1, 2, 0)
    base = images.dataset_base(str(tmp_path / "train.jsonl"))
    assert base == str(tmp_path)
    for value in values:
        pixels = _processor()(images.load_image(value, base, "row 0", "images"))
        np.testing.assert_allclose(pixels, expected, atol=PIXEL_TOL, rtol=0)


def test_missing_or_broken_images_name_the_row_and_column(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    where = f"{tmp_path}/train.jsonl:3"
    with pytest.raises(data.DataError, match=r"train\.jsonl:3: column 'images'.*cannot read"):
        images.load_image("missing.png", str(tmp_path), where, "images")
    with pytest.raises(data.DataError, match=r"train\.jsonl:3: column 'images'.*not a decodable"):
        images.load_image("broken.png", str(tmp_path), where, "images")
    with pytest.raises(data.DataError, match=r"column 'images'.*not int"):
        images.load_image(7, str(tmp_path), where, "images")
    buf = io.BytesIO()
    from PIL import Image

    noise = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, format="PNG")
    truncated = buf.getvalue()[: len(buf.getvalue()) // 2]  # a file cut short
    with pytest.raises(data.DataError, match="not a decodable"):
        images.load_image(truncated, str(tmp_path), where, "images")


# ------------------------------------------------------------------------------ model


@pytest.fixture(scope="module")
def loaded():
    import jax.numpy as jnp

    from posttrain.trainer import models

    return models.load_model(FIXTURE, dtype=jnp.float32, vision=True)


def _pixels(golden, key):
    return golden[f"pixel_values_{key}"].transpose(0, 2, 3, 1)[None]  # [1, N, H, W, C]


def test_logits_match_transformers_with_one_and_two_images(loaded, golden):
    """Both conversations in one right-padded batch: the one-image row's image slots are
    padded with a zero image, which no soft token reads."""
    from posttrain.trainer.models import vision

    model, info = loaded
    assert info.vision.tower_prefix == "vision_tower."  # the layout transformers 5 writes
    one, two = golden["input_ids_one"][0], golden["input_ids_two"][0]
    ids = np.zeros((2, len(two)), np.int64)
    ids[0, : len(one)], ids[1] = one, two
    mask = np.arange(len(two))[None] < np.array([[len(one)], [len(two)]])
    pixels = np.zeros((2, 2, 32, 32, 3), np.float32)
    pixels[0, :1], pixels[1] = _pixels(golden, "one")[0], _pixels(golden, "two")[0]
    logits = np.asarray(vision.forward(model, ids, pixels, mask))
    np.testing.assert_allclose(logits[0, : len(one)], golden["logits_one"][0], atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[1], golden["logits_two"][0], atol=TOL, rtol=0)


def test_bfloat16_soft_tokens_merge_in_the_text_dtype(golden):
    """A bfloat16 model's image soft tokens (float32 out of SigLIP) are cast to the text
    embeddings' dtype before Tunix scatters them in (JAX warns of, and will refuse, the
    implicit cast); the logits stay near the float32 ones."""
    import warnings

    import jax.numpy as jnp

    from posttrain.trainer import models
    from posttrain.trainer.models import vision

    model, _ = models.load_model(FIXTURE, dtype=jnp.bfloat16, vision=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        logits = vision.forward(model, golden["input_ids_one"], _pixels(golden, "one"))
    assert float(np.abs(np.asarray(logits) - golden["logits_one"]).max()) < 0.5


def test_image_soft_tokens_attend_both_ways(golden):
    """Without the image blocks (a causal mask only) the logits are off: the mask is what
    makes them match."""
    import jax.numpy as jnp

    from posttrain.trainer.models import vision

    ids = jnp.asarray(golden["input_ids_two"])
    blocks = np.asarray(vision.image_blocks(ids, 8))[0]
    soft = np.asarray(ids[0] == 8)
    assert blocks.sum() == 2 * 16 * 16  # two images, 16 soft tokens each
    assert not blocks[~soft].any() and not blocks[:, ~soft].any()
    first = np.flatnonzero(soft)[:16]
    assert blocks[np.ix_(first, first)].all() and not blocks[first[0], np.flatnonzero(soft)[16]]


def test_causal_mask_alone_does_not_match(loaded, golden, monkeypatch):
    import jax.numpy as jnp

    from posttrain.trainer.models import vision

    model, _ = loaded
    monkeypatch.setattr(
        vision, "image_blocks", lambda t, _: jnp.zeros(t.shape + t.shape[-1:], bool)
    )
    logits = np.asarray(vision.forward(model, golden["input_ids_one"], _pixels(golden, "one")))
    assert np.abs(logits - golden["logits_one"]).max() > 100 * TOL


def test_vision_params_read_only_their_blocks(loaded):
    """The tower's and projector's maps read blocks (make_array_from_callback) exactly."""
    from safetensors.numpy import load_file

    from posttrain.trainer.models import vision

    _, info = loaded
    tensors = load_file(FIXTURE / "model.safetensors")
    maps = vision.param_maps(info.vision, info.hidden_size)
    assert {n for m in maps for n in m.sources} == {
        k for k in tensors if k.startswith(("vision_tower.", "multi_modal_projector."))
    }
    for m in maps:
        full = m.read(tensors.__getitem__, ())
        half = tuple(slice(0, max(1, d // 2)) for d in m.shape)
        np.testing.assert_array_equal(m.read(tensors.__getitem__, half), full[half])
        for name, value in m.to_hf(full).items():
            np.testing.assert_array_equal(value, tensors[name])


def test_images_need_a_vision_tower():
    from posttrain.api import model_shapes
    from posttrain.trainer import models

    text = Path(__file__).parent / "fixtures" / "gemma3"
    with pytest.raises(ValueError, match=r"spec\.data\.columns\.images: .* no vision tower"):
        models.model_info(text, vision=True)
    with pytest.raises(ValueError, match=r"spec\.data\.columns\.images: .* qwen3"):
        models.model_info(text.parent / "qwen3", vision=True)
    assert model_shapes.has_vision_tower(str(FIXTURE)) is True
    assert model_shapes.has_vision_tower(str(text)) is False
    assert model_shapes.has_vision_tower("hf://google/gemma-3-4b-it") is True
    assert model_shapes.has_vision_tower("hf://google/gemma-3-1b-it") is False
    assert model_shapes.has_vision_tower("hf://someone/unknown-model") is None


# ------------------------------------------------------------------------ data and training


def _dataset(tmp_path: Path, rows: list[dict]) -> data.Records:
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return data.open_records(str(tmp_path / "train.jsonl"))


def _colour_rows(image_dir: str = "images") -> list[dict]:
    rows = []
    for name, colour in (("rgb_50x37", "red"), ("rgba_20x28", "green"), ("grey_64x64", "blue")):
        question = [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {
                        "role": "assistant",
                        "content": [{"type": "text", "text": f"It is {colour}."}],
                    },
                ],
                "images": [f"{image_dir}/{name}.png"],
            }
        )
    return rows


def _rows(ds, info, max_length=64):
    from posttrain.api.spec import DataColumns
    from posttrain.trainer.data import image_rows

    tokenizer = data.load_tokenizer(str(FIXTURE))
    batcher = image_rows.ImageBatcher(
        ds,
        tokenizer,
        info.vision,
        images.processor_for(FIXTURE, info.vision.image_size),
        columns=DataColumns(images="images"),
        max_length=max_length,
    )
    return data.Rows(ds, batcher)


@pytest.fixture
def image_dir(tmp_path):
    (tmp_path / "images").symlink_to(FIXTURE / "images")
    return tmp_path


def test_image_rows_batch_text_and_images(image_dir, loaded, golden):
    _, info = loaded
    rows = _rows(_dataset(image_dir, _colour_rows()), info)
    assert len(rows) == 3
    batch = rows.batch(np.array([2, 0]))
    assert batch["input_ids"].shape == (2, 64) and batch["images"].shape == (2, 1, 32, 32, 3)
    np.testing.assert_allclose(
        batch["images"][1, 0], golden["pixels_rgb_50x37"].transpose(1, 2, 0), atol=PIXEL_TOL
    )
    assert list(batch["row_index"]) == [2, 0]
    soft = batch["input_ids"] == info.vision.image_token_id
    assert soft.sum(axis=1).tolist() == [16, 16] and not batch["loss_mask"][soft].any()


def test_image_rows_name_the_row_and_column_of_bad_images(image_dir, loaded):
    _, info = loaded
    rows = _colour_rows()
    rows[1]["images"] = []  # one image part, no image
    with pytest.raises(data.DataError, match=r"train\.jsonl:2: column 'images'.*0 image"):
        _rows(_dataset(image_dir, rows), info).batch([1])
    rows = _colour_rows()
    rows[2]["images"] = ["images/missing.png"]
    source = _rows(_dataset(image_dir, rows), info)
    source.batch(np.array([0, 1]))  # rows of other hosts are never read
    with pytest.raises(data.DataError, match=r"train\.jsonl:3: column 'images'.*missing\.png"):
        source.batch(np.array([2]))
    with pytest.raises(data.DataError, match=r"train\.jsonl:1: spec\.data\.maxLength=20 cuts"):
        _rows(_dataset(image_dir, _colour_rows()), info, max_length=20).batch([0])


def test_full_finetune_on_images_lowers_the_loss_with_the_tower_frozen(image_dir):
    """Through the SFT train step: the projector and the decoder train, the vision tower
    does not move, and the loss falls over a few steps."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from posttrain.trainer import models, sft
    from posttrain.trainer.models import vision

    model, info = models.load_model(FIXTURE, dtype=jnp.float32, vision=True)
    batch = _rows(_dataset(image_dir, _colour_rows()), info).batch(np.arange(3))
    wrt = vision.full_finetune_params()
    tower = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Not(wrt)))]
    assert len(tower) == len(vision.param_maps(info.vision, info.hidden_size)) - 2
    projector = np.asarray(model.embedder.mm_input_projection.w.get_value())
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=wrt)
    step = sft.make_train_step(wrt, 1)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    losses = [float(step(model, opt, batch)[0]) for _ in range(5)]
    assert losses[-1] < 0.8 * losses[0], losses
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Not(wrt)))]
    assert all(np.array_equal(a, b) for a, b in zip(tower, after, strict=True))
    assert not np.array_equal(projector, model.embedder.mm_input_projection.w.get_value())


@pytest.mark.parametrize("train_tower", [False, True])
def test_the_vision_tower_trains_only_when_the_job_asks(image_dir, train_tower):
    """spec.training.trainVisionTower of a full fine-tune, through load_policy and the SFT
    train step: the tower's weights move only when it is set; the projector either way."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tiny_job import tiny_job, validated

    from posttrain.trainer import models, sft
    from posttrain.trainer.policy import load_policy

    doc = tiny_job(FIXTURE, image_dir / "train.jsonl", image_dir / "out", steps=2, every=2)
    doc["spec"]["lora"] = None
    doc["spec"]["data"]["columns"] = {"images": "images"}
    doc["spec"]["training"]["trainVisionTower"] = train_tower
    spec = validated(doc).spec
    policy = load_policy(spec, models.make_mesh(1, 1, jax.devices()[:1]), image_dir)
    model = policy.model
    tower = nnx.state(model, nnx.PathContains("vision_encoder"))
    before = [np.asarray(x) for x in jax.tree.leaves(tower)]
    projector = np.asarray(model.embedder.mm_input_projection.w.get_value())
    batch = _rows(_dataset(image_dir, _colour_rows()), policy.info).batch(np.arange(3))
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=policy.wrt)
    step = sft.make_train_step(policy.wrt, 1)
    step(model, opt, {k: jnp.asarray(v) for k, v in batch.items()})
    tower = nnx.state(model, nnx.PathContains("vision_encoder"))
    after = [np.asarray(x) for x in jax.tree.leaves(tower)]
    moved = [not np.array_equal(a, b) for a, b in zip(before, after, strict=True)]
    assert len(moved) == len(models.vision.param_maps(policy.info.vision, 64)) - 2
    assert all(moved) if train_tower else not any(moved), moved
    assert not np.array_equal(projector, model.embedder.mm_input_projection.w.get_value())


def _policy(image_dir, **spec):
    import jax
    from tiny_job import tiny_job, validated

    from posttrain.trainer import models
    from posttrain.trainer.policy import load_policy

    doc = tiny_job(FIXTURE, image_dir / "train.jsonl", image_dir / "out", steps=2, every=2)
    doc["spec"].update(spec)
    doc["spec"]["data"]["columns"] = {"images": "images"}
    job = validated(doc)
    return load_policy(job.spec, models.make_mesh(1, 1, jax.devices()[:1]), image_dir)


def test_lora_on_the_vision_tower_is_refused(image_dir):
    with pytest.raises(ValueError, match="spec.lora.targetModules: .* selects vision tower"):
        _policy(image_dir, lora={"rank": 4, "alpha": 8, "targetModules": ".*(q_einsum|query_proj)"})


def test_lora_job_with_images_trains_and_exports(image_dir):
    """A PostTrainJob with spec.data.columns.images, validated and run by the trainer
    (LoRA on the decoder, bfloat16 with float32 adapters): the loss falls, a PEFT adapter
    of the language model is exported, and a run resumed from a checkpoint ends bitwise
    the same."""
    from safetensors.numpy import load_file
    from test_vision_export import assert_like_peft_reference
    from tiny_job import run_job, tiny_job

    rows = _colour_rows() * 4
    (image_dir / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    doc = tiny_job(
        FIXTURE,
        image_dir / "train.jsonl",
        image_dir / "out",
        steps=4,
        every=2,
        dtype="bfloat16",
        training={"logEverySteps": 1, "batchSize": 4},
    )
    doc["spec"]["data"]["columns"] = {"images": "images"}
    result = run_job(doc)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert result.step == 4 and losses[-1] < 0.8 * losses[0], losses
    adapter = load_file(image_dir / "out" / "hf" / "adapter_model.safetensors")
    # named as PEFT finds the modules on transformers' Gemma3ForConditionalGeneration
    assert adapter and all(
        k.startswith("base_model.model.model.language_model.layers.") for k in adapter
    )
    assert {v.dtype for v in adapter.values()} == {np.dtype(np.float32)}  # the masters
    # the names, shapes and adapter_config of the adapter peft makes on that model
    assert_like_peft_reference(image_dir / "out" / "hf")
    # exact resume: the run as if it had died after the step-2 checkpoint
    import shutil

    again = image_dir / "again"
    shutil.copytree(image_dir / "out", again)
    for path in (again / "checkpoints" / "4", again / "hf"):
        shutil.rmtree(path)
    (again / "summary.json").unlink(missing_ok=True)
    doc["spec"]["output"]["uri"] = str(again)
    resumed = run_job(doc)
    assert resumed.resumed_from == 2 and resumed.step == 4
    assert resumed.losses == {s: result.losses[s] for s in (3, 4)}
    redone = load_file(again / "hf" / "adapter_model.safetensors")
    assert redone.keys() == adapter.keys()
    assert all(np.array_equal(redone[k], adapter[k]) for k in adapter)


def test_save_hf_writes_a_gemma3_for_conditional_generation(loaded, golden, tmp_path):
    """The merged export keeps the vision tower: transformers' module layout and the
    source's multimodal config (transformers loads it and reproduces the JAX logits of a
    merged LoRA, checked by hand: 1.3e-5); it loads back with the same logits."""
    from safetensors.numpy import load_file

    from posttrain.trainer import models
    from posttrain.trainer.models import vision
    from posttrain.trainer.models.saving import save_hf

    model, info = loaded
    out = save_hf(model, tmp_path / "hf", info)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert cfg["text_config"]["model_type"] == "gemma3_text" and "vision_config" in cfg
    names = set(load_file(out / "model.safetensors"))
    assert "model.vision_tower.vision_model.embeddings.patch_embedding.weight" in names
    assert "model.multi_modal_projector.mm_input_projection_weight" in names
    assert all(
        n.startswith(("model.language_model.", "model.vision_tower.", "model.mu")) for n in names
    )
    assert (out / "processor_config.json").is_file()
    again, _ = models.load_model(out, vision=True)
    logits = np.asarray(vision.forward(again, golden["input_ids_one"], _pixels(golden, "one")))
    np.testing.assert_allclose(logits, golden["logits_one"], atol=TOL, rtol=0)


_MESH_CHECK = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np, jax
from posttrain.trainer import models
from posttrain.trainer.models import vision
fixture = sys.argv[1]
g = np.load(fixture + "/golden.npz")
mesh = models.make_mesh(2, 2)
m, info = models.load_model(fixture, vision=True, mesh=mesh)
kernel = m.vision_encoder.siglip_encoder.transformer.blocks[0].mlp.fc1.kernel.get_value()
ids = np.concatenate([g["input_ids_one"]] * 4)
pixels = np.concatenate([g["pixel_values_one"].transpose(0, 2, 3, 1)[None]] * 4)
with jax.set_mesh(mesh):
    logits = np.asarray(vision.forward(m, ids, pixels))
print("RESULT" + json.dumps({
    "diff": float(np.abs(logits - g["logits_one"]).max()),
    "shard": list(kernel.addressable_shards[0].data.shape),
    "shape": list(kernel.shape),
}))
"""


def test_vision_tower_sharded_over_four_devices():
    """On a 2 x 2 mesh (4 CPU devices, in a subprocess: XLA_FLAGS must come before jax)
    the tower's params are sharded by Tunix's annotations and the logits still match."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _MESH_CHECK, str(FIXTURE)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, proc.stderr[-3000:]
    result = json.loads(line[len("RESULT") :])
    assert result["diff"] < TOL
    assert result["shard"] != result["shape"]  # each device holds a block


def test_vision_checkpoint_on_gcs_reads_blocks_in_place(tmp_path, caplog, golden):
    """A gs:// source (a real GCS-compatible server): the small files (config, tokenizer,
    processor) are copied, the vision tower's weights too are read in place, ranged."""
    import re

    from posttrain.trainer import sources, storage
    from posttrain.trainer.models import vision
    from tests.trainer.data_helpers import gcs_bucket

    with gcs_bucket("ptvision") as bucket:
        storage.upload_dir(FIXTURE, f"{bucket}/gemma3-vision")
        with caplog.at_level("INFO", logger="posttrain.trainer.models"):
            model, info = sources.load_model_source(
                f"{bucket}/gemma3-vision", tmp_path, vision=True
            )
    fetched, total = map(int, re.search(r"fetched (\d+) of the (\d+) bytes", caplog.text).groups())
    assert 0 < fetched <= total
    copied = {p.name for p in Path(info.model_dir).iterdir()}
    assert {"config.json", "processor_config.json"} <= copied
    assert not any(n.endswith(".safetensors") for n in copied)
    logits = np.asarray(vision.forward(model, golden["input_ids_one"], _pixels(golden, "one")))
    np.testing.assert_allclose(logits, golden["logits_one"], atol=TOL, rtol=0)


def test_vision_checkpoint_from_the_hub(tmp_path, monkeypatch, golden):
    """An hf:// source: what the trainer asks the Hub for (sources.HF_FILES) holds all a
    vision job reads: the weights with the tower's, the processor's settings and the
    tokenizer; the PyTorch copy a repository may hold too is not fetched. No network here:
    the Hub is a directory that the replaced snapshot_download copies from by pattern."""
    import fnmatch
    import shutil

    import huggingface_hub

    from posttrain.trainer import sources
    from posttrain.trainer.models import vision

    hub = tmp_path / "hub"
    shutil.copytree(FIXTURE, hub)
    (hub / "pytorch_model.bin").write_bytes(b"not read")

    def snapshot_download(repo_id, *, revision, cache_dir, allow_patterns):
        assert repo_id == "posttrain/tiny-gemma3-vision" and revision is None
        out = Path(cache_dir) / "snapshot"
        for path in hub.rglob("*"):
            name = str(path.relative_to(hub))
            if path.is_file() and any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, out / name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(sources, "HF_CACHE", tmp_path / "cache")
    model, info = sources.load_model_source(
        "hf://posttrain/tiny-gemma3-vision", tmp_path, vision=True
    )
    assert not (Path(info.model_dir) / "pytorch_model.bin").exists()
    logits = np.asarray(vision.forward(model, golden["input_ids_one"], _pixels(golden, "one")))
    np.testing.assert_allclose(logits, golden["logits_one"], atol=TOL, rtol=0)
    processor = images.processor_for(info.model_dir, info.vision.image_size)
    pixels = processor(images.load_image("images/rgb_50x37.png", str(FIXTURE), "row 0", "images"))
    np.testing.assert_allclose(
        pixels, golden["pixels_rgb_50x37"].transpose(1, 2, 0), atol=PIXEL_TOL
    )
    tokenizer = data.load_tokenizer(info.model_dir)
    assert images.image_token_ids(tokenizer)[1] == info.vision.image_token_id
