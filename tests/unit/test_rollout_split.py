"""GRPO's trainer/sampler split (spec.grpo.rollout): what admission accepts, what the
rendered JobSet reserves and says, and the status message while the job runs."""

from pathlib import Path

import pytest
from invalid_jobs import valid_job

from posttrain.api import rollout_split
from posttrain.checks import load_job, validate
from posttrain.controller.phase import status_patch
from posttrain.render import render

GOLDEN = Path(__file__).parent.parent / "golden"


def grpo_job(rollout, resources, staleness=0):
    doc = valid_job()
    doc["spec"].update(
        technique="grpo",
        grpo={
            "rewards": [{"type": "exactAnswer"}],
            "rollout": rollout,
            "maxStaleness": staleness,
        },
        resources=resources,
    )
    return doc


@pytest.mark.parametrize(
    ("rollout", "resources", "want"),
    [
        (
            {"placement": "disaggregated", "samplerFraction": 0.25},
            {"accelerator": "nvidia-h100-80gb"},
            "trainer 6 devices, sampler 2 devices",
        ),
        (
            {"placement": "disaggregated", "samplerSlices": 1},
            {"accelerator": "v6e-256", "slices": 4, "pathways": {"enabled": True}},
            "trainer 3 slices (768 devices), sampler 1 slice (256 devices)",
        ),
        (
            {"placement": "disaggregated", "samplerFraction": 0.5},
            {"accelerator": "v6e-4"},  # one host: no Pathways needed
            "trainer 2 devices, sampler 2 devices",
        ),
        (
            {"placement": "disaggregated", "samplerFraction": 0.25},
            {"accelerator": "cpu"},  # the trainer counts its devices
            "sampler 0.25 of the devices",
        ),
    ],
)
def test_valid_splits_are_described(rollout, resources, want):
    doc = grpo_job(rollout, resources, staleness=2)
    if resources.get("pathways"):
        doc["spec"]["output"]["uri"] = "gs://runs/x"
        doc["spec"]["model"]["source"] = "gs://models/tiny"
        doc["spec"]["data"]["source"] = "gs://data/x.jsonl"
    job, errors = validate(doc)
    assert errors == [], errors
    (jobset,) = [o for o in render(job) if o["kind"] == "JobSet"]
    assert jobset["metadata"]["annotations"][rollout_split.ANNOTATION] == want


def test_colocated_jobs_carry_no_split():
    job, errors = validate(grpo_job({}, {"accelerator": "v6e-8"}))
    assert errors == []
    (jobset,) = [o for o in render(job) if o["kind"] == "JobSet"]
    assert rollout_split.ANNOTATION not in jobset["metadata"].get("annotations", {})


def test_jobset_reserves_trainer_and_sampler_slices_and_status_says_the_split():
    objs = render(load_job(GOLDEN / "jobs" / "v6e-16-pathways-grpo-disaggregated.yaml"))
    (jobset,) = [o for o in objs if o["kind"] == "JobSet"]
    workers = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] != "pathways-head"]
    assert sum(r["replicas"] for r in workers) == 2  # 1 trainer slice + 1 sampler slice
    split = jobset["metadata"]["annotations"][rollout_split.ANNOTATION]
    assert split == "trainer 1 slice (16 devices), sampler 1 slice (16 devices)"
    leader = jobset["spec"]["replicatedJobs"][0]
    jobset["status"] = {
        "replicatedJobsStatus": [{"name": leader["name"], "ready": 1, "active": 1}],
    }
    patch = status_patch(jobset, {"output": {"uri": "gs://runs/grpo-split"}}, {}, "t", 1)
    assert patch["phase"] == "Running"
    assert patch["message"].endswith("; " + split), patch["message"]


def test_memory_of_each_side_of_the_split():
    """The trainer's estimate is over its own share of the devices (without the rollout
    cache, which is the sampler's); a sampler share too small for its copy of the model
    and the KV cache is refused naming spec.grpo.rollout."""
    from posttrain import capacity, catalog
    from posttrain.api.spec import PostTrainJobSpec

    def spec_of(fraction):
        doc = grpo_job(
            {"placement": "disaggregated", "samplerFraction": fraction},
            {"accelerator": "nvidia-h100-80gb"},
        )
        doc["spec"]["model"] = {"source": "gs://m/Llama-3.1-70B"}
        doc["spec"]["lora"] = {"rank": 8}
        doc["spec"]["training"] = {"batchSize": 8}
        return doc

    placement = catalog.resolve("nvidia-h100-80gb")
    spec = PostTrainJobSpec.model_validate(spec_of(0.5)["spec"])
    est = capacity.estimate(spec, placement)
    assert est.layout.devices == 4 and est.terms["rollout cache"] == 0
    colocated = PostTrainJobSpec.model_validate(
        grpo_job({}, {})["spec"]
        | {
            "model": {"source": "gs://m/Llama-3.1-70B"},
            "lora": {"rank": 8},
            "training": {"batchSize": 8},
            "resources": {"accelerator": "nvidia-h100-80gb"},
        }
    )
    assert capacity.estimate(colocated, placement).layout.devices == 8
    half = capacity.sampler_need_gib(spec, placement)
    assert 140e9 / 4 / 2**30 < half < 80  # bf16 70B over 4 GPUs, plus the cache
    _, errors = validate(spec_of(0.125))  # one GPU for the sampler: 140 GB of weights
    (err,) = [e for e in errors if e.field == "spec.grpo.rollout"]
    assert "needs about" in err.message and "give the sampler more devices" in err.message
