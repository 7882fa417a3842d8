"""Each namespace's trainer ServiceAccount and RoleBinding (`render.objects.trainer_access`):
made before the first JobSet there and shared by every job in it, so a job's only write
before its JobSet is the JobSet.

What was made (or found usable) is remembered per namespace for ACCESS_TTL seconds, then
looked at again on the next job's create: one that was deleted by hand is made again
within that time, and the Job controller retries the pods it could not create meanwhile.
Once a namespace's last job is gone (`forget`; so when the namespace is deleted) nothing
is remembered of it: a namespace made again with the same name gets its access with its
first job. One thread at a time per namespace: a burst of jobs in a new
namespace makes them once.
"""

from __future__ import annotations

import threading
import time

from posttrain.controller import kube
from posttrain.render.objects import access_problem, trainer_access

ACCESS_TTL = 300.0

_checked: dict[str, float] = {}  # namespace -> monotonic time it was last made or found
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def _fresh(namespace: str) -> bool:
    checked = _checked.get(namespace)
    return checked is not None and time.monotonic() - checked < ACCESS_TTL


def ensure(namespace: str, cluster_role: str) -> None:
    """Make the namespace's trainer access unless it was made or found lately. Raises
    kube.Refused when an object of its name cannot serve (or the server refuses one as
    invalid), kube.NoTrainerAccess when the server refuses it for the installation's
    sake (the trainer ClusterRole is missing: 404; the operator may not bind it: 403),
    kube.Retry for the rest of what a retry may fix."""
    if _fresh(namespace):
        return
    with _guard:
        lock = _locks.setdefault(namespace, threading.Lock())
    with lock:
        if _fresh(namespace):
            return
        wanted = trainer_access(namespace, cluster_role)
        try:  # One round trip: a RoleBinding may name a ServiceAccount not there yet.
            made = kube.create_all(namespace, wanted)
        except (kube.Refused, kube.Retry) as e:
            if e.status not in (403, 404):
                raise
            raise kube.NoTrainerAccess(
                f"trainer ClusterRole {cluster_role} missing or not bindable by the operator "
                f"(install the chart's, or set POSTTRAIN_TRAINER_CLUSTER_ROLE); {e}",
                delay=5,
            ) from e
        for obj, (stored, created) in zip(wanted, made, strict=True):
            if not created and (problem := access_problem(stored, obj)):
                raise kube.Refused("ForeignObject", problem)
        _checked[namespace] = time.monotonic()


def forget(namespace: str) -> None:
    """The namespace has no job left: its access is looked at again with the next one."""
    _checked.pop(namespace, None)
