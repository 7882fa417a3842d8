"""The memory estimate: shapes, what each technique holds per device, verdicts, and the
same text from `posttrain estimate`, `posttrain validate` and the admission webhook."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from invalid_jobs import valid_job

from posttrain import capacity, catalog
from posttrain.api import model_shapes
from posttrain.api.spec import PostTrainJobSpec
from posttrain.controller.webhook import review_response

GIB = 2**30


def job(accelerator="v6e-8", source="gs://m/Qwen3-0.6B", **spec):
    """A job on `accelerator`; dense attention unless spec.training says otherwise (the
    figures below are XLA's for the dense step; flash: its own test)."""
    doc = valid_job()
    doc["spec"].update(model={"source": source}, resources={"accelerator": accelerator})
    for key, value in spec.items():
        doc["spec"][key] = value
    doc["spec"].setdefault("training", {}).setdefault("attention", "dense")
    return doc


def estimate(doc, compiler="xla-cpu"):
    """The estimate with the terms calibrated to XLA:CPU (what a GPU job gets: XLA:GPU
    cannot compile without a GPU) on the job's accelerator's layout and memory: the tests
    below hold those terms' arithmetic; a TPU job's, fitted to the TPU compiler, are held
    to its figures in test_capacity_tpu_table.py."""
    s = PostTrainJobSpec.model_validate(doc["spec"])
    res = s.resources
    return capacity.estimate(s, catalog.resolve(res.accelerator, res.topology), compiler=compiler)


@pytest.mark.parametrize(
    "source,hidden,layers,vocab,params",
    [
        ("hf://Qwen/Qwen3-0.6B@main", 1024, 28, 151936, 0.596e9),
        ("gs://m/Qwen3-32B", 5120, 64, 151936, 32.8e9),
        ("/models/Llama-3.1-8B-Instruct", 4096, 32, 128256, 8.03e9),
        ("/models/Llama-3.2-1B", 2048, 16, 128256, 1.24e9),
        ("gs://m/gemma-2-2b-it", 2304, 26, 256000, 2.61e9),
        ("gs://m/gemma-3-1b-it", 1152, 26, 262144, 1.0e9),
        ("gs://m/Qwen2.5-7B-Instruct", 3584, 28, 152064, 7.62e9),
        ("/models/SmolLM2-135M-Instruct", 576, 30, 49152, 0.135e9),
        ("/models/SmolLM2-1.7B", 2048, 24, 49152, 1.71e9),
    ],
)
def test_known_shapes_give_the_published_parameter_counts(source, hidden, layers, vocab, params):
    shape = model_shapes.from_name(source)
    assert (shape.hidden, shape.layers, shape.vocab) == (hidden, layers, vocab)
    assert shape.params == pytest.approx(params, rel=0.02)
    assert model_shapes.hidden_size(source) == hidden


def test_a_local_config_json_wins_over_the_name_and_layers_apply(tmp_path):
    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    config = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 128, "vocab_size": 1000}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    shape = model_shapes.shape(str(model), layers=2)
    assert (shape.hidden, shape.layers, shape.vocab, shape.origin) == (64, 2, 1000, "config.json")
    assert not shape.tied
    assert model_shapes.shape("/models/tiny") is None
    assert model_shapes.shape("gs://m/Qwen3-8B").origin == "table"  # never the network
    text = {"model_type": "gemma3", "text_config": {**config, "model_type": "gemma3_text"}}
    assert model_shapes.from_config(text).tied  # Gemma ties by default


@pytest.mark.parametrize(
    "lora,optimizer,weights,optimizer_bytes,gradients,gathered,gathered_gradients",
    [
        # full: float32 masters + the bfloat16 copy cast for the forward pass
        (None, "adamw", 6, 8, 4, 2, 4),
        (None, "sgd", 6, 4, 4, 2, 4),
        # LoRA: the frozen base in bfloat16; adapters counted separately
        ({"rank": 16}, "adamw", 2, 0, 0, 2, 0),
    ],
)
def test_state_per_parameter_is_sharded_over_the_slice(
    lora, optimizer, weights, optimizer_bytes, gradients, gathered, gathered_gradients
):
    """Sharded over the 8 fsdp devices, plus what a matmul gathers whole: the embedding
    and one decoder layer in bfloat16, and (full fine-tune) their float32 gradients."""
    doc = job(source="gs://m/Llama-3.1-70B", lora=lora)
    doc["spec"]["training"] = {"optimizer": optimizer}
    est = estimate(doc)
    p = est.shape.params
    whole = est.shape.vocab * est.shape.hidden + est.shape.layer_params
    adapters = (
        capacity.lora_params(est.shape, PostTrainJobSpec.model_validate(doc["spec"])) if lora else 0
    )
    assert est.layout == capacity.Layout(1, 8)
    assert est.terms["weights"] == pytest.approx(
        ((p * weights + adapters * 4) / 8 + whole * gathered) / GIB
    )
    assert est.terms["optimizer"] == pytest.approx((p * optimizer_bytes + adapters * 8) / 8 / GIB)
    assert est.terms["gradients"] == pytest.approx(
        ((p * gradients + adapters * 4) / 8 + whole * gathered_gradients) / GIB
    )


