"""The few Kubernetes API calls the operator makes, over the official client."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import kopf
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.render.jobset import JOBSET_API_VERSION

log = logging.getLogger("posttrain.operator")
JOBSET_GROUP, JOBSET_VERSION = JOBSET_API_VERSION.split("/")
JOBSETS = "jobsets"
T = TypeVar("T")


@functools.cache
def _api_client() -> client.ApiClient:
    """One client (and connection pool) shared by every handler thread."""
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = 32
    return client.ApiClient(configuration)


def _custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(_api_client())


# The kinds of a job's objects other than its JobSet: (client API, method name part).
_TYPED = {
    "ServiceAccount": (client.CoreV1Api, "service_account"),
    "ConfigMap": (client.CoreV1Api, "config_map"),
    "Role": (client.RbacAuthorizationV1Api, "role"),
    "RoleBinding": (client.RbacAuthorizationV1Api, "role_binding"),
}


def _method(kind: str, verb: str) -> Callable[..., Any]:
    """The client call that does `verb` ("create" or "read") to a job's object of `kind`:
    create(namespace, body, **kw), read(name, namespace, **kw)."""
    if kind == "JobSet":
        custom = _custom()
        if verb == "create":
            return lambda ns, body, **kw: custom.create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, ns, JOBSETS, body, **kw
            )
        return lambda name, ns, **kw: custom.get_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, ns, JOBSETS, name, **kw
        )
    api, name = _TYPED[kind]
    return getattr(api(_api_client()), f"{verb}_namespaced_{name}")


def temporary(e: Exception) -> kopf.TemporaryError:
    """Turn an API or connection error into a kopf retry."""
    return kopf.TemporaryError(f"Kubernetes API: {e}", delay=2)


class Refused(Exception):
    """Creating one of a job's objects cannot succeed by retrying: the API server refused
    it, or an object of that name exists that the job does not own. `reason` is the
    job's condition reason, str(self) the one-line message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Leftover(kopf.TemporaryError):
    """An object of the job's name is left from a deleted job of the same name."""


# Answers that a later retry can change: not found yet (something it refers to), a
# timeout, a conflict, throttling, and a ResourceQuota that is full for now (403). Any
# other 4xx is the server refusing the object.
RETRIABLE_4XX = {404, 408, 409, 429}


