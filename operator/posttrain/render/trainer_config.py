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


# What the live object adds to a job read from a file: its namespace (a DNS label, at
# most 63 characters) and its UID (36), both in the trainer config.
_LIVE = {"namespace": "n" * 63, "uid": "u" * 36}


def _largest(value: Any, path: str) -> str:
    """The path of the largest field under `value` (as JSON), down through mappings."""
    while isinstance(value, dict) and value:
        key, value = max(value.items(), key=lambda kv: len(json.dumps(kv[1])))
        path = f"{path}.{key}"
    return path


def size_error(job: PostTrainJob) -> tuple[str, str] | None:
    """(field, why) when the job's config does not fit in its pods' annotation, on the
    cluster too (where it carries the job's namespace and UID); None when it does. The
    field is the largest one."""
    config = trainer_config(job)
    config["metadata"] = {**_LIVE, **config["metadata"]}
    text = json.dumps(config, separators=(",", ":"), sort_keys=True)
    size = len(CONFIG_ANNOTATION) + len(text.encode())
    if size <= CONFIG_MAX_BYTES:
        return None
    return _largest(config["spec"], "spec"), (
        f"the job's trainer config is {size} bytes as JSON (with the namespace and UID it "
        f"carries in a cluster), over the {CONFIG_MAX_BYTES} it may take in its pods' "
        f"annotation {CONFIG_ANNOTATION!r} (Kubernetes allows {ANNOTATIONS_MAX_BYTES} bytes "
        "for all of a pod's annotations): shorten this field, the largest"
    )
