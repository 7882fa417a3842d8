"""The fast estimate of a TPU job (posttrain.capacity, the webhook's instant answer) against
the TPU compiler's figures at published shapes: bench/tpu_memory_table.json, made by
bench/tpu_calibration.py (each case's train step compiled for its topology and slices by
libtpu, compile-only). Pure: no JAX, no compile."""

from __future__ import annotations

import pytest
from tpu_table import NO_WARNING_BELOW, load, rows

from posttrain import capacity

TABLE = load()
ROWS = {r.name: r for r in rows(TABLE)}
# Cases that compiled (a case over HBM records the compiler's temporaries alone: a floor,
# held by the admission tests below, not by the ratio).
COMPILED = [name for name, r in ROWS.items() if not r.over_hbm]
# Where the estimate is under 0.8 of the compiler today: LoRA steps on v6e-8 whose
# compiled figure keeps more per layer than rematerialisation should (Qwen3-4B at 4k,
# Llama-3.2-1B at 8k, Qwen3-1.7B GRPO); their figures are in docs/user-guide.md.
UNDER = {"q4b-sft-lora-4k-v6e8", "l1b-sft-lora-8k-r64-v6e8", "q17-grpo-lora-1k-v6e8"}


def test_the_table_covers_the_published_shapes_techniques_and_topologies():
    cases = TABLE["cases"].values()
    assert len(cases) >= 20
    assert {c["model"] for c in cases} >= {"Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B",
                                           "Llama-3.2-1B", "Llama-3.2-3B", "gemma-3-1b-it",
                                           "gemma-3-4b-it"}  # fmt: skip
    specs = [c["spec"] for c in cases]
    assert {s["technique"] for s in specs} == {"sft", "dpo", "grpo", "distill"}
    assert {s["training"].get("remat", "auto") for s in specs} >= {"auto", "none", "block"}
    assert {s["training"].get("gradientAccumulation", 1) for s in specs} == {1, 4}
    assert {s["resources"]["accelerator"].split("-")[0] for s in specs} == {"v5e", "v6e", "v5p"}
    assert {s["resources"].get("slices", 1) for s in specs} == {1, 2}
    assert any("lora" in s for s in specs) and any("images" in s["data"].get("columns", {})
                                                   for s in specs)  # fmt: skip
    assert {s["data"]["maxLength"] for s in specs} >= {2048, 4096, 8192}


@pytest.mark.parametrize("name", COMPILED)
def test_the_estimate_is_within_the_band_of_the_tpu_compiler(name):
    r = ROWS[name]
    if name in UNDER:
        assert r.ratio < 0.8, f"{name} is within the band now: take it off UNDER"
        return
    assert 0.8 <= r.ratio <= 1.25, (name, r.estimate, r.compiler, r.ratio)


def test_within_the_band_on_nine_in_ten_of_the_table():
    """The goal: the estimate within 0.8-1.25 of the TPU compiler on at least 90% of the
    compiled cases; missed today by the cases in UNDER."""
    inside = [n for n in COMPILED if 0.8 <= ROWS[n].ratio <= 1.25]
    if len(inside) < 0.9 * len(COMPILED):
        pytest.xfail(f"{len(inside)} of {len(COMPILED)} within 0.8-1.25, goal 90%")
    assert len(inside) >= 0.9 * len(COMPILED)


@pytest.mark.parametrize("name", ROWS)
def test_admission_is_right_on_both_sides(name):
    """A case the compiler fits within 90% of HBM is admitted without a warning; one over
    HBM is refused, the message naming the estimate's figure, its terms and the memory."""
    r = ROWS[name]
    if r.over_hbm or r.compiler > r.hbm:
        assert r.verdict == "refuse", (name, r.estimate, r.compiler, r.hbm)
        assert f"about {r.estimate:.1f} GiB per device" in r.message
        assert "weights" in r.message and "logits" in r.message
        assert f"device has {r.hbm:g} GiB" in r.message
    elif r.compiler < NO_WARNING_BELOW * r.hbm:
        assert (r.verdict, r.message) == ("admit", None), (name, r.estimate, r.compiler, r.hbm)


def test_the_table_has_cases_on_both_sides():
    assert sum(r.over_hbm for r in ROWS.values()) >= 2
    assert sum(r.compiler < NO_WARNING_BELOW * r.hbm for r in ROWS.values()) >= 15


def test_every_case_is_estimated_with_the_tpu_calibration():
    assert {r.spec.resources.accelerator.split("-")[0] for r in ROWS.values()} <= {"v5e", "v6e",
                                                                                 "v5p"}  # fmt: skip
    for r in ROWS.values():
        assert set(r.terms) == set(capacity.TERMS)
        assert r.terms["optimizer"] > 0 and r.terms["logits"] > 0
