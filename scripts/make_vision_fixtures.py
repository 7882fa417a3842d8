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
  processor's ``pixel_values`` of every image alone (``pixels_<name>``);
- ``peft_adapter/``: a LoRA adapter that ``peft`` made on the transformers model (rank 4,
  alpha 8, the language model's projections, random nonzero ``lora_B``; ``lora_A`` equal
  for k_proj and v_proj, which posttrain's Gemma holds as one fused projection), and
  ``peft_golden.npz``: ``peft``'s logits with it for the one-image conversation
  (``logits_one``, its last ``PEFT_POSITIONS`` positions) and for a text-only prompt
  (``input_ids_text``, ``logits_text``);
- ``transformers_layout.json``: the transformers model's ``state_dict`` names and shapes
  and its ``nn.Linear`` module names (what a merged export must fill and what PEFT's
  ``target_modules`` select from).

torch, transformers and peft are not in the project's venv; run this with a venv that has
torch, transformers (5.x), peft and Pillow:

    /tmp/peftvenv/bin/python scripts/make_vision_fixtures.py           # everything
    /tmp/peftvenv/bin/python scripts/make_vision_fixtures.py --peft    # peft_* and the layout
    # a merged export of posttrain loads into transformers with no missing or unexpected
    # tensors and reproduces the JAX logits saved next to it (merged_logits_one.npy):
    /tmp/peftvenv/bin/python scripts/make_vision_fixtures.py --check-merged DIR

CI only reads the committed files (tests/trainer/test_vision.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from make_hf_fixtures import FAMILIES, SEED, TINY_DECODER, randomize

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "trainer" / "fixtures" / "gemma3-vision"
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 16
PEFT_RANK, PEFT_ALPHA, PEFT_POSITIONS = 4, 8, 16
# PEFT's target_modules of the reference: the language model's projections only
PEFT_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
TEXT_PROMPT = [{"role": "user", "content": [{"type": "text", "text": "What shape is it?"}]}]

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


def _resolved(messages: list[dict]) -> list[dict]:
    return [
        {
            **m,
            "content": [
                {**part, "image": str(OUT / part["image"])} if part["type"] == "image" else part
                for part in m["content"]
            ],
        }
        for m in messages
    ]


def make_peft_reference() -> None:
    """peft_adapter/, peft_golden.npz and transformers_layout.json (see the docstring)."""
    import shutil

    import peft
    import torch
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        OUT, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    layout = {
        "state_dict": {k: list(v.shape) for k, v in model.state_dict().items()},
        "linear_modules": sorted(
            n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        ),
    }
    (OUT / "transformers_layout.json").write_text(json.dumps(layout, indent=1) + "\n")
    config = peft.LoraConfig(
        r=PEFT_RANK,
        lora_alpha=PEFT_ALPHA,
        target_modules=PEFT_TARGETS,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(SEED)  # peft's lora_A init
    lora = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, module in lora.named_modules():
            if not isinstance(module, peft.tuners.lora.LoraLayer) or "k_proj" in name:
                continue
            b = module.lora_B["default"].weight
            b.copy_(0.3 * torch.randn(b.shape, generator=gen) / PEFT_RANK**0.5)
            if name.endswith("v_proj"):  # k and v share lora_A (fused in posttrain)
                k = lora.get_submodule(name.removesuffix("v_proj") + "k_proj")
                k.lora_A["default"].weight.copy_(module.lora_A["default"].weight)
                kb = k.lora_B["default"].weight
                kb.copy_(0.3 * torch.randn(kb.shape, generator=gen) / PEFT_RANK**0.5)
    lora.eval()
    target = OUT / "peft_adapter"
    shutil.rmtree(target, ignore_errors=True)
    lora.save_pretrained(target)
    saved = json.loads((target / "adapter_config.json").read_text())
    saved["base_model_name_or_path"] = "posttrain-fixtures/tiny-gemma3-vision"  # not this path
    (target / "adapter_config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    (target / "README.md").unlink(missing_ok=True)

    processor = transformers.AutoProcessor.from_pretrained(OUT)
    golden: dict[str, np.ndarray] = {}
    image_inputs = processor.apply_chat_template(
        _resolved(CONVERSATIONS["one"]), tokenize=True, return_dict=True, return_tensors="pt"
    )
    text_inputs = processor.apply_chat_template(
        TEXT_PROMPT, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        with_image = lora(**image_inputs).logits.float().numpy()
        with lora.disable_adapter():
            without = lora(**image_inputs).logits.float().numpy()
        text = lora(
            input_ids=text_inputs["input_ids"], attention_mask=text_inputs["attention_mask"]
        ).logits
    golden["logits_one"] = with_image[:, -PEFT_POSITIONS:]
    golden["input_ids_text"] = text_inputs["input_ids"].numpy()
    golden["logits_text"] = text.float().numpy()
    np.savez(OUT / "peft_golden.npz", **golden)
    moved = float(np.abs(with_image - without).max())
    size = sum(f.stat().st_size for f in [*target.iterdir(), OUT / "peft_golden.npz"])
    print(
        f"peft {peft.__version__}: {sum('lora_' in k for k in lora.state_dict())} adapter "
        f"tensors; the adapter moves the image prompt's logits by {moved:.2f}; "
        f"peft_adapter + peft_golden.npz {size / 1024:.0f} KiB"
    )


def check_merged(directory: Path) -> int:
    """A posttrain merged export of this fixture loads into transformers with no missing or
    unexpected tensors and gives the JAX logits saved as ``merged_logits_one.npy``."""
    import torch
    import transformers

    model, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    processor = transformers.AutoProcessor.from_pretrained(OUT)
    inputs = processor.apply_chat_template(
        _resolved(CONVERSATIONS["one"]), tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = model.eval()(**inputs).logits.float().numpy()
    diff = float(np.abs(logits - np.load(directory / "merged_logits_one.npy")).max())
    ok = not problems and diff < 1e-4
    print(
        f"transformers load: {problems or 'all tensors'}; max|diff| {diff:.2e} {'ok' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--peft", action="store_true", help="only the peft reference")
    group.add_argument("--check-merged", type=Path, metavar="DIR")
    args = parser.parse_args()
    if args.check_merged:
        return check_merged(args.check_merged)
    if not args.peft:
        make_fixture()
    make_peft_reference()
    return 0


def make_fixture() -> None:
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
        resolved = _resolved(messages)
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


if __name__ == "__main__":
    raise SystemExit(main())
