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


def _creator(kind: str) -> Callable[[str, dict[str, Any]], Any]:
    api = _api_client()
    core, rbac, custom = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api), _custom()
    return {
        "ServiceAccount": core.create_namespaced_service_account,
        "ConfigMap": core.create_namespaced_config_map,
        "Role": rbac.create_namespaced_role,
        "RoleBinding": rbac.create_namespaced_role_binding,
        "JobSet": lambda ns, body, **kw: custom.create_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, ns, JOBSETS, body, **kw
        ),
    }[kind]


def temporary(e: Exception) -> kopf.TemporaryError:
    """Turn an API or connection error into a kopf retry."""
    return kopf.TemporaryError(f"Kubernetes API: {e}", delay=2)


def create_if_absent(namespace: str, obj: dict[str, Any]) -> dict[str, Any] | None:
    """Create obj and return the stored object; None if it already existed. A refusal is
    permanent, except 404 (something it refers to is not there yet): that retries."""
    try:
        response = _creator(obj["kind"])(namespace, obj, _preload_content=False)
        return json.loads(response.data)
    except ApiException as e:
        if e.status == 409:
            return None
        if e.status and 400 <= e.status < 500 and e.status != 404:
            raise kopf.PermanentError(
                f"{obj['kind']} {obj['metadata']['name']}: {e.reason}: {e.body}"
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


def create_all(namespace: str, objects: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """create_if_absent for several independent objects at once (one round trip deep)."""
    return list(_pool.map(lambda obj: create_if_absent(namespace, obj), objects))