def test_one_device_gathers_nothing():
    spec = PostTrainJobSpec.model_validate(job(training={"batchSize": 8})["spec"])
    est = capacity.estimate(spec, catalog.resolve("v6e-8"), capacity.Layout(1, 1), "xla-cpu")
    assert est.terms["weights"] == pytest.approx(est.shape.params * 6 / GIB)
    assert est.terms["gradients"] == pytest.approx(est.shape.params * 4 / GIB)


def test_lora_adapters_count_rank_times_the_targeted_projections():
    shape = model_shapes.from_name("Qwen3-0.6B")
    d, f, q, kv = 1024, 3072, 16 * 128, 8 * 128

    def adapters(**lora):
        return capacity.lora_params(shape, PostTrainJobSpec.model_validate(job(lora=lora)["spec"]))

    every = 2 * (d + q) + 2 * (d + kv) + 3 * (d + f)
    assert adapters(rank=8) == 8 * 28 * every
    assert adapters(rank=8, targetModules="q_proj, v_proj") == 8 * 28 * (d + q + d + kv)


def test_parameters_replicate_over_slices_and_rows_split_over_every_device():
    doc = job("v6e-16", training={"batchSize": 64})
    one = estimate(doc)
    doc["spec"]["resources"]["slices"] = 2
    two = estimate(doc)
    assert (one.layout, two.layout) == (capacity.Layout(1, 16), capacity.Layout(2, 16))
    assert two.terms["weights"] == one.terms["weights"]  # dp replicates
    assert (one.rows, two.rows) == (4, 2)
    assert two.terms["logits"] == pytest.approx(one.terms["logits"] / 2)
    gpu = estimate(job("nvidia-h100-80gb", training={"batchSize": 16}))
    assert gpu.layout == capacity.Layout(1, 8)


def test_activations_grow_linearly_with_layers_and_logits_with_vocabulary(tmp_path):
    def at(layers, vocab):
        model = tmp_path / f"m{layers}-{vocab}"
        model.mkdir(exist_ok=True)
        config = {"model_type": "qwen3", "hidden_size": 512, "num_hidden_layers": layers,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                  "intermediate_size": 1024, "vocab_size": vocab}  # fmt: skip
        (model / "config.json").write_text(json.dumps(config))
        return estimate(job(source=str(model)))

    a2, a4, a8 = (at(n, 1000).terms["activations"] for n in (2, 4, 8))
    assert a8 - a4 == pytest.approx(2 * (a4 - a2))
    small, large = at(2, 1000).terms["logits"], at(2, 100_000).terms["logits"]
    assert large == pytest.approx(100 * small)


@pytest.mark.parametrize(
    "technique,extra,lora,rows,scored,per_scored",
    [
        # SFT: logsumexp minus the target's logit, every token scored
        ("sft", {}, None, 1, 512, 4),
        ("sft", {}, {"rank": 8}, 1, 512, 2),
        # DPO: chosen and rejected rows; the log-softmax of the completion kept too
        ("dpo", {"dpo": {"maxPromptLength": 128}}, None, 2, 512 - 128, 8),
        ("dpo", {"dpo": {"maxPromptLength": 400}}, None, 2, 256, 8),  # at most half
    ],
)
def test_logits_at_every_token_and_the_loss_at_the_scored_ones(
    technique, extra, lora, rows, scored, per_scored
):
    doc = job(technique=technique, lora=lora, training={"batchSize": 8}, **extra)
    doc["spec"]["data"] = {"source": "/d.jsonl", "maxLength": 512}
    est = estimate(doc)
    vocab = est.shape.vocab
    assert est.rows == rows
    assert est.terms["logits"] == pytest.approx(
        rows * vocab * (512 * (2 + 4) + scored * per_scored) / GIB
    )


