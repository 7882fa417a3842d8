"""Rows of multimodal SFT (``spec.data.columns.images``): chat conversations with image
parts, tokenized with each image's soft tokens, and the images themselves.

Tokenizing happens up front (every host, all rows: it is cheap); images are read and
processed only when a batch needs them, so each host fetches only the images of its own
rows. A batch holds, besides the text rows' ``input_ids`` / ``loss_mask`` /
``segment_ids`` / ``positions`` ([b, max_length], one example a row, no packing),
``images``: float32 ``[b, max_images, H, W, C]``, each row's images in the order of its
image parts, padded with zeros at the end (the padding is never looked at: a row has as
many soft-token runs as it has images).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from posttrain.trainer.data import images
from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.formatting import sft_conversations
from posttrain.trainer.data.reading import RawDataset
from posttrain.trainer.data.tokenizer import Tokenizer
from posttrain.trainer.models.vision import VisionInfo

Batch = dict[str, np.ndarray]


def _image_values(value: Any) -> list[Any]:
    if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class ImageSftRows:
    """One conversation with its images a row (see the module doc)."""

    def __init__(
        self,
        ds: RawDataset,
        tokenizer: Tokenizer,
        vision: VisionInfo,
        processor: images.ImageProcessor,
        *,
        columns: Any,
        max_length: int,
        completion_only_loss: bool = True,
        chat_template: str | None = None,
    ) -> None:
        self.ds = ds
        self.column = columns.images
        self.vision = vision
        self.processor = processor
        self.max_length = max_length
        self.pad_id = int(tokenizer.pad_id)
        self.base = images.dataset_base(ds.source)
        ds.require(self.column, "images")
        template = tokenizer.template(chat_template)
        soft = images.image_token_ids(tokenizer)[1]
        if soft != vision.image_token_id:
            raise DataError(
                f"{tokenizer.origin}: the tokenizer's {images.IMAGE_TOKEN} is id {soft}, "
                f"config.json's image_token_index is {vision.image_token_id}"
            )
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._images: list[list[Any]] = []
        self._rows: list[int] = []
        for i, conv in enumerate(sft_conversations(ds, columns)):
            where = ds.where(i)
            ids, mask, n = images.tokenize_with_images(
                tokenizer,
                template,
                conv,
                vision.tokens_per_image,
                where,
                completion_only_loss=completion_only_loss,
            )
            values = _image_values(ds.rows[i].get(self.column)) if n else []
            values = [v for v in values if v is not None]
            if len(values) != n:
                raise DataError(
                    f"{where}: column {self.column!r} (spec.data.columns.images) holds "
                    f"{len(values)} image(s), the messages have {n} image part(s)"
                )
            if len(ids) > max_length:
                cut = ids[max_length:]
                if np.isin(cut, images.image_token_ids(tokenizer)).any():
                    raise DataError(
                        f"{where}: spec.data.maxLength={max_length} cuts into an image's "
                        f"{vision.tokens_per_image} tokens ({len(ids)} tokens); raise maxLength"
                    )
                ids, mask = ids[:max_length], mask[:max_length]
            if not mask.any():
                continue
            self._ids.append(ids)
            self._mask.append(mask)
            self._images.append(values)
            self._rows.append(i)
        if not self._rows:
            raise DataError(
                f"{ds.source}: no example has completion tokens within spec.data.maxLength="
                f"{max_length}; raise maxLength"
            )
        self.max_images = max(1, max(len(v) for v in self._images))

    def __len__(self) -> int:
        return len(self._rows)

    def example_ids(self, row: int) -> tuple[int, ...]:
        return (self._rows[row],)

    def pixels(self, row: int) -> list[np.ndarray]:
        """The processed images of a row (read now: missing or broken ones fail here,
        naming the row and the column)."""
        where = self.ds.where(self._rows[row])
        return [
            self.processor(images.load_image(v, self.base, where, self.column))
            for v in self._images[row]
        ]

    def batch(self, rows: np.ndarray) -> Batch:
        b, length, side = len(rows), self.max_length, self.vision.image_size
        ids = np.full((b, length), self.pad_id, dtype=np.int32)
        mask = np.zeros((b, length), dtype=np.int32)
        seg = np.zeros((b, length), dtype=np.int32)
        pos = np.zeros((b, length), dtype=np.int32)
        pix = np.zeros((b, self.max_images, side, side, self.vision.num_channels), np.float32)
        for r, row in enumerate(rows):
            row = int(row)
            n = len(self._ids[row])
            ids[r, :n] = self._ids[row]
            mask[r, :n] = self._mask[row]
            seg[r, :n] = 1
            pos[r, :n] = np.arange(n, dtype=np.int32)
            for j, image in enumerate(self.pixels(row)):
                pix[r, j] = image
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "segment_ids": seg,
            "positions": pos,
            "images": pix,
        }


def rows_from_spec(spec: Any, tokenizer: Tokenizer, ds: RawDataset) -> ImageSftRows:
    """The rows of a PostTrainJobSpec with spec.data.columns.images: the vision settings
    and the image processor come from the model directory the tokenizer was read from."""
    from posttrain.trainer import models
    from posttrain.trainer.models import vision

    config = models.read_hf_config(tokenizer.origin)
    family = models.detect_family(tokenizer.origin)
    vi = vision.require_vision_info(config, family, tokenizer.origin)
    if spec.data.packing:
        raise DataError("spec.data.packing: rows with images are not packed; set packing to false")
    return ImageSftRows(
        ds,
        tokenizer,
        vi,
        images.processor_for(tokenizer.origin, vi.image_size),
        columns=spec.data.columns,
        max_length=spec.data.max_length,
        completion_only_loss=spec.data.completion_only_loss,
        chat_template=spec.data.chat_template,
    )
