"""The fast estimate of a TPU job (posttrain.capacity, the webhook's instant answer) against
the TPU compiler's figures at published shapes: bench/tpu_memory_table.json, made by
bench/tpu_calibration.py (each case's train step compiled for its topology and slices by
libtpu, compile-only). Pure: no JAX, no compile."""

from __future__ import annotations

import sys

import pytest
from tpu_table import NO_WARNING_BELOW, load, rows
from tpu_table import TABLE as TABLE_PATH

from posttrain import capacity

TABLE = load()
ROWS = {r.name: r for r in rows(TABLE)}
# Cases that compiled (a case over HBM records the compiler's temporaries alone: a floor,
# held by the admission tests below, not by the ratio).
COMPILED = [name for name, r in ROWS.items() if not r.over_hbm]
# Where the estimate is outside 0.8-1.25 of the compiler today (its figures are in
# docs/user-guide.md, "The TPU calibration"): a full fine-tune on 8 v6e chips at 8k tokens a
# chip, whose backward holds about half of every layer's activations and the logits'
# gradient, which the estimate does not count.
OUTSIDE = {"l1b-sft-full-8k-v6e8"}


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
    if name in OUTSIDE:
        assert not 0.8 <= r.ratio <= 1.25, f"{name} is within the band now: take it off OUTSIDE"
        return
    assert 0.8 <= r.ratio <= 1.25, (name, r.estimate, r.compiler, r.ratio)


def test_within_the_band_on_nine_in_ten_of_the_table():
    """The goal: the estimate within 0.8-1.25 of the TPU compiler on at least 90% of the
    compiled cases, and on at least 90% of the held-out ones (not used to fit
    capacity.TPU_CONSTANTS: bench/tpu_calibration.HELD_OUT). Today 30 of 31 (96.8%), 14 of
    14 fitted and 16 of 17 held out: missed by the case in OUTSIDE. Never fewer than
    today's 30."""
    sys.path.insert(0, str(TABLE_PATH.parents[1] / "bench"))
    from tpu_calibration import HELD_OUT

    inside = [n for n in COMPILED if 0.8 <= ROWS[n].ratio <= 1.25]
    held = [n for n in COMPILED if n in HELD_OUT]
    held_inside = [n for n in held if n in inside]
    assert len(COMPILED) >= 20 and len(held) >= 10
    assert len(inside) >= len(COMPILED) - len(OUTSIDE), (len(inside), len(COMPILED))
    assert len(inside) >= 0.9 * len(COMPILED), (len(inside), len(COMPILED))
    assert len(held_inside) >= 0.9 * len(held), (len(held_inside), len(held))


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
        assert set(r.terms) == set(capacity.TPU_TERMS)
        assert r.terms["optimizer"] > 0
        assert r.terms["compiler overhead"] == pytest.approx(capacity.TPU_OVERHEAD_GIB)
        # the loss's logits are freed before a deferred backward's peak
        assert (r.terms["logits"] > 0) == (r.peak == "loss"), (r.name, r.peak)


def test_a_lora_backward_holds_every_layer_on_eight_chips_but_not_on_v5e():
    """A rematerialised LoRA step on 8 or more chips of a slice (not v5e) holds every
    layer's activations in its backward (4 [tokens, hidden], 4 [tokens, intermediate], 2
    [tokens, q heads x head dim], 2 [tokens, kv heads x head dim] a layer, the compiler's
    buffers for l1b-sft-lora-8k-r64-v6e8 and g1b-sft-lora-2k-v6e8); on 4 chips, on v5e, as
    a full fine-tune, with accumulation or without remat, the step has no such phase. The
    estimate counts the larger of that and the loss, not both."""
    from posttrain import catalog

    spec = ROWS["l1b-sft-lora-8k-r64-v6e8"].spec
    shape = capacity.shape_of(spec)

    def phases(spec, accelerator="v6e-8"):
        lay = capacity.layout(spec, catalog.resolve(accelerator))
        return capacity.tpu_phases(spec, shape, lay, accelerator.split("-")[0])

    def changed(**training):
        return spec.model_copy(update={"training": spec.training.model_copy(update=training)})

    per_token = capacity.layer_activation_bytes(shape, 2)
    assert per_token == 2 * (4 * 2048 + 4 * 8192 + 2 * 32 * 64 + 2 * 8 * 64)
    found = phases(spec)
    assert found["backward"] == {"activations": shape.layers * 8192 * per_token}
    assert capacity.tpu_peak(found) == "backward"
    assert found["backward"]["activations"] / capacity.GIB == pytest.approx(11.25)
    assert "backward" not in phases(spec, "v6e-4")
    assert "backward" not in phases(spec, "v5e-8")
    assert "backward" not in phases(spec.model_copy(update={"lora": None}))
    assert "backward" not in phases(changed(gradient_accumulation=4, batch_size=32))
    assert "backward" not in phases(changed(remat="none"))
    r = ROWS["l1b-sft-lora-8k-r64-v6e8"]
    assert r.peak == "backward" and r.terms["logits"] == 0
    assert r.terms["activations"] == pytest.approx(11.25)
    assert ROWS["g1b-sft-lora-2k-v5e8"].peak == "loss"
