#!/usr/bin/env python3
"""Generate the small synthetic datasets in examples/data/ (deterministic, seeded).

chat-sft.jsonl          ~300 chat SFT rows ({"messages": [user, assistant]}): short
                        questions on capitals, arithmetic, colours and opposites,
                        always answered in one terse style, "Answer: Paris." A 135M
                        instruct model picks the style up within ~60 LoRA steps.
arithmetic-grpo.jsonl   ~200 rows {"prompt", "answer"}: sums and products whose
                        numeric answer an exactAnswer reward checks.
preferences-dpo.jsonl   ~200 rows {"prompt", "chosen", "rejected"}: the terse correct
                        answer preferred over a rambling or wrong one.

python scripts/make_example_data.py            # (re)write examples/data/
python scripts/make_example_data.py --check    # fail if the files are not up to date
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 20250101
OUT_DIR = Path(__file__).resolve().parent.parent / "examples" / "data"

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "Canada": "Ottawa",
    "Australia": "Canberra",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Argentina": "Buenos Aires",
    "Mexico": "Mexico City",
    "India": "New Delhi",
    "China": "Beijing",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Turkey": "Ankara",
    "Brazil": "Brasília",
    "Nigeria": "Abuja",
    "Morocco": "Rabat",
    "Hungary": "Budapest",
    "Denmark": "Copenhagen",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "Switzerland": "Bern",
    "South Korea": "Seoul",
    "Indonesia": "Jakarta",
    "Colombia": "Bogotá",
    "Cuba": "Havana",
    "Iceland": "Reykjavik",
    "New Zealand": "Wellington",
}

COLOURS = {
    "a ripe banana": "yellow",
    "a clear daytime sky": "blue",
    "fresh grass": "green",
    "fresh snow": "white",
    "a ripe tomato": "red",
    "coal": "black",
    "a ripe orange": "orange",
    "a lemon": "yellow",
    "a stop sign": "red",
    "an emerald": "green",
    "milk": "white",
    "a flamingo": "pink",
    "a ripe plum": "purple",
    "a crow": "black",
    "chocolate": "brown",
    "a pumpkin": "orange",
    "a sapphire": "blue",
    "a lime": "green",
    "a polar bear's fur": "white",
    "a strawberry": "red",
}

OPPOSITES = {
    "hot": "cold",
    "up": "down",
    "big": "small",
    "fast": "slow",
    "day": "night",
    "open": "closed",
    "early": "late",
    "light": "dark",
    "full": "empty",
    "happy": "sad",
    "old": "new",
    "wet": "dry",
    "loud": "quiet",
    "hard": "soft",
    "first": "last",
}

CAPITAL_Q = [
    "What is the capital of {x}?",
    "Which city is the capital of {x}?",
    "Name the capital of {x}.",
    "What's the capital city of {x}?",
]
COLOUR_Q = ["What colour is {x}?", "Which colour is {x}?", "Name the colour of {x}."]
OPPOSITE_Q = ["What is the opposite of {x}?", "Give the opposite of '{x}'.", "Opposite of {x}?"]
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
ARITH_Q = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"]

RAMBLE = [
    "Great question! Let me think about this carefully. I believe the answer is {y}, "
    "although there is a lot more that could be said about it.",
    "Well, there are many ways to look at this, but most people would say {y}.",
    "Sure! The answer you are looking for is {y}. Let me know if you have other questions!",
]


def qa_pairs(rng: random.Random) -> list[tuple[str, str, list[str]]]:
    """(question, short answer, plausible wrong answers), every kind mixed."""
    out = []
    caps = list(CAPITALS.values())
    for country, city in CAPITALS.items():
        for tpl in rng.sample(CAPITAL_Q, 2):
            out.append((tpl.format(x=country), city, [c for c in caps if c != city]))
    cols = sorted(set(COLOURS.values()))
    for thing, col in COLOURS.items():
        for tpl in rng.sample(COLOUR_Q, 2):
            out.append((tpl.format(x=thing), col, [c for c in cols if c != col]))
    opp = list(OPPOSITES.values())
    for word, other in OPPOSITES.items():
        out.append((rng.choice(OPPOSITE_Q).format(x=word), other, [o for o in opp if o != other]))
    for _ in range(165):
        op = rng.choice(list(OPS))
        a, b = rng.randint(2, 30), rng.randint(2, 30 if op != "*" else 12)
        y = OPS[op](a, b)
        q = rng.choice(ARITH_Q).format(a=a, op=op, b=b)
        out.append((q, str(y), [str(y + d) for d in (-2, -1, 1, 2, 10)]))
    rng.shuffle(out)
    return out


def chat_sft(rng: random.Random) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": q},
                {"role": "assistant", "content": f"Answer: {y}."},
            ]
        }
        for q, y, _ in qa_pairs(rng)
    ]


def arithmetic_grpo(rng: random.Random, n: int = 200) -> list[dict]:
    rows = []
    for _ in range(n):
        op = rng.choice(["+", "+", "-", "*"])
        a, b = rng.randint(10, 99), rng.randint(2, 99 if op != "*" else 20)
        rows.append(
            {
                "prompt": f"What is {a} {op} {b}? Think briefly, then give the final number "
                "after 'Answer:'.",
                "answer": str(OPS[op](a, b)),
            }
        )
    return rows


def preferences_dpo(rng: random.Random, n: int = 200) -> list[dict]:
    rows = []
    for q, y, wrong in qa_pairs(rng)[:n]:
        if rng.random() < 0.5:
            rejected = rng.choice(RAMBLE).format(y=y)
        else:
            rejected = f"Answer: {rng.choice(wrong)}."
        rows.append({"prompt": q, "chosen": f"Answer: {y}.", "rejected": rejected})
    return rows


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def files() -> dict[str, str]:
    return {
        "chat-sft.jsonl": render(chat_sft(random.Random(SEED))),
        "arithmetic-grpo.jsonl": render(arithmetic_grpo(random.Random(SEED + 1))),
        "preferences-dpo.jsonl": render(preferences_dpo(random.Random(SEED + 2))),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="only check the files are current")
    args = ap.parse_args(argv)
    stale = []
    for name, text in files().items():
        path = args.out_dir / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"{path}: {text.count(chr(10))} rows, {len(text.encode())} bytes")
    if stale:
        print("out of date (run scripts/make_example_data.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