@pytest.mark.parametrize(
    "technique,extra,lora,reference",
    [
        ("dpo", {"dpo": {"algorithm": "dpo"}}, None, True),
        ("dpo", {"dpo": {"algorithm": "dpo"}}, {"rank": 8}, False),  # adapters zeroed
        ("dpo", {"dpo": {"algorithm": "orpo"}}, None, False),
        ("grpo", {"grpo": {"beta": 0.04, "rewards": [{"type": "exactAnswer"}]}}, None, True),
        ("grpo", {"grpo": {"beta": 0, "rewards": [{"type": "exactAnswer"}]}}, None, False),
    ],
)
def test_reference_copy_per_technique(technique, extra, lora, reference):
    doc = job(technique=technique, lora=lora, training={"batchSize": 8}, **extra)
    est = estimate(doc)
    frozen = est.shape.params * 2 / 8 / GIB
    assert est.terms["reference/teacher"] == pytest.approx(frozen if reference else 0)


def test_grpo_rollout_cache_and_distillation_teacher():
    grpo = {"numGenerations": 4, "maxPromptLength": 256, "maxCompletionLength": 768,
            "rewards": [{"type": "exactAnswer"}]}  # fmt: skip
    est = estimate(job(technique="grpo", grpo=grpo, training={"batchSize": 16}))
    sequences = 16 * 4 / 8
    assert est.length == 1024 and est.rows == sequences
    assert est.terms["rollout cache"] == pytest.approx(
        sequences * 1024 * 28 * 2 * 8 * 128 * 2 / GIB
    )
    # Episodes with tools: the episode sampler's cache holds a turn and a prefill block
    # more a sequence (the activations keep the learner's 1024 tokens).
    agent = {"maxTurns": 3, "turnLength": 200, "tools": [{"name": "calc", "type": "calculator"}]}
    est = estimate(job(technique="grpo", grpo=grpo | {"agent": agent}, training={"batchSize": 16}))
    assert est.length == 1024
    assert est.terms["rollout cache"] == pytest.approx(
        sequences * (1024 + 200 + 32) * 28 * 2 * 8 * 128 * 2 / GIB
    )
    teacher = {"teacher": {"source": "gs://m/Qwen3-8B"}}
    est = estimate(job(technique="distill", distill=teacher, training={"batchSize": 8}))
    qwen3_8b = model_shapes.from_name("Qwen3-8B")
    assert est.terms["reference/teacher"] == pytest.approx(qwen3_8b.params * 2 / 8 / GIB)


@pytest.mark.parametrize(
    "doc,verdict",
    [
        (job(source="gs://m/Llama-3.1-70B"), "over"),  # the held state alone: 6+8+4 B/param
        # 62 GiB with dense attention (27 GiB with a flash kernel: 35 GiB of scores)
        (job(source="gs://m/Llama-3.1-70B", lora={"rank": 16}), "over"),
        (
            job(
                "v6e-16",
                source="gs://m/Qwen3-8B",
                lora={"rank": 16},
                data={"source": "/d", "maxLength": 512},
            ),
            "fits",
        ),
        # the case: even rematerialised, activations and logits are 86 GiB
        (job(training={"batchSize": 64}, data={"source": "/d.jsonl", "maxLength": 2048}), "over"),
        (job(training={"batchSize": 16}, data={"source": "/d.jsonl", "maxLength": 2048}), "tight"),
        (job(training={"batchSize": 8}, data={"source": "/d.jsonl", "maxLength": 512}), "fits"),
    ],
)
def test_verdicts(doc, verdict):
    assert estimate(doc).verdict == verdict


@pytest.mark.parametrize(
    "total,verdict",
    [(20.0, "fits"), (24.0, "fits"), (24.1, "tight"), (32.0, "tight"), (40.0, "tight"),
     (40.1, "over")],
)  # fmt: skip
def test_refused_only_beyond_the_uncertainty_band(total, verdict):
    """32 GiB a device: refused above 1.25 x memory, a warning above 0.75 x memory."""
    shape = model_shapes.from_name("Qwen3-0.6B")
    terms = dict.fromkeys(capacity.TERMS, 0.0) | {"activations": total}
    est = capacity.MemoryEstimate("m", shape, capacity.Layout(1, 8), 1, 8, terms, 32.0, "v6e")
    assert est.verdict == verdict


