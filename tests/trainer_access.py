"""The trainer's identity as the operator gives it, on a real API server: the trainer
ClusterRole and status policy as shipped (manifests/base, the chart's with its defaults),
a pod named as the Job controller names a job's trainer pod, and a
token bound to it (as the kubelet's are: its user info carries the pod's name)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml
from invalid_jobs import valid_job
from operator_process import token_kubeconfig

from posttrain.render.names import TRAINER_SERVICE_ACCOUNT
from tests.cluster import wait_for

ROOT = Path(__file__).resolve().parents[1]
POLICY_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
JOBS = "/apis/posttrain.dev/v1alpha1/namespaces/{namespace}/posttrainjobs/{name}"


def install_trainer_policy(plane) -> None:
    """manifests/base's trainer ClusterRole posttrain-trainer (what the operator binds by
    default) and its ValidatingAdmissionPolicy and binding (tests/unit/test_chart.py keeps
    them the chart's), applied server-side as the operator guide's Kustomize install does,
    so the two never conflict; idempotent."""
    base = ROOT / "manifests" / "base"
    docs = [
        d
        for path in ("rbac.yaml", "trainer-policy.yaml")
        for d in yaml.safe_load_all((base / path).read_text())
        if d
        and (
            d["kind"] in POLICY_KINDS
            or (d["kind"], d["metadata"]["name"]) == ("ClusterRole", "posttrain-trainer")
        )
    ]
    assert len(docs) == 3, [d["kind"] for d in docs]
    plane.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))
    # In force once a trainer's create (as system:masters too, past RBAC; dry run) is
    # refused by it: it names no job, and the policy lets a trainer only patch status.
    job = valid_job("policy-probe")
    probe = [
        "create", "--dry-run=server", "-f", "-", "--as-group=system:masters",
        f"--as=system:serviceaccount:default:{TRAINER_SERVICE_ACCOUNT}",
    ]  # fmt: skip

    def in_force() -> bool:
        proc = plane.kubectl(*probe, input=json.dumps(job), check=False)
        return "may only patch its job's status" in proc.stderr

    wait_for(in_force, timeout=30, what="the trainer status policy to be in force")


def remove_trainer_policy(plane) -> None:
    """Delete what install_trainer_policy made (cluster-scoped: a later `helm install
    posttrain` on this plane must not find them)."""
    plane.kubectl(
        "delete", "--ignore-not-found", "clusterrole/posttrain-trainer",
        "validatingadmissionpolicy/posttrain-trainer-status",
        "validatingadmissionpolicybinding/posttrain-trainer-status",
    )  # fmt: skip


def trainer_pod(plane, namespace: str, job: str, rjob: str = "node") -> dict[str, Any]:
    """A pod named as the Job controller names `job`'s first pod of replicated job
    `rjob`, running as the trainer ServiceAccount (no kubelet runs it here)."""
    suffix = "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job}-{rjob}-0-0-{suffix}", "namespace": namespace},
        "spec": {
            "serviceAccountName": TRAINER_SERVICE_ACCOUNT,
            "containers": [{"name": "trainer", "image": "posttrain-trainer:test"}],
        },
    }
    out = plane.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(pod)).stdout
    return json.loads(out)


def trainer_client(plane, namespace: str, pod: dict[str, Any], workdir: Path):
    """An API client with a token of the namespace's trainer ServiceAccount bound to
    `pod`."""
    from kubernetes import config

    path = workdir / f"{pod['metadata']['name']}.kubeconfig"
    token_kubeconfig(plane, namespace, TRAINER_SERVICE_ACCOUNT, path, pod=pod)
    return config.new_client_from_config(str(path))


def patch_status(
    api, namespace: str, name: str, body: dict, headers: dict[str, str] | None = None, sub="/status"
) -> tuple[int, str]:
    """A merge patch of job `name`'s status (or, sub="", the job); (HTTP status, the
    server's message)."""
    headers = {
        "Content-Type": "application/merge-patch+json",
        "Accept": "application/json",
        **(headers or {}),
    }
    path = JOBS.format(namespace=namespace, name=name) + sub
    method, url, headers, body, post = api.param_serialize(
        "PATCH", path, header_params=headers, body=body, auth_settings=["BearerToken"]
    )
    response = api.call_api(method, url, headers, body, post)
    response.read()
    if response.status < 300:
        return response.status, ""
    return response.status, json.loads(response.data).get("message", "")


def impersonating(user: str, pod_name: str | None) -> dict[str, str]:
    """Headers that make the admin's request one of `user` with the pod-name user extra
    a bound token carries (what `kubectl --as=... --as-user-extra=...` sends)."""
    headers = {"Impersonate-User": user}
    if pod_name is not None:
        headers["Impersonate-Extra-" + quote(POD_NAME_EXTRA, safe="")] = pod_name
    return headers
