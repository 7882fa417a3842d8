"""`posttrain logs NAME`: the trainer log of a job on a cluster.

The log worth reading is JAX process 0's: the first pod of the JobSet's first replicated
job (job index 0, completion index 0), in its newest restart attempt, container
`trainer`. With -f the command follows that log and, when the pod goes away (a restart,
a preemption), moves on to the next attempt's pod, until the PostTrainJob finishes.
Reads only: the PostTrainJob, its JobSet, its pods and their logs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.render.names import jobset_name

JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
RJOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
CONTAINER = "trainer"
FINISHED = {"Succeeded", "Failed"}


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def leader_pod(pods: list[dict[str, Any]], first_replicated_job: str) -> dict[str, Any] | None:
    """Process 0's pod of the newest restart attempt (the newest pod among equals)."""
    candidates = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        index = labels.get(COMPLETION_INDEX_LABEL) or (meta.get("annotations") or {}).get(
            COMPLETION_INDEX_LABEL
        )
        if (
            labels.get(RJOB_LABEL) == first_replicated_job
            and labels.get(JOB_INDEX_LABEL) == "0"
            and index == "0"
        ):
            candidates.append(pod)
    if not candidates:
        return None
    return max(
        candidates,
        key=lambda p: (
            _int(p["metadata"].get("labels", {}).get(ATTEMPT_LABEL)),
            p["metadata"].get("creationTimestamp") or "",
        ),
    )


class Cluster:
    """The reads `posttrain logs` makes, through the user's kubeconfig."""

    def __init__(self, namespace: str | None):
        from kubernetes import client, config

        config.load_kube_config()
        self.namespace = namespace or config.list_kube_config_contexts()[1]["context"].get(
            "namespace", "default"
        )
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()
        self.api = client.ApiClient()

    def job(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def first_replicated_job(self, name: str) -> str | None:
        from kubernetes.client.exceptions import ApiException

        try:
            js = self.custom.get_namespaced_custom_object(
                "jobset.x-k8s.io", "v1alpha2", self.namespace, "jobsets", jobset_name(name)
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        jobs = js.get("spec", {}).get("replicatedJobs") or []
        return jobs[0]["name"] if jobs else None

    def leader(self, name: str, first: str) -> dict[str, Any] | None:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{JOBSET_LABEL}={jobset_name(name)}"
        )
        return leader_pod(self.api.sanitize_for_serialization(pods)["items"], first)

    def stream(self, pod: str, follow: bool):
        response = self.core.read_namespaced_pod_log(
            pod, self.namespace, container=CONTAINER, follow=follow, _preload_content=False
        )
        yield from response.stream()


def not_started(pod: dict[str, Any]) -> str | None:
    """Why a pod has no trainer log yet (it is Pending: unscheduled, pulling, ...), or
    None once its containers have started."""
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending"):
        return None
    for c in status.get("containerStatuses") or []:
        waiting = (c.get("state") or {}).get("waiting")
        if c.get("name") == CONTAINER and waiting:
            return f"{waiting.get('reason')}: {waiting.get('message') or ''}".strip(": ")
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return f"not scheduled: {c.get('message') or c.get('reason')}"
    return "Pending" if (pod.get("spec") or {}).get("nodeName") else "not scheduled yet"


def _status_line(job: dict[str, Any]) -> str:
    status = job.get("status") or {}
    return f"phase {status.get('phase') or 'Pending'}: {status.get('message') or 'no message'}"


def logs_command(args: argparse.Namespace) -> int:
    """Exit codes: 0 the log was printed (to its end, or the job's with -f); 1 no log to
    print: no cluster configured or reachable, no such job, no pod, not started yet."""
    import urllib3
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException

    try:
        cluster = Cluster(args.namespace)
    except (ConfigException, OSError) as e:
        why = " ".join(str(e).split())[:200]
        print(
            f"posttrain: no Kubernetes cluster configured ({why}): set KUBECONFIG or "
            "write ~/.kube/config (kubectl config view shows what is used)",
            file=sys.stderr,
        )
        return 1
    try:
        return _print_logs(cluster, args)
    except urllib3.exceptions.HTTPError as e:
        host = cluster.api.configuration.host
        print(
            f"posttrain: cannot reach the API server at {host} ({e.__class__.__name__})",
            file=sys.stderr,
        )
    except ApiException as e:
        print(f"posttrain: the API server answered {e.status} {e.reason}", file=sys.stderr)
    return 1


def _print_logs(cluster: Cluster, args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    where = f"{cluster.namespace}/{args.name}"
    done: set[str] = set()  # pods whose log was read to its end
    while True:
        job = cluster.job(args.name)
        if job is None:
            print(f"posttrain: no PostTrainJob {where}", file=sys.stderr)
            return 1
        finished = _phase(job) in FINISHED
        first = cluster.first_replicated_job(args.name)
        pod = cluster.leader(args.name, first) if first else None
        if pod is None or pod["metadata"]["name"] in done:
            if pod is None and (not args.follow or finished):
                print(
                    f"posttrain: {where} has no trainer pod ({_status_line(job)})", file=sys.stderr
                )
                return 1
            if finished or not args.follow:
                return 0
            time.sleep(2)  # waiting for the next attempt's pod
            continue
        name = pod["metadata"]["name"]
        if (why := not_started(pod)) is not None:
            if not args.follow:
                print(f"posttrain: {name} has not started yet ({why})", file=sys.stderr)
                return 1
            time.sleep(2)
            continue
        attempt = pod["metadata"].get("labels", {}).get(ATTEMPT_LABEL, "0")
        print(f"--- {name} (restart attempt {attempt}) ---", file=sys.stderr)
        try:
            for chunk in cluster.stream(name, args.follow):
                sys.stdout.write(chunk.decode("utf-8", "replace"))
                sys.stdout.flush()
            done.add(name)
        except ApiException as e:  # not started yet, or its node cannot be reached
            reason = " ".join(str(e.body or e.reason).split())[:300]
            if not args.follow:
                print(f"posttrain: no log from {name} yet: {reason}", file=sys.stderr)
                return 1
            time.sleep(2)


def _phase(job: dict[str, Any]) -> str | None:
    return (job.get("status") or {}).get("phase")
