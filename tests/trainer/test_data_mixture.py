"""Weighted mixtures (spec.data.sources): deterministic interleaving by weight, weights
changed on resume, held-out data and counts per source."""

from __future__ import annotations

import json
from pathlib import Path

import grain
import pytest

from posttrain.api.spec import PostTrainJobSpec
from posttrain.trainer import evaluate
from posttrain.trainer.data import DataLoader, MixedRows, build_rows, load_tokenizer, mixed_counts
from posttrain.trainer.distributed import ProcessInfo
from tests.trainer.data_helpers import make_tokenizer_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def chat(tag: str, i: int) -> dict:
    return {"prompt": f"{tag} question {i}?", "completion": f"{tag} answer {i}."}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mix")
    out = {}
    for tag, n in (("math", 30), ("code", 60)):
        out[tag] = d / f"{tag}.jsonl"
        out[tag].write_text("".join(json.dumps(chat(tag, i)) + "\n" for i in range(n)))
    return out


def spec(sources: dict[str, Path], weights=(1, 3), **extra) -> PostTrainJobSpec:
    entries = [
        {"source": str(path), "weight": w}
        for (_, path), w in zip(sources.items(), weights, strict=True)
    ]
    return PostTrainJobSpec.model_validate(
        {
            "model": {"source": "/m"},
            "data": {"sources": entries, "maxLength": 48},
            "training": {"batchSize": 8, "seed": 2},
            "output": {"uri": "/tmp/unused"},
            **extra,
        }
    )


def mixture(job, tok) -> MixedRows:
    from posttrain.trainer.data import open_records

    return MixedRows(
        [
            (e.source.split("/")[-1].split(".")[0], build_rows(job, tok, open_records(e.source)), e.weight)
            for e in job.data.sources
        ]
    )  # fmt: skip


def drawn(loader: DataLoader, steps: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(steps):
        b = next(loader)
        out += list(zip(b["source_index"].tolist(), b["row_index"].tolist(), strict=True))
    return out


def test_counts_follow_grains_mix():
    a, b = grain.MapDataset.range(10**6), grain.MapDataset.range(10**6).map(lambda i: -1 - i)
    mixed = grain.MapDataset.mix([a, b], [0.3, 0.7])
    first = [mixed[k] for k in range(1000)]
    for g in (0, 1, 7, 100, 999):
        assert mixed_counts(g, [0.3, 0.7]) == [
            sum(x >= 0 for x in first[:g]),
            sum(x < 0 for x in first[:g]),
        ]


def test_sources_interleave_by_weight_deterministically(sources, tok):
    job = spec(sources)
    loader = DataLoader(mixture(job, tok), batch_size=8, seed=2, threads=0)
    got = drawn(loader, 10)
    assert [s for s, _ in got].count(0) == 20 and [s for s, _ in got].count(1) == 60
    assert loader.metrics()["source/math"] == 20 and loader.metrics()["source/code"] == 60
    assert got == drawn(DataLoader(mixture(job, tok), batch_size=8, seed=2, threads=0), 10)
    # each source is its own shuffled order: 20 different math rows of 30
    assert len({i for s, i in got if s == 0}) == 20
    batch = next(loader)
    text = tok.decode(batch["input_ids"][0][batch["loss_mask"][0] == 1])
    tag = ["math", "code"][int(batch["source_index"][0])]
    assert text.startswith(f"{tag} answer {batch['row_index'][0]}")


def test_weights_change_on_resume_and_every_source_continues(sources, tok):
    job = spec(sources)
    first = DataLoader(mixture(job, tok), batch_size=8, seed=2, threads=0)
    before = drawn(first, 3)
    state = json.loads(json.dumps(first.get_state()))
    straight = drawn(first, 6)
    changed = DataLoader(mixture(spec(sources, (1, 1)), tok), batch_size=8, seed=2, threads=0)
    changed.set_state(state)
    after = drawn(changed, 6)
    assert [s for s, _ in after].count(0) == 24  # the new weights: half and half
    for s in (0, 1):  # each source's rows continue its own order: no repeat, no skip
        order = [i for src, i in before + straight if src == s]
        order += [i for src, i in drawn(first, 20) if src == s]
        mine = [i for src, i in before + after if src == s]
        assert mine == order[: len(mine)]
    assert changed.metrics()["source/math"] == [s for s, _ in before].count(0) + 24 == 30


def test_held_out_and_eval_metrics_per_source(sources, tok):
    from posttrain.trainer.loop import build_data

    job = spec(sources, eval={"fraction": 0.3, "samples": 0})
    loader, held_out = build_data(job, tok, ProcessInfo(None, 1, 0))
    assert [name for name, _ in held_out] == ["math", "code"]
    assert [len(r) for _, r in held_out] == [9, 18]
    assert loader.names == ["math", "code"] and len(loader.rows) == 21 + 42

    def measure(batch):  # tokens of each source's held-out rows
        return {"tokens": float((batch["segment_ids"] > 0).sum())}

    evaluation = evaluate.build(job, tok, held_out, ProcessInfo(None, 1, 0), measure, dict, None)
    scores = evaluation.run()
    assert scores["tokens"] == scores["math/tokens"] + scores["code/tokens"] > 0
    assert (scores["math/batches"], scores["code/batches"], scores["batches"]) == (1, 2, 3)