def test_remat_keeps_a_fraction_of_the_activations():
    """auto is layer on an accelerator; block keeps more; none keeps every layer's. With
    gradient clipping (the default) XLA keeps float32 attention copies of every
    rematerialised layer, so remat saves less than without it."""
    data = {"source": "/d.jsonl", "maxLength": 2048}
    found = {
        remat: estimate(job(training={"batchSize": 16, "remat": remat}, data=data))
        for remat in ("auto", "layer", "block", "none")
    }
    act = {remat: e.terms["activations"] for remat, e in found.items()}
    assert act["auto"] == act["layer"] < act["block"] < act["none"] / 1.5
    unclipped = {
        remat: estimate(
            job(training={"batchSize": 16, "remat": remat, "maxGradNorm": 0}, data=data)
        ).terms["activations"]
        for remat in ("layer", "none")
    }
    assert unclipped["layer"] < act["layer"] / 3 and unclipped["layer"] < unclipped["none"] / 3
    assert found["auto"].remat == "layer" and "remat layer" in found["auto"].explain()
    rest = {k: v for k, v in found["none"].terms.items() if k != "activations"}
    assert rest == {k: v for k, v in found["layer"].terms.items() if k != "activations"}


def test_no_estimate_on_cpu_or_without_a_shape():
    assert estimate(job("cpu")) is None
    assert estimate(job(source="/models/tiny")) is None
    s = PostTrainJobSpec.model_validate(job(source="/models/tiny")["spec"])
    assert "no memory check was made" in capacity.warning(s, catalog.resolve("v6e-8"))
    assert capacity.warning(s, catalog.resolve("cpu")) is None


def _review(doc):
    review = {"request": {"uid": "u", "operation": "CREATE", "object": doc}}
    return review_response(review)["response"]


def test_webhook_refuses_warns_or_says_no_check_was_made():
    refused = _review(job(source="gs://m/Llama-3.1-70B"))
    assert not refused["allowed"] and "warnings" not in refused
    message = refused["status"]["message"]
    assert "\n" not in message and "does not fit" in message and "LoRA" in message
    # a TPU job's estimate is the TPU compiler's calibration: within 5% of HBM is tight
    data = {"source": "/d", "maxLength": 2048}
    batch = next(
        b for b in range(8, 513, 8)
        if estimate(job(training={"batchSize": b}, data=data), "tpu").verdict == "tight"
    )  # fmt: skip
    tight = _review(job(training={"batchSize": batch}, data=data))
    assert tight["allowed"]
    (warning,) = tight["warnings"]
    assert warning.startswith("spec.resources.accelerator: the job may not fit")
    assert "logits" in warning and "a v6e device has 32 GiB" in warning
    assert "refused above 33.6 GiB" in warning and "estimate --compile" in warning
    unknown = _review(job(source="/models/tiny"))
    assert unknown["allowed"] and "no memory check was made" in unknown["warnings"][0]
    assert "warnings" not in _review(job("cpu"))


ROOT = Path(__file__).parent.parent.parent


def posttrain(*args):
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_estimate_and_validate_print_the_same_numbers(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(source="gs://m/Llama-3.1-70B", training={"batchSize": 64})))
    out = posttrain("estimate", str(path))
    assert out.returncode == 1, out.stderr
    for term in capacity.TERMS:
        assert f"  {term}" in out.stdout
    assert "does not fit" in out.stdout and "LoRA (spec.lora: {rank: 16})" in out.stdout
    assert "spec.training.gradientAccumulation" in out.stdout
    refused = posttrain("validate", str(path))
    assert refused.returncode == 1 and "spec.resources.accelerator: the job does not fit" in (
        refused.stderr
    )
    path.write_text(yaml.safe_dump(job(source="/models/tiny")))
    checked = posttrain("validate", str(path))
    assert checked.returncode == 0 and "warning: spec.model.source: no memory check" in (
        checked.stderr
    )
    assert "no memory check" in posttrain("estimate", str(path)).stdout


def test_flash_attention_keeps_no_scores_and_dots_keeps_the_projections():
    """A flash kernel (attention auto on a TPU) drops the [heads, length, length] terms of
    a dense step; GRPO's learner (Tunix's dense mask) keeps them. remat dots keeps each
    layer's projection outputs beside its input: more than layer, less than none."""
    data = {"source": "/d.jsonl", "maxLength": 4096}
    flash = estimate(job(training={"batchSize": 8, "attention": "auto"}, data=data))
    flash = flash.terms["activations"]
    dense = estimate(job(training={"batchSize": 8, "attention": "dense"}, data=data))
    assert flash < 0.8 * dense.terms["activations"]
    grpo = {"technique": "grpo", "grpo": {"rewards": [{"type": "exactAnswer"}]}}
    assert (
        estimate(job(training={"batchSize": 8}, **grpo)).terms
        == estimate(job(training={"batchSize": 8, "attention": "dense"}, **grpo)).terms
    )
    kept = {
        remat: estimate(job(training={"batchSize": 8, "remat": remat}, data=data)).terms[
            "activations"
        ]
        for remat in ("layer", "dots", "none")
    }
    assert kept["layer"] < kept["dots"] < kept["none"], kept
