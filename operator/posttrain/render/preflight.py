"""The preflight Job: before a TPU job's JobSet is made, a short CPU pod of the trainer
image compiles the job's train step for its slice topology with the TPU compiler
(`posttrain estimate --compile`, libtpu's compile-only devices: no TPU used) and writes
the answer to its termination message as JSON (`--result`), which the operator reads
(posttrain.controller.preflight).

The pod reads the job as the trainer does: its config in the pod's own annotation,
mounted by a downwardAPI volume; the model's (and a teacher's) config.json from its
gs:// or hf:// source (`--fetch-configs`, no weights), with the job's HF token. It runs
as the namespace's trainer ServiceAccount without its token (it calls no Kubernetes
API), on CPU nodes (no TPU requested, no TPU toleration).

`program_key` names the compiled program: a hash of the spec fields that change it and
of the image (its compiler), so that a job that differs only in its steps, its data
files, its checkpoints or its outputs is not compiled again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from posttrain import catalog
from posttrain.api.spec import PostTrainJob
from posttrain.render.jobset import CONFIG_FILE, CONFIG_MOUNT, RenderConfig, object_meta
from posttrain.render.names import TRAINER_SERVICE_ACCOUNT
from posttrain.render.trainer_config import CONFIG_ANNOTATION, CONFIG_FILE_NAME, config_text

PREFLIGHT_LABEL = "posttrain.dev/preflight"  # its value: the program key's first 16 hex
KEY_LABEL_LENGTH = 16
CONTAINER = "preflight"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# Bumped when what the key covers, or the answer's form, changes.
KEY_VERSION = "1"

# Spec fields that do not change the compiled train step: dropped before hashing.
IGNORED_TOP = ("scheduling", "checkpoint", "output", "tracking", "hfTokenSecret",
               "preflight", "eval")  # fmt: skip
IGNORED_TRAINING = ("steps", "learningRate", "warmupSteps", "schedule", "seed",
                    "logEverySteps")  # fmt: skip
KEPT_DATA = ("maxLength", "packing", "format")


@dataclass(frozen=True)
class PreflightConfig:
    """The installation's preflight settings (the chart's `preflight` values)."""

    # Compile TPU jobs that leave spec.preflight.compile unset (POSTTRAIN_PREFLIGHT_COMPILE).
    compile: bool = False
    # Without an answer this long after the Job was made, the job goes on without one.
    timeout_seconds: int = 900
    cpu: str = "2"
    memory: str = "8Gi"
    node_selector: dict[str, str] = field(default_factory=dict)
    # The finished Job (and its pod) is deleted this long after (the answer is in status).
    ttl_seconds_after_finished: int = 3600


def applies(job: PostTrainJob, config: PreflightConfig) -> bool:
    """Whether the job is compiled before it takes TPUs: TPU jobs, by spec.preflight.compile
    or else the installation's default."""
    res = job.spec.resources
    try:
        placement = catalog.resolve(
            res.accelerator, res.topology, res.gpus_per_node, res.machine_type
        )
    except catalog.CatalogError:  # validate names the field: nothing to compile
        return False
    if placement.kind != "tpu":
        return False
    wanted = job.spec.preflight.compile if job.spec.preflight is not None else None
    return config.compile if wanted is None else wanted


def image(job: PostTrainJob, render_config: RenderConfig) -> str:
    """The trainer image of the job (its TPU build carries libtpu, the TPU compiler)."""
    return job.spec.image or render_config.trainer_image("tpu")


def program_fields(job: PostTrainJob) -> dict[str, Any]:
    """The spec fields that change the compiled program (see IGNORED_* and KEPT_DATA)."""
    spec = job.spec.to_wire()
    for key in IGNORED_TOP:
        spec.pop(key, None)
    training = dict(spec.get("training") or {})
    for key in IGNORED_TRAINING:
        training.pop(key, None)
    spec["training"] = training
    data = spec.get("data") or {}
    spec["data"] = {k: data[k] for k in KEPT_DATA if k in data}
    return spec


def program_key(job: PostTrainJob, trainer_image: str) -> str:
    """sha256 (hex) of the program's fields and the image that compiles it."""
    doc = {"v": KEY_VERSION, "image": trainer_image, "spec": program_fields(job)}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def job_name(job: PostTrainJob, key: str) -> str:
    """`<job>-pf-<key[:8]>`: at most 52 characters (the Job controller's pod names add 6)."""
    return f"{job.metadata.name[:40].rstrip('-')}-pf-{key[:8]}"


def render_preflight(
    job: PostTrainJob, render_config: RenderConfig, config: PreflightConfig, key: str
) -> dict[str, Any]:
    """The batch/v1 Job that compiles the job's train step once (no retry)."""
    labels = {PREFLIGHT_LABEL: key[:KEY_LABEL_LENGTH], "app.kubernetes.io/component": "preflight"}
    meta = object_meta(job, job_name(job, key), labels)
    resources = {"cpu": config.cpu, "memory": config.memory}
    container = {
        "name": CONTAINER,
        "image": image(job, render_config),
        "command": [
            "posttrain",
            "estimate",
            "--compile",
            "--fetch-configs",
            "--result",
            TERMINATION_MESSAGE_PATH,
            CONFIG_FILE,
        ],  # fmt: skip
        "resources": {"requests": dict(resources), "limits": {"memory": config.memory}},
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
    }
    config_item = {
        "path": CONFIG_FILE_NAME,
        "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"},
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": TRAINER_SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": [{"name": "config", "downwardAPI": {"items": [config_item]}}],
    }
    if job.spec.hf_token_secret:  # a gated hf:// model's config.json needs the token
        ref = job.spec.hf_token_secret
        secret = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
        container["env"] = [{"name": "HF_TOKEN", "valueFrom": secret}]
    if config.node_selector:
        pod_spec["nodeSelector"] = dict(config.node_selector)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": config.timeout_seconds,
            "ttlSecondsAfterFinished": config.ttl_seconds_after_finished,
            "template": {
                "metadata": {
                    "labels": dict(meta["labels"]),
                    "annotations": {CONFIG_ANNOTATION: config_text(job)},
                },
                "spec": pod_spec,
            },
        },
    }
