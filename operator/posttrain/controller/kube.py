"""The few Kubernetes API calls the operator makes: plain JSON over the official client's
connection pool and credentials, without its typed API classes (each costs memory and
none is needed: every object here is a dict).

Errors a later retry can change (throttling, a server error, a timeout, a conflict) are
`Retry`; a create the API server refuses for good, or an existing object the job does
not own, is `Refused`.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.render.jobset import JOBSET_API_VERSION

log = logging.getLogger("posttrain.operator")
JOB_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/{PLURAL}"
# The collection path of each kind of a job's objects.
COLLECTIONS = {
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
    "JobSet": f"/apis/{JOBSET_API_VERSION}/namespaces/{{namespace}}/jobsets",
    "Event": "/api/v1/namespaces/{namespace}/events",
    "Lease": "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
    "Job": "/apis/batch/v1/namespaces/{namespace}/jobs",  # the preflight's
    "ConfigMap": "/api/v1/namespaces/{namespace}/configmaps",  # the preflight's cache
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
}
MERGE_PATCH = "application/merge-patch+json"
# A 429 (too many requests) is sent again in place this many times, as client-go does;
# after that the job's reconcile is retried with backoff.
THROTTLED_RETRIES = 5


class Retry(Exception):
    """A call that may succeed later: retry after about `delay` seconds."""

    def __init__(self, message: str, delay: float = 1.0, status: int | None = None):
        super().__init__(message)
        self.delay, self.status = delay, status  # status: the API server's answer, if any


class NotLeader(Retry):
    """A write asked for while this replica does not hold the leader Lease."""


# Set while this replica holds the leader Lease (controller/leader.py): only then is a
# write sent. A standby's (or a deposed leader's) write raises NotLeader unsent.
LEADING = threading.Event()


class Refused(Exception):
    """Creating one of a job's objects cannot succeed by retrying: the API server refused
    it, or an object of that name exists that the job does not own. `reason` is the
    job's condition reason, str(self) the one-line message, `status` the API server's
    answer (None for an object in the way)."""

    def __init__(self, reason: str, message: str, status: int | None = None):
        super().__init__(message)
        self.reason, self.status = reason, status


class Waiting(Retry):
    """A retry the job's status explains meanwhile (Pending, `reason`, the message): what
    it waits for is outside the job, and may take a while."""

    reason = "Waiting"


class Leftover(Waiting):
    """An object of the job's name is left from a deleted job of the same name."""

    reason = "WaitingForLeftover"


class NoTrainerAccess(Waiting):
    """The namespace's trainer ServiceAccount or RoleBinding cannot be made (the trainer
    ClusterRole is missing, or the operator may not bind it): the installation's to fix,
    not the job's."""

    reason = "WaitingForTrainerAccess"


@functools.cache
def _api_client() -> client.ApiClient:
    """One client (and connection pool) shared by every thread."""
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = 32
    return client.ApiClient(configuration)


def request(
    method: str,
    path: str,
    body: Any = None,
    *,
    content_type: str = "application/json",
    query: list[tuple[str, str]] | None = None,
    timeout: float = 30,
    standby: bool = False,
) -> dict[str, Any]:
    """One API call; the decoded JSON answer. Raises ApiException for an answer that is
    not 2xx, urllib3's errors when the server cannot be reached. A write is sent only
    while this replica leads, or with standby=True (the Lease's own requests)."""
    if method != "GET" and not standby and not LEADING.is_set():
        raise NotLeader(f"{method} {path}: this replica does not hold the leader Lease")
    api = _api_client()
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    # The body goes to call_api as it is (json.dumps there): param_serialize would first
    # copy it through sanitize_for_serialization, a walk of every JobSet (4% of the
    # operator's CPU in a burst) that turns plain JSON values into themselves.
    method, url, headers, _, post = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=query or [],
        header_params=headers,
        auth_settings=["BearerToken"],
    )
    for attempt in range(THROTTLED_RETRIES + 1):
        response = api.call_api(method, url, headers, body, post, _request_timeout=(5, timeout))
        response.read()
        if response.status != 429 or attempt == THROTTLED_RETRIES:
            break
        # Throttled: the server did nothing; wait as it asks (spread out) and send again.
        wait = _seconds(response.getheader("Retry-After"))
        time.sleep(min(wait, 5.0) * random.uniform(0.5, 1.5))
    if not 200 <= response.status <= 299:
        raise ApiException.from_response(http_resp=response, body=None, data=None)
    return json.loads(response.data) if response.data else {}


def _seconds(text: str | None) -> float:
    try:
        return float(text or 1)
    except ValueError:
        return 1.0


