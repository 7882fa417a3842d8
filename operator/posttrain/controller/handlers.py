"""kopf handlers: each watch event about a job or one of its children queues that job for
a reconcile (`reconcile.reconcile`, level-based: it looks at everything the indexes of
`watches` hold, whatever the event was). Nothing is decided or written here.

- A job's events: the job itself (created, changed, resumed after a restart, or listed
  again after the watch was lost); jobs whose JobSet is not made yet go first.
- JobSet, pod and Kueue Workload events: the job they belong to (by the job-name label;
  the reconcile checks ownership by UID).

No timer, no finalizer (the job's objects carry owner references: the garbage collector
deletes them with the job), no kopf progress or diff-base annotations on the job (only
event and index handlers are registered, which kopf persists nothing for).
"""

from __future__ import annotations

from typing import Any

import kopf

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.controller import metrics, reconcile, watches
from posttrain.controller.workqueue import WorkQueue
from posttrain.render.jobset import JOB_NAME_LABEL


class Queue:
    """The operator's one WorkQueue, started on the first event (in kopf's context, so
    that its reconciles can post Events through kopf)."""

    queue: WorkQueue | None = None

    @classmethod
    def add(cls, key: reconcile.Key, indexes: dict[str, Any], urgent: bool = False) -> None:
        if cls.queue is None:
            indexes = {k: v for k, v in indexes.items() if k.endswith("_index")}
            cls.queue = WorkQueue(lambda k: reconcile.reconcile(k, indexes, cls.queue))
            cls.queue.start()
        cls.queue.add(key, urgent)


@kopf.on.cleanup()
async def stop_queue(**_: Any) -> None:
    if Queue.queue is not None:
        await Queue.queue.stop()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_job_event(event: dict[str, Any], body: kopf.Body, **kwargs: Any) -> None:
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    status = body.get("status") or {}
    if event["type"] == "DELETED":
        metrics.forget_job(meta["uid"])
        reconcile.Written.forget(key)
        if Queue.queue is not None:
            Queue.queue.drop(key)
        return
    metrics.observe_job(meta["uid"], status.get("phase") or "Pending")
    metrics.observe_job_series(dict(body))
    Queue.add(key, kwargs, urgent=not status.get("jobSetName"))


@kopf.on.event(
    watches.JOBSET_GROUP, watches.JOBSET_VERSION, "jobsets", labels={JOB_NAME_LABEL: kopf.PRESENT}
)
async def on_jobset_event(event: dict[str, Any], body: kopf.Body, **kwargs: Any) -> None:
    meta = body["metadata"]
    key = (meta["namespace"], meta["labels"][JOB_NAME_LABEL])
    if event["type"] == "DELETED":
        reconcile.Written.forget_jobset(key, meta["uid"])
    Queue.add(key, kwargs, urgent=event["type"] == "DELETED")


@kopf.on.event("v1", "pods", labels={JOB_NAME_LABEL: kopf.PRESENT})
async def on_pod_event(namespace: str, labels: kopf.Labels, **kwargs: Any) -> None:
    Queue.add((namespace, labels[JOB_NAME_LABEL]), kwargs)


@kopf.on.event(watches.KUEUE_GROUP, watches.KUEUE_VERSION, "workloads", when=watches.jobset_owned)
async def on_workload_event(namespace: str, body: kopf.Body, **kwargs: Any) -> None:
    for owner in body["metadata"].get("ownerReferences") or []:
        if owner.get("kind") == "JobSet":
            Queue.add((namespace, owner["name"]), kwargs)
