"""Images embedded in the data: a `datasets` Dataset with an Image feature, saved with
save_to_disk and as parquet, gives the same rows and pixels as image files do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.trainer

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3-vision"
NAMES = ("rgb_50x37", "rgba_20x28")


def _spec(source: str):
    from posttrain.api.spec import PostTrainJobSpec

    return PostTrainJobSpec.model_validate(
        {
            "model": {"source": str(FIXTURE)},
            "data": {"source": source, "maxLength": 64, "columns": {"images": "pictures"}},
            "output": {"uri": "/tmp/unused"},
        }
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("embedded")
    rows = {
        "messages": [
            [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": f"It is {c}."}]},
            ]
            for c in ("red", "green")
        ],
        "pictures": [[str(FIXTURE / "images" / f"{n}.png")] for n in NAMES],
    }
    ds = datasets.Dataset.from_dict(rows).cast_column(
        "pictures", datasets.Sequence(datasets.Image())
    )
    ds.save_to_disk(str(root / "disk"))
    ds.to_parquet(str(root / "train.parquet"))
    return root


@pytest.mark.parametrize("layout", ["disk", "train.parquet"])
def test_embedded_images_give_the_processors_pixels(saved, layout):
    from posttrain.trainer import data

    golden = np.load(FIXTURE / "golden.npz")
    spec = _spec(str(saved / layout))
    tokenizer = data.load_tokenizer(str(FIXTURE))
    rows = data.build_rows(spec, tokenizer)
    batch = rows.batch(np.array([0, 1]))
    assert batch["images"].shape == (2, 1, 32, 32, 3)
    for i, name in enumerate(NAMES):
        expected = golden[f"pixels_{name}"].transpose(1, 2, 0)
        np.testing.assert_allclose(batch["images"][i, 0], expected, atol=1e-6, rtol=0)
    soft = batch["input_ids"] == tokenizer.token_to_id("<image_soft_token>")
    assert soft.sum(axis=1).tolist() == [16, 16]
