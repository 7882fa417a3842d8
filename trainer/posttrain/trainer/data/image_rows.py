"""Rows of multimodal SFT (``spec.data.columns.images``): chat conversations with image
parts, tokenized with each image's soft tokens, and the images themselves.

Rows are tokenized and their images read and processed only when a batch needs them,
so each host fetches only the images of its own rows. A batch holds, besides the text rows' ``input_ids`` / ``loss_mask`` /
``segment_ids`` / ``positions`` ([b, max_length], one example a row, no packing),
``images``: float32 ``[b, max_images, H, W, C]`` (max_images: the most images a row of
the step's global batch holds, the same on every host), each row's images in the order
of its image parts, padded with zeros at the end (the padding is never looked at: a row has as
many soft-token runs as it has images).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain.trainer.data import images
from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.formatting import Where, sft_conversation, uses_messages
from posttrain.trainer.data.reading import Row
from posttrain.trainer.data.tokenizer import Tokenizer
from posttrain.trainer.models.vision import VisionInfo

Batch = dict[str, np.ndarray]


def _image_values(value: Any) -> list[Any]:
    if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class ImageBatcher:
    """One conversation with its images a row (see the module doc)."""

    def __init__(
        self,
        records: Any,
        tokenizer: Tokenizer,
        vision: VisionInfo,
        processor: images.ImageProcessor,
        *,
        columns: Any,
        max_length: int,
        completion_only_loss: bool = True,
        chat_template: str | None = None,
    ) -> None:
        self.columns = columns
        self.column = columns.images
        self.tokenizer = tokenizer
        self.vision = vision
        self.processor = processor
        self.max_length = max_length
        self.completion_only_loss = completion_only_loss
        self.pad_id = int(tokenizer.pad_id)
        self.base = images.dataset_base(records.source)
        records.require(self.column, "images")
        self.messages = uses_messages(records, columns)
        self.template = tokenizer.template(chat_template)
        soft = images.image_token_ids(tokenizer)[1]
        if soft != vision.image_token_id:
            raise DataError(
                f"{tokenizer.origin}: the tokenizer's {images.IMAGE_TOKEN} is id {soft}, "
                f"config.json's image_token_index is {vision.image_token_id}"
            )

    def image_count(self, row: Row) -> int:
        """How many images a row holds (its images column; nothing is read)."""
        return len([v for v in _image_values(row.values.get(self.column)) if v is not None])

    def example(self, row: Row) -> tuple[np.ndarray, np.ndarray, list[Any]] | None:
        """(ids, mask, image values) of a row; None when no loss token is left."""
        conv = sft_conversation(row, self.columns, self.messages)
        where = Where(row)
        ids, mask, n = images.tokenize_with_images(
            self.tokenizer,
            self.template,
            conv,
            self.vision.tokens_per_image,
            where,
            completion_only_loss=self.completion_only_loss,
        )
        values = _image_values(row.values.get(self.column)) if n else []
        values = [v for v in values if v is not None]
        if len(values) != n:
            raise DataError(
                f"{where}: column {self.column!r} (spec.data.columns.images) holds "
                f"{len(values)} image(s), the messages have {n} image part(s)"
            )
        if len(ids) > self.max_length:
            cut = ids[self.max_length :]
            if np.isin(cut, images.image_token_ids(self.tokenizer)).any():
                raise DataError(
                    f"{where}: spec.data.maxLength={self.max_length} cuts into an image's "
                    f"{self.vision.tokens_per_image} tokens ({len(ids)} tokens); raise "
                    "maxLength"
                )
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not mask.any():
            return None
        return ids, mask, values

    def pixels(self, row: Row, values: list[Any]) -> list[np.ndarray]:
        """The processed images of a row (read now: missing or broken ones fail here,
        naming the row and the column)."""
        where = row.where
        return [self.processor(images.load_image(v, self.base, where, self.column)) for v in values]

    pads_missing_rows = True  # a None row (skipped as malformed) is a row of padding

    def batch(self, rows: Sequence[Row | None], max_images: int | None = None) -> Batch:
        """The rows' batch; `images` holds max_images per row (default: the most any of
        these rows has, at least 1): every host of a step passes the step's maximum."""
        examples = [self.example(row) if row is not None else None for row in rows]
        if max_images is None:
            max_images = max([len(e[2]) for e in examples if e is not None] + [1])
        b, length, side = len(rows), self.max_length, self.vision.image_size
        ids = np.full((b, length), self.pad_id, dtype=np.int32)
        mask = np.zeros((b, length), dtype=np.int32)
        seg = np.zeros((b, length), dtype=np.int32)
        pos = np.zeros((b, length), dtype=np.int32)
        pix = np.zeros((b, max_images, side, side, self.vision.num_channels), np.float32)
        origin = np.full(b, -1, dtype=np.int32)
        for r, (row, ex) in enumerate(zip(rows, examples, strict=True)):
            if ex is None:  # no loss token left: a row of padding
                continue
            row_ids, row_mask, values = ex
            n = len(row_ids)
            ids[r, :n] = row_ids
            mask[r, :n] = row_mask
            seg[r, :n] = 1
            pos[r, :n] = np.arange(n, dtype=np.int32)
            origin[r] = row.index
            for j, image in enumerate(self.pixels(row, values)):
                pix[r, j] = image
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "segment_ids": seg,
            "positions": pos,
            "images": pix,
            "row_index": origin,
        }


def batcher_from_spec(spec: Any, tokenizer: Tokenizer, records: Any) -> ImageBatcher:
    """The batcher of a PostTrainJobSpec with spec.data.columns.images: the vision settings
    and the image processor come from the model directory the tokenizer was read from."""
    from posttrain.trainer import models
    from posttrain.trainer.models import vision

    config = models.read_hf_config(tokenizer.origin)
    family = models.detect_family(tokenizer.origin)
    vi = vision.require_vision_info(config, family, tokenizer.origin)
    if spec.data.packing:
        raise DataError("spec.data.packing: rows with images are not packed; set packing to false")
    return ImageBatcher(
        records,
        tokenizer,
        vi,
        images.processor_for(tokenizer.origin, vi.image_size),
        columns=spec.data.columns,
        max_length=spec.data.max_length,
        completion_only_loss=spec.data.completion_only_loss,
        chat_template=spec.data.chat_template,
    )
