"""The few Kubernetes API calls the operator makes, over the official client."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kopf
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.render.jobset import JOBSET_API_VERSION

log = logging.getLogger("posttrain.operator")
JOBSET_GROUP, JOBSET_VERSION = JOBSET_API_VERSION.split("/")
JOBSETS = "jobsets"


def _creator(kind: str) -> Callable[[str, dict[str, Any]], Any]:
    core, rbac, custom = (
        client.CoreV1Api(),
        client.RbacAuthorizationV1Api(),
        client.CustomObjectsApi(),
    )
    return {
        "ServiceAccount": core.create_namespaced_service_account,
        "ConfigMap": core.create_namespaced_config_map,
        "Role": rbac.create_namespaced_role,
        "RoleBinding": rbac.create_namespaced_role_binding,
        "JobSet": lambda ns, body: custom.create_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, ns, JOBSETS, body
        ),
    }[kind]


def temporary(e: Exception) -> kopf.TemporaryError:
    """Turn an API or connection error into a kopf retry."""
    return kopf.TemporaryError(f"Kubernetes API: {e}", delay=2)


def create_if_absent(namespace: str, obj: dict[str, Any]) -> bool:
    """Create obj; True if it was created, False if it already existed."""
    try:
        _creator(obj["kind"])(namespace, obj)
        return True
    except ApiException as e:
        if e.status == 409:
            return False
        if e.status and 400 <= e.status < 500:
            raise kopf.PermanentError(
                f"{obj['kind']} {obj['metadata']['name']}: {e.reason}: {e.body}"
            ) from e
        raise temporary(e) from e
    except urllib3.exceptions.HTTPError as e:
        raise temporary(e) from e


def get_jobset(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return client.CustomObjectsApi().get_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise temporary(e) from e
    except urllib3.exceptions.HTTPError as e:
        raise temporary(e) from e


def patch_jobset(namespace: str, name: str, patch: dict[str, Any]) -> None:
    try:
        client.CustomObjectsApi().patch_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name, patch
        )
    except ApiException as e:
        if e.status == 404:
            return
        raise temporary(e) from e
    except urllib3.exceptions.HTTPError as e:
        raise temporary(e) from e


def get_job(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return client.CustomObjectsApi().get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise temporary(e) from e
    except urllib3.exceptions.HTTPError as e:
        raise temporary(e) from e


def patch_job_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    try:
        client.CustomObjectsApi().patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}
        )
    except ApiException as e:
        if e.status == 404:
            return
        raise temporary(e) from e
    except urllib3.exceptions.HTTPError as e:
        raise temporary(e) from e
