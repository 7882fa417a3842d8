"""Everything a PostTrainJob makes, in creation order.

- ServiceAccount, Role and RoleBinding that let the trainer pods patch the status of
  their own PostTrainJob and nothing else;
- ConfigMap with the job as JSON (the trainer's config; never a secret);
- the JobSet (see `posttrain.render.jobset`).
"""

from __future__ import annotations

import json
from typing import Any

from posttrain import catalog
from posttrain.api.spec import GROUP, PLURAL, PostTrainJob
from posttrain.render import names
from posttrain.render.jobset import (
    RenderConfig,
    object_meta,
    render_jobset,
    trainer_service_account,
)

CONFIG_KEY = "job.json"


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


def render_config_map(job: PostTrainJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, names.config_map_name(job.metadata.name)),
        "data": {CONFIG_KEY: json.dumps(trainer_config(job), indent=2, sort_keys=True)},
    }


def render_trainer_access(job: PostTrainJob) -> list[dict[str, Any]]:
    """ServiceAccount + Role + RoleBinding: patch this job's status, nothing more."""
    name = trainer_service_account(job)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": object_meta(job, name),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": object_meta(job, name),
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": [f"{PLURAL}/status"],
                    "resourceNames": [job.metadata.name],
                    "verbs": ["get", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": object_meta(job, name),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": name,
                    **({"namespace": job.metadata.namespace} if job.metadata.namespace else {}),
                }
            ],
        },
    ]


def render(job: PostTrainJob, config: RenderConfig | None = None) -> list[dict[str, Any]]:
    """All objects for a valid job, in the order to create them."""
    config = config or RenderConfig()
    res = job.spec.resources
    placement = catalog.resolve(res.accelerator, res.topology, res.gpus_per_node, res.machine_type)
    return [
        *render_trainer_access(job),
        render_config_map(job),
        render_jobset(job, placement, config),
    ]
