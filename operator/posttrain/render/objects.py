"""Everything a PostTrainJob makes, and what its namespace needs once.

Per job: only the JobSet (see `posttrain.render.jobset`); the trainer's config travels in
its pod template (`posttrain.render.trainer_config`).

Per namespace, made once by the operator before the first JobSet there and shared by
every job in it (`trainer_access`): the ServiceAccount TRAINER_SERVICE_ACCOUNT and a
RoleBinding granting it the chart's trainer ClusterRole (patch posttrainjobs/status).
The chart's ValidatingAdmissionPolicy narrows that on the API server to the one job whose
pods present the token: the pod name in the token's user info must be one of that job's
trainer pods (`names.TRAINER_REPLICATED_JOBS`).
"""

from __future__ import annotations

from typing import Any

from posttrain import catalog
from posttrain.api.spec import PostTrainJob
from posttrain.render import names
from posttrain.render.jobset import RenderConfig, render_jobset
from posttrain.render.network import network_policy

TRAINER_LABELS = {
    "app.kubernetes.io/name": "posttrain",
    "app.kubernetes.io/component": "trainer",
    "app.kubernetes.io/managed-by": "posttrain-operator",
}


def trainer_access(namespace: str, cluster_role: str) -> list[dict[str, Any]]:
    """The namespace's trainer ServiceAccount and its RoleBinding to `cluster_role`."""
    name = names.TRAINER_SERVICE_ACCOUNT
    meta = {"name": name, "namespace": namespace, "labels": dict(TRAINER_LABELS)}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta,
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {**meta, "labels": dict(TRAINER_LABELS)},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": cluster_role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def access_problem(existing: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """Why an object of trainer_access's name that is already there cannot serve (None:
    it can). Any ServiceAccount of the name does (an admin may have made it, say with a
    Workload Identity annotation); a RoleBinding must grant the wanted role to it."""
    if wanted["kind"] != "RoleBinding":
        return None
    subject = wanted["subjects"][0]
    held = [
        s
        for s in existing.get("subjects") or []
        if (s.get("kind"), s.get("name"), s.get("namespace"))
        == (subject["kind"], subject["name"], subject["namespace"])
    ]
    if existing.get("roleRef") == wanted["roleRef"] and held:
        return None
    role = wanted["roleRef"]["name"]
    return (
        f"RoleBinding {wanted['metadata']['name']} already exists and does not bind "
        f"ClusterRole {role} to ServiceAccount {subject['name']}; the operator will not "
        "use it: delete it (the operator makes it again)"
    )


def render(job: PostTrainJob, config: RenderConfig | None = None) -> list[dict[str, Any]]:
    """All objects for a valid job, in the order to create them."""
    config = config or RenderConfig()
    res = job.spec.resources
    placement = catalog.resolve(res.accelerator, res.topology, res.gpus_per_node, res.machine_type)
    policy = network_policy(job, config)  # first: the pods never run without it
    return [*([policy] if policy else []), render_jobset(job, placement, config)]
