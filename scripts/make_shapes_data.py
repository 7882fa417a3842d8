#!/usr/bin/env python3
"""Generate the small image dataset in examples/data/shapes/ (deterministic, seeded).

One coloured shape (red, green or blue; circle, square or triangle; of random size and
place) on a light background, 32x32 PNG, and a question about it:

    train.jsonl     {"messages": [user (image + question), assistant (answer)],
                     "images": ["images/train-000.png"]}
    heldout.jsonl   the same on other images, to measure answer accuracy

Half the questions ask the colour ("What colour is the shape?" -> "red"), half the
shape ("What shape is it?" -> "circle"); chance accuracy is 1/3.

python scripts/make_shapes_data.py            # (re)write examples/data/shapes/
python scripts/make_shapes_data.py --check    # fail if the files are not up to date
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "examples" / "data" / "shapes"
SEED = 20260101
SIZE = 32
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?"}
COUNTS = {"train": 180, "heldout": 45}


def draw(rng: random.Random, colour: str, shape: str) -> bytes:
    from PIL import Image, ImageDraw

    bg = tuple(rng.randint(225, 250) for _ in range(3))
    image = Image.new("RGB", (SIZE, SIZE), bg)
    pen = ImageDraw.Draw(image)
    r = rng.randint(7, 12)
    cx, cy = rng.randint(r + 1, SIZE - r - 2), rng.randint(r + 1, SIZE - r - 2)
    fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def rows(split: str, rng: random.Random) -> tuple[list[dict], dict[str, bytes]]:
    out, files = [], {}
    for i in range(COUNTS[split]):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        kind = "colour" if i % 2 == 0 else "shape"
        name = f"images/{split}-{i:03d}.png"
        files[name] = draw(rng, colour, shape)
        out.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[kind]}],
                    },
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": colour if kind == "colour" else shape}
                        ],
                    },
                ],
                "images": [name],
            }
        )
    return out, files


def generate() -> dict[str, bytes]:
    rng = random.Random(SEED)
    files: dict[str, bytes] = {}
    for split in COUNTS:
        data, images = rows(split, rng)
        files.update(images)
        files[f"{split}.jsonl"] = "".join(json.dumps(r) + "\n" for r in data).encode()
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    files = generate()
    if args.check:
        stale = [
            n
            for n, b in files.items()
            if not (OUT_DIR / n).is_file() or (OUT_DIR / n).read_bytes() != b
        ]
        for name in stale:
            print(f"{OUT_DIR / name}: not up to date; run {Path(__file__).name}", file=sys.stderr)
        return 1 if stale else 0
    for name, content in files.items():
        path = OUT_DIR / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    print(f"wrote {len(files)} files to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
