"""Images for Gemma 3 vision SFT: reading them from a dataset, and processing them as
``transformers``' ``Gemma3Processor`` does.

Processing (``ImageProcessor``): RGB conversion (transparency composited on white),
resize to the tower's square size with Pillow's filter (bilinear by default), rescale by
1/255, normalise by the mean and std, channels last ``[H, W, C]`` float32 — the settings
come from the checkpoint's ``processor_config.json`` / ``preprocessor_config.json`` when
it has them, else from config.json's vision tower. Pan-and-scan crops are not supported.

Text (``expand_image_tokens``): the chat template writes ``<start_of_image>`` where an
image part is; each becomes ``\\n\\n<start_of_image>`` + the soft-token placeholder
repeated ``mm_tokens_per_image`` times + ``<end_of_image>\\n\\n``, which the model fills
with the image's embeddings.

Reading (``load_image``): a column value is a path (relative paths resolve against the
dataset's directory), a ``gs://`` URI, raw bytes, or a ``datasets`` ``Image`` feature
(``{"bytes": ..., "path": ...}``). A missing or undecodable image is a ``DataError``
naming the row and the column (the trainer exits 65).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.trainer import storage

BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
IMAGE_TOKEN = "<image_soft_token>"

# PIL resampling filters by the numbers transformers stores (PILImageResampling).
_RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


def _data_error(message: str) -> Exception:
    from posttrain.trainer.data.errors import DataError

    return DataError(message)


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    """Gemma 3's image preprocessing (without pan-and-scan)."""

    height: int
    width: int
    resample: int = 2  # PIL BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_settings(cls, settings: dict, image_size: int) -> ImageProcessor:
        """From a ``preprocessor_config.json``-style dict (``image_size`` when it says no size)."""
        if settings.get("do_pan_and_scan"):
            raise ValueError("spec.model: the processor's do_pan_and_scan is not supported")
        size = settings.get("size") or {}
        height = int(size.get("height") or size.get("shortest_edge") or image_size)
        width = int(size.get("width") or size.get("shortest_edge") or image_size)
        if (height, width) != (image_size, image_size):
            raise ValueError(
                f"spec.model: the processor resizes to {height}x{width}, the vision tower "
                f"takes {image_size}x{image_size}"
            )
        resample = int(settings.get("resample", 2))
        if resample not in _RESAMPLE_NAMES:
            raise ValueError(f"spec.model: the processor's resample={resample} is unknown")

        def triple(value: Any, default: tuple[float, ...]) -> tuple[float, ...]:
            if value is None:
                return default
            values = value if isinstance(value, (list, tuple)) else [value] * 3
            return tuple(float(v) for v in values)

        flag = lambda name: bool(settings.get(name, True))  # noqa: E731
        return cls(
            height=height,
            width=width,
            resample=resample,
            rescale_factor=float(settings.get("rescale_factor", 1 / 255)),
            image_mean=triple(settings.get("image_mean"), (0.5, 0.5, 0.5)),
            image_std=triple(settings.get("image_std"), (0.5, 0.5, 0.5)),
            do_convert_rgb=settings.get("do_convert_rgb") is not False,
            do_resize=flag("do_resize"),
            do_rescale=flag("do_rescale"),
            do_normalize=flag("do_normalize"),
        )

    def __call__(self, image: Any) -> np.ndarray:
        """A PIL image -> float32 ``[H, W, C]`` pixels."""
        from PIL import Image

        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            resample = getattr(Image.Resampling, _RESAMPLE_NAMES[self.resample])
            image = image.resize((self.width, self.height), resample=resample)
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[..., None]
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)
            std = np.asarray(self.image_std, np.float32)
            pixels = (pixels - mean) / std
        return np.ascontiguousarray(pixels, dtype=np.float32)


def to_rgb(image: Any) -> Any:
    """RGB, with any transparency composited onto white (as transformers does)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def processor_settings(model_dir: str | os.PathLike) -> dict:
    """The image processor's settings saved with the checkpoint ({} when there are none)."""
    root = Path(model_dir)
    proc = root / "processor_config.json"
    if proc.is_file():
        data = json.loads(proc.read_text())
        if isinstance(data.get("image_processor"), dict):
            return data["image_processor"]
    pre = root / "preprocessor_config.json"
    if pre.is_file():
        return json.loads(pre.read_text())
    return {}


def processor_for(model_dir: str | os.PathLike, image_size: int) -> ImageProcessor:
    return ImageProcessor.from_settings(processor_settings(model_dir), image_size)


def image_sequence(tokens_per_image: int) -> str:
    """What one ``<start_of_image>`` of a rendered conversation becomes."""
    return f"\n\n{BOI_TOKEN}{IMAGE_TOKEN * tokens_per_image}{EOI_TOKEN}\n\n"