def _server_message(e: ApiException) -> str:
    try:
        return json.loads(e.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(e.reason or e.status)


def owner_uids(obj: dict[str, Any]) -> set[str]:
    return {r.get("uid") for r in obj.get("metadata", {}).get("ownerReferences") or []}


def owned(namespace: str, existing: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """`existing` if it belongs to the job that `wanted` is rendered for. A leftover of an
    earlier job of the same name is waited for (the garbage collector removes it); any
    other object is never used."""
    kind, name = wanted["kind"], wanted["metadata"]["name"]
    mine = owner_uids(wanted)
    if owner_uids(existing) & mine:
        return existing
    (job_ref,) = wanted["metadata"]["ownerReferences"]
    earlier = [
        r
        for r in existing.get("metadata", {}).get("ownerReferences") or []
        if r.get("kind") == job_ref["kind"]
        and r.get("apiVersion") == job_ref["apiVersion"]
        and r.get("name") == job_ref["name"]
    ]
    if earlier:
        raise Leftover(
            f"waiting for the garbage collector to delete {kind} {name} "
            "of an earlier job of this name",
            delay=5,
        )
    raise Refused(
        "ForeignObject",
        f"{kind} {name} already exists and is not owned by this job; "
        f"the operator will not use it: delete it, or rename the job",
    )


def create_or_get_owned(namespace: str, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Create obj; (stored object, True). If it exists and the job owns it (by UID):
    (that object, False). Raises Refused when it exists and is someone else's, or the
    API server refuses it for a reason retrying cannot fix; transient errors retry."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    try:
        response = _method(kind, "create")(namespace, obj, _preload_content=False)
        return json.loads(response.data), True
    except ApiException as e:
        if e.status == 409:
            existing = _call(
                lambda: json.loads(
                    _method(kind, "read")(name, namespace, _preload_content=False).data
                )
            )
            if existing is None:  # deleted meanwhile
                raise kopf.TemporaryError(f"{kind} {name} was just deleted", delay=1) from e
            return owned(namespace, existing, obj), False
        if e.status == 403 and "exceeded quota" in _server_message(e):
            raise kopf.TemporaryError(f"{kind} {name}: {_server_message(e)}", delay=30) from e
        if e.status and 400 <= e.status < 500 and e.status not in RETRIABLE_4XX:
            raise Refused(
                "InvalidSpec",
                f"the API server refused {kind} {name}: {_server_message(e)}",
            ) from e
        raise temporary(e) from e
    except urllib3.exceptions.HTTPError as e:
        raise temporary(e) from e


def _call(call: Callable[[], T], *, missing: T | None = None) -> T | None:
    """call(); `missing` when the object is gone (404). Other API and connection errors
    become kopf retries."""
    try:
        return call()
    except ApiException as e:
        if e.status == 404:
            return missing
        raise temporary(e) from e
    except urllib3.exceptions.HTTPError as e:
        raise temporary(e) from e


def get_jobset(namespace: str, name: str) -> dict[str, Any] | None:
    return _call(
        lambda: _custom().get_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name
        )
    )


def patch_jobset(namespace: str, name: str, patch: dict[str, Any]) -> None:
    _call(
        lambda: _custom().patch_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name, patch
        )
    )


def set_workload_active(namespace: str, name: str, active: bool) -> None:
    """Deactivate (or activate) a Kueue Workload: Kueue's way to stop a job it admitted."""
    _call(
        lambda: _custom().patch_namespaced_custom_object(
            "kueue.x-k8s.io", "v1beta2", namespace, "workloads", name, {"spec": {"active": active}}
        )
    )


def pending_workloads(namespace: str, queue: str) -> dict[str, Any] | None:
    """Kueue's visibility API: a LocalQueue's pending Workloads with their positions
    (PendingWorkloadsSummary); None where it cannot be read (not served, no such queue)."""
    path = (
        f"/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/{namespace}/localqueues/"
        f"{queue}/pendingworkloads"
    )
    api = _api_client()
    try:
        request = api.param_serialize(
            "GET", path, header_params={"Accept": "application/json"}, auth_settings=["BearerToken"]
        )
        response = api.call_api(*request, _request_timeout=5)
        response.read()
        if response.status != 200:
            log.debug("no queue positions for %s/%s: HTTP %s", namespace, queue, response.status)
            return None
        return json.loads(response.data)
    except (ApiException, urllib3.exceptions.HTTPError, ValueError) as e:
        log.debug("no queue positions for %s/%s: %s", namespace, queue, e)
        return None


def get_job(namespace: str, name: str) -> dict[str, Any] | None:
    return _call(
        lambda: _custom().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    )


class Conflict(Exception):
    """The object changed since it was read (optimistic concurrency)."""


def patch_job_status(
    namespace: str, name: str, status: dict[str, Any], resource_version: str | None = None
) -> None:
    """Merge-patch status; with resource_version, only if the object is unchanged since
    (raises Conflict otherwise)."""
    body: dict[str, Any] = {"status": status}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    try:
        _custom().patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, body
        )
    except ApiException as e:
        if e.status == 404:
            return
        if e.status == 409 and resource_version:
            raise Conflict(name) from e
        raise temporary(e) from e
    except urllib3.exceptions.HTTPError as e:
        raise temporary(e) from e


_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="create")


def create_all(namespace: str, objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], bool]]:
    """create_or_get_owned for several independent objects at once (one round trip deep);
    the first error of any of them is raised once all have answered."""
    futures = [_pool.submit(create_or_get_owned, namespace, obj) for obj in objects]
    return [f.result() for f in futures]
