"""The trainer's config: the job without its status, as compact JSON in an annotation of
the trainer's pod template (CONFIG_ANNOTATION), which a downwardAPI volume mounts as the
file the trainer reads. No ConfigMap, so nothing to create before the JobSet. It never
holds a secret: the spec names Secrets only by reference (spec.hfTokenSecret).

Kubernetes allows 256 KiB for all of an object's annotations together; JobSet, the Job
controller and Kueue add their own (well under 1 KiB), so a config may take CONFIG_MAX_BYTES.
"""

from __future__ import annotations

import json
from typing import Any

from posttrain.api.spec import PostTrainJob

CONFIG_ANNOTATION = "posttrain.dev/config"
CONFIG_FILE_NAME = "job.json"
ANNOTATIONS_MAX_BYTES = 256 * 1024  # the API server's limit for all of them
CONFIG_MAX_BYTES = ANNOTATIONS_MAX_BYTES - 16 * 1024


def trainer_config(job: PostTrainJob) -> dict[str, Any]:
    """The document the trainer reads: the job without status."""
    meta = {"name": job.metadata.name}
    for key in ("namespace", "uid"):
        if value := getattr(job.metadata, key):
            meta[key] = value
    return {
        "apiVersion": job.api_version,
        "kind": job.kind,
        "metadata": meta,
        "spec": job.spec.to_wire(),
    }


def config_text(job: PostTrainJob) -> str:
    """trainer_config as the annotation's value (compact JSON, keys sorted)."""
    return json.dumps(trainer_config(job), separators=(",", ":"), sort_keys=True)


def size_error(job: PostTrainJob) -> str | None:
    """Why the job's config does not fit in its pods' annotation; None when it does."""
    size = len(CONFIG_ANNOTATION) + len(config_text(job).encode())
    if size <= CONFIG_MAX_BYTES:
        return None
    return (
        f"the job's trainer config is {size} bytes as JSON, over the {CONFIG_MAX_BYTES} it "
        f"may take in its pods' annotation {CONFIG_ANNOTATION!r} (Kubernetes allows "
        f"{ANNOTATIONS_MAX_BYTES} bytes for all of a pod's annotations): shorten its longest "
        "lists and strings"
    )