def expand_image_tokens(text: str, tokens_per_image: int) -> str:
    """Each ``<start_of_image>`` of ``text`` -> the image's soft-token sequence."""
    return text.replace(BOI_TOKEN, image_sequence(tokens_per_image))


def count_image_parts(messages: Sequence[dict[str, Any]]) -> int:
    """The ``{"type": "image"}`` content parts of a conversation."""
    n = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            n += sum(
                1 for part in content if isinstance(part, dict) and part.get("type") == "image"
            )
    return n


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


def image_bytes(value: Any, base: str, where: str, column: str) -> bytes:
    """The encoded bytes of one image of a data column (see the module doc)."""
    if isinstance(value, dict):  # datasets' Image feature: {"bytes": b"...", "path": "..."}
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, str) or not value:
        raise _data_error(
            f"{where}: column {column!r}: an image must be a path, a gs:// URI, bytes or "
            f"{{'bytes': ..., 'path': ...}}, not {type(value).__name__}"
        )
    uri = value
    if not storage.is_gcs(uri) and not os.path.isabs(uri):
        uri = storage.join(base, uri)
    try:
        return storage.read_bytes(uri)
    except (OSError, ValueError) as e:
        raise _data_error(
            f"{where}: column {column!r}: cannot read image {value!r} ({storage.root_cause(e)})"
        ) from e


def decode_image(data: bytes, where: str, column: str) -> Any:
    """A PIL image from encoded bytes, decoded now (so a broken file fails here)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise _data_error(f"{where}: column {column!r}: not a decodable image ({e})") from e
    return image


def load_image(value: Any, base: str, where: str, column: str) -> Any:
    return decode_image(image_bytes(value, base, where, column), where, column)


def dataset_base(source: str) -> str:
    """The directory that relative image paths of a dataset resolve against."""
    if storage.is_gcs(source):
        if source.endswith("/") or "." not in storage.basename(source):
            return source.rstrip("/")
        return source.rsplit("/", 1)[0]
    path = Path(source)
    return str(path if path.is_dir() else path.parent)


# ---------------------------------------------------------------------------------------
# Conversations with images -> token ids and loss mask
# ---------------------------------------------------------------------------------------


def expand_with_spans(
    text: str, spans: Sequence[tuple[int, int]], tokens_per_image: int
) -> tuple[str, list[tuple[int, int]], int]:
    """``expand_image_tokens`` of ``text``, the character ``spans`` moved with it, and the
    number of images the text holds."""
    grow = len(image_sequence(tokens_per_image)) - len(BOI_TOKEN)
    starts, pos = [], text.find(BOI_TOKEN)
    while pos >= 0:
        starts.append(pos)
        pos = text.find(BOI_TOKEN, pos + len(BOI_TOKEN))

    def moved(i: int) -> int:
        return i + grow * sum(1 for s in starts if s < i)

    return (
        expand_image_tokens(text, tokens_per_image),
        [(moved(a), moved(b)) for a, b in spans],
        len(starts),
    )


def image_token_ids(tokenizer: Any) -> tuple[int, int, int]:
    """(begin-of-image, soft token, end-of-image) ids of the tokenizer."""
    ids = tuple(tokenizer.token_to_id(t) for t in (BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN))
    if any(i is None for i in ids):
        raise _data_error(
            f"{tokenizer.origin}: the tokenizer lacks Gemma 3's image tokens "
            f"({BOI_TOKEN}, {IMAGE_TOKEN}, {EOI_TOKEN})"
        )
    return ids  # type: ignore[return-value]


def tokenize_with_images(
    tokenizer: Any,
    template: Any,
    conversation: list[dict[str, Any]],
    tokens_per_image: int,
    where: str,
    *,
    completion_only_loss: bool = True,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Token ids, loss mask and image count of one conversation whose messages may hold
    ``{"type": "image"}`` parts. The loss is on the assistant turns only (everything
    when ``completion_only_loss`` is false), and never on an image's tokens (begin,
    soft tokens, end)."""
    from posttrain.trainer.data.formatting import render_conversation
    from posttrain.trainer.data.tokenizing import encoding_span_mask

    text, spans, _ = render_conversation(template, conversation, where)
    text, spans, n_images = expand_with_spans(text, spans, tokens_per_image)
    enc = tokenizer.encode_batch([text])[0]
    ids = np.asarray(enc.ids, dtype=np.int32)
    if completion_only_loss:
        mask = encoding_span_mask(enc, spans)
    else:
        mask = np.ones(len(ids), dtype=np.int32)
    mask = np.where(np.isin(ids, image_token_ids(tokenizer)), 0, mask).astype(np.int32)
    return ids, mask, n_images