def server_message(e: ApiException) -> str:
    try:
        return json.loads(e.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(e.reason or e.status)


def retry(e: Exception, what: str) -> Retry:
    """A transient error as a Retry (throttling honours the server's Retry-After)."""
    if isinstance(e, ApiException):
        return Retry(
            f"{what}: {e.status} {server_message(e)}",
            _seconds((e.headers or {}).get("Retry-After")),
            status=e.status,
        )
    return Retry(f"{what}: {e}", 2.0)


def owner_uids(obj: dict[str, Any]) -> set[str]:
    return {r.get("uid") for r in obj.get("metadata", {}).get("ownerReferences") or []}


def owned(existing: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """`existing` if it belongs to the job that `wanted` is rendered for. A leftover of an
    earlier job of the same name is waited for (the garbage collector removes it); any
    other object is never used."""
    kind, name = wanted["kind"], wanted["metadata"]["name"]
    if owner_uids(existing) & owner_uids(wanted):
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


# Answers that a later retry can change: not found yet (something it refers to), a
# timeout, a conflict, throttling. Any other 4xx is the server refusing the object.
RETRIABLE_4XX = {404, 408, 409, 429}


def create_or_get_owned(namespace: str, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Create obj; (stored object, True). If it exists and the job owns it (by UID):
    (that object, False). Raises Refused when it exists and is someone else's, or the
    API server refuses it for a reason retrying cannot fix; Retry for the rest."""
    stored, created = create_or_get(namespace, obj)
    return (stored, True) if created else (owned(stored, obj), False)


def create_or_get(namespace: str, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Create obj; (stored object, True), or (the object of its name, False) when one is
    there. Raises Refused when the API server refuses it for a reason retrying cannot
    fix; Retry for the rest."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    collection = COLLECTIONS[kind].format(namespace=namespace)
    try:
        return request("POST", collection, obj), True
    except ApiException as e:
        if e.status == 409:
            existing = read(f"{collection}/{name}")
            if existing is None:  # deleted meanwhile
                raise Retry(f"{kind} {name} was just deleted") from e
            return existing, False
        message = server_message(e)
        if e.status == 403 and "exceeded quota" in message:
            raise Retry(f"{kind} {name}: {message}", delay=30) from e
        if e.status and 400 <= e.status < 500 and e.status not in RETRIABLE_4XX:
            raise Refused(
                "InvalidSpec", f"the API server refused {kind} {name}: {message}", e.status
            ) from e
        raise retry(e, f"create {kind} {name}") from e
    except urllib3.exceptions.HTTPError as e:
        raise retry(e, f"create {kind} {name}") from e


def _unless_gone(what: str, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
    """request(...), or None when the object is not there (404); other failures are
    `retry` errors."""
    try:
        return request(method, path, body, **kwargs)
    except ApiException as e:
        if e.status == 404:
            return None
        raise retry(e, f"{what} {path}") from e
    except urllib3.exceptions.HTTPError as e:
        raise retry(e, f"{what} {path}") from e


def read(path: str) -> dict[str, Any] | None:
    """The object at path; None when there is none."""
    return _unless_gone("read", "GET", path)


def patch(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """Merge-patch the object at path; the object after it, None when it is gone."""
    return _unless_gone("patch", "PATCH", path, body, content_type=MERGE_PATCH)


def pending_workloads(namespace: str, queue: str) -> dict[str, Any] | None:
    """Kueue's visibility API: a LocalQueue's pending Workloads with their positions
    (PendingWorkloadsSummary); None where it cannot be read (not served, no such queue)."""
    path = (
        f"/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/{namespace}/localqueues/"
        f"{queue}/pendingworkloads"
    )
    try:
        return request("GET", path, timeout=5)
    except (ApiException, urllib3.exceptions.HTTPError, ValueError) as e:
        log.debug("no queue positions for %s/%s: %s", namespace, queue, e)
        return None


def workload_path(namespace: str, name: str) -> str:
    return f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads/{name}"


def job_path(namespace: str, name: str) -> str:
    return f"{JOB_PATH.format(namespace=namespace)}/{name}"


def jobset_path(namespace: str, name: str) -> str:
    return f"{COLLECTIONS['JobSet'].format(namespace=namespace)}/{name}"


def patch_job_status(namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any] | None:
    """Merge-patch the job's status (only the fields the operator owns: the trainer's
    `progress` stays); the job after it, None when it is gone."""
    return patch(f"{job_path(namespace, name)}/status", {"status": status})


_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="create")


def create_all(namespace: str, objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], bool]]:
    """create_or_get for several independent objects at once (one round trip deep); the
    first error of any of them is raised once all have answered (a refusal before a
    retry: it is final)."""
    futures = [_pool.submit(create_or_get, namespace, obj) for obj in objects]
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        raise next((e for e in errors if isinstance(e, Refused)), errors[0])
    return [f.result() for f in futures]


BATCH_JOBS = "/apis/batch/v1/namespaces/{namespace}/jobs"


def end_attempt(namespace: str, jobset: dict[str, Any]) -> list[str]:
    """End the Jobs of the JobSet's current attempt (its status.restarts): each gets
    spec.activeDeadlineSeconds 1, so the Job controller fails it (DeadlineExceeded) and
    removes its pods, and the JobSet controller restarts the JobSet, counted against its
    maxRestarts, or fails it. The Jobs' names; a Job already finished is left as it is."""
    meta = jobset["metadata"]
    restarts = str(int((jobset.get("status") or {}).get("restarts") or 0))
    selector = (
        f"jobset.sigs.k8s.io/jobset-name={meta['name']},"
        f"jobset.sigs.k8s.io/restart-attempt={restarts}"
    )
    path = BATCH_JOBS.format(namespace=namespace)
    found = _unless_gone("list", "GET", path, query=[("labelSelector", selector)]) or {}
    ended = []
    for job in found.get("items") or []:
        if meta.get("uid") not in owner_uids(job):
            continue
        done = {c.get("type") for c in (job.get("status") or {}).get("conditions") or []}
        if done & {"Complete", "Failed", "FailureTarget"}:
            continue
        name = job["metadata"]["name"]
        if patch(f"{path}/{name}", {"spec": {"activeDeadlineSeconds": 1}}) is not None:
            ended.append(name)
    return ended
