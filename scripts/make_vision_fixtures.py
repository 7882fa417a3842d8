"""Builds the tiny Gemma 3 vision fixture and its goldens under tests/trainer/fixtures/gemma3-vision/.

A random fp32 ``Gemma3ForConditionalGeneration`` (a 2-layer SigLIP vision tower on 32x32
images with 4x4 patches, pooled to 16 soft tokens per image, and a 2-layer Gemma 3 text
model), saved with ``save_pretrained`` as safetensors, with:

- a small byte-level BPE tokenizer with Gemma 3's special tokens (``<start_of_turn>``,
  ``<start_of_image>``, ``<image_soft_token>``, ...) and Gemma 3's chat template;
- the processor files (``preprocessor_config.json``, ``processor_config.json``) that
  ``transformers``' ``Gemma3Processor`` writes (its PIL image backend);
- a few small images in ``images/`` (RGB of odd sizes, RGBA, greyscale);
- ``golden.npz``: for a conversation with one image and one with two, the processor's
  ``input_ids``, ``token_type_ids`` and ``pixel_values``, and the model's logits; and the
  processor's ``pixel_values`` of every image alone (``pixels_<name>``).

torch and transformers are not in the project's venv; run this with a venv that has
torch, transformers (5.x) and Pillow:

    /tmp/peftvenv/bin/python scripts/make_vision_fixtures.py

CI only reads the committed files (tests/trainer/test_vision.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from make_hf_fixtures import FAMILIES, SEED, TINY_DECODER, randomize

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "trainer" / "fixtures" / "gemma3-vision"
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 16

SPECIAL = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

# Gemma 3's chat template (image parts become <start_of_image>; the processor expands it).
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

_CORPUS = [
    "What colour is the shape? It is red. It is green. It is blue. It is yellow.",
    "What shape is it? A circle. A square. A triangle.",
    "How many shapes are there? one two three four",
    "Describe the image. Compare the two images. The first is larger than the second.",
    "user model system You are a helpful assistant. Answer with one word.",
]

# The conversations of the goldens (image parts name files under images/).
CONVERSATIONS = {
    "one": [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "images/rgb_50x37.png"},
                {"type": "text", "text": "What colour is the shape?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]},
    ],
    "two": [
        {"role": "system", "content": [{"type": "text", "text": "Answer with one word."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare the two images."},
                {"type": "image", "image": "images/rgba_20x28.png"},
                {"type": "image", "image": "images/grey_64x64.png"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "The first is larger."}]},
    ],
}


def make_images(out: Path) -> dict[str, Path]:
    from PIL import Image

    rng = np.random.default_rng(SEED)
    out.mkdir(parents=True, exist_ok=True)
    made = {}
    specs = {"rgb_50x37": ("RGB", (50, 37)), "rgba_20x28": ("RGBA", (20, 28))}
    specs["grey_64x64"] = ("L", (64, 64))
    for name, (mode, (w, h)) in specs.items():
        channels = len(mode)
        yy, xx = np.mgrid[0:h, 0:w]
        base = (yy * 255 // max(h - 1, 1) + xx * 3) % 256  # gradients + noise: resize matters
        pixels = np.stack([(base + 80 * c) % 256 for c in range(channels)], axis=-1)
        pixels = np.clip(pixels + rng.integers(-30, 30, pixels.shape), 0, 255).astype(np.uint8)
        if mode == "RGBA":
            pixels[..., 3] = np.where(xx < w // 2, 255, 90)  # half opaque, half translucent
        image = Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)
        path = out / f"{name}.png"
        image.save(path)
        made[name] = path
    return made


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": 4096,
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {t: tok.token_to_id(t) for t in SPECIAL}, tok.get_vocab_size()


def hf_model(ids: dict[str, int]):
    import torch
    import transformers

    decoder = {**TINY_DECODER, **FAMILIES["gemma3"][1]}  # the gemma3 fixture's, larger:
    decoder.update(
        vocab_size=384,
        max_position_embeddings=512,
        # shorter than the inputs, not shorter than an image's 16 soft tokens (which
        # attend to each other both ways)
        sliding_window=16,
    )
    text = transformers.Gemma3TextConfig(
        **decoder,
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        vision_use_head=False,
        layer_norm_eps=1e-6,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    torch.manual_seed(SEED)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)

    def init(name, p, noise):
        if "vision_tower" in name and "norm" in name:  # LayerNorm: w * x + b
            return (1.0 + 0.2 * noise) if name.endswith("weight") else 0.2 * noise
        if name.endswith(("norm.weight", ".bias")):  # Gemma RMSNorm: (1 + w) * x
            return 0.2 * noise
        if "embed_tokens" in name or "position_embedding" in name:
            return 0.25 * noise
        if name.endswith("mm_input_projection_weight"):  # [vision, text]
            return noise / p.shape[0] ** 0.5
        if "patch_embedding" in name:  # [out, in, kh, kw]
            return noise / (p[0].numel()) ** 0.5
        return noise / p.shape[-1] ** 0.5

    randomize(model, init)
    model.config._attn_implementation = "eager"
    return model.eval()


def main() -> int:
    import torch
    import transformers
    from PIL import Image

    OUT.mkdir(parents=True, exist_ok=True)
    for stale in OUT.glob("*.safetensors"):
        stale.unlink()
    images = make_images(OUT / "images")
    ids, n_tokens = make_tokenizer(OUT)
    tokenizer = transformers.AutoTokenizer.from_pretrained(OUT)
    assert tokenizer.image_token_id == ids["<image_soft_token>"], tokenizer.image_token_id
    image_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    processor.save_pretrained(OUT)
    model = hf_model(ids)
    model.save_pretrained(OUT, safe_serialization=True)
    (OUT / "generation_config.json").unlink(missing_ok=True)

    golden: dict[str, np.ndarray] = {}
    for name, path in images.items():
        pix = image_processor(Image.open(path), return_tensors="np")["pixel_values"]
        golden[f"pixels_{name}"] = pix[0].astype(np.float32)  # [C, H, W]
    for key, messages in CONVERSATIONS.items():
        resolved = [
            {
                **m,
                "content": [
                    {**part, "image": str(OUT / part["image"])} if part["type"] == "image" else part
                    for part in m["content"]
                ],
            }
            for m in messages
        ]
        inputs = processor.apply_chat_template(
            resolved, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            logits = model(**inputs).logits.float().numpy()
        golden[f"input_ids_{key}"] = inputs["input_ids"].numpy()
        golden[f"token_type_ids_{key}"] = inputs["token_type_ids"].numpy()
        golden[f"pixel_values_{key}"] = inputs["pixel_values"].numpy().astype(np.float32)
        golden[f"logits_{key}"] = logits
        # the same ids with the image soft tokens' embeddings left out: shows the images count
        with torch.no_grad():
            text_only = model(
                input_ids=inputs["input_ids"],
                pixel_values=torch.zeros_like(inputs["pixel_values"]),
                token_type_ids=inputs["token_type_ids"],
            ).logits.float()
        moved = float((text_only - torch.from_numpy(logits)).abs().max())
        print(
            f"{key}: ids {tuple(inputs['input_ids'].shape)}, pixels "
            f"{tuple(inputs['pixel_values'].shape)}, |logits| {np.abs(logits).max():.2f}, "
            f"a zero image moves logits by {moved:.2f}"
        )
    (OUT / "conversations.json").write_text(json.dumps(CONVERSATIONS, indent=2) + "\n")
    np.savez(OUT / "golden.npz", **golden)
    size = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"tokenizer: {n_tokens} tokens {ids}; fixture {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
