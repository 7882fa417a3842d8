"""kopf handlers: each watch event about a job or one of its children queues that job for
a reconcile (`reconcile.reconcile`, level-based: it looks at everything the indexes of
`watches` hold, whatever the event was). Nothing is decided or written here.

Every replica runs them (its indexes stay warm); the queue runs only on the one that
holds the leader Lease (`Queue`).

- A job's events: the job itself (created, changed, resumed after a restart, or listed
  again after the watch was lost); jobs whose JobSet is not made yet go first.
- JobSet, Job, pod and Kueue Workload events: the job they belong to (by the job-name label;
  the reconcile checks ownership by UID).
- The JobSet controller's JobCreationFailed Events and the Job controller's FailedCreate
  Events (the only Events streamed): the job of the JobSet they are about (a JobSet is
  named as its job), or of the Job (found by UID among the jobs' Jobs).

No timer, no finalizer (the job's objects carry owner references: the garbage collector
deletes them with the job), no kopf progress or diff-base annotations on the job (only
event and index handlers are registered, which kopf persists nothing for).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from typing import Any

import kopf

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.controller import kube, metrics, reconcile, trainer_access, watches
from posttrain.controller.workqueue import WorkQueue
from posttrain.render.jobset import JOB_NAME_LABEL


class Queue:
    """The operator's one WorkQueue, made on the first event: in kopf's context, so that
    its reconciles can post Events through kopf, and once every index holds its first
    listing (kopf calls no handler before).

    Every replica watches and keeps the indexes; only the one holding the leader Lease
    (`kube.LEADING`) runs the queue's workers. A standby queues nothing; when it takes
    over (`changed`), it queues every job its indexes hold and reconciles them from
    there, without listing anything again. When the Lease is lost the workers stop."""

    queue: WorkQueue | None = None
    indexes: dict[str, Any] = {}
    loop: asyncio.AbstractEventLoop | None = None
    context: contextvars.Context | None = None

    @classmethod
    def add(cls, key: reconcile.Key, indexes: dict[str, Any], urgent: bool = False) -> None:
        if cls.queue is None:
            cls.indexes = {k: v for k, v in indexes.items() if k.endswith("_index")}
            cls.queue = WorkQueue(lambda k: reconcile.reconcile(k, cls.indexes, cls.queue))
            cls.context = contextvars.copy_context()
            cls.loop = asyncio.get_running_loop()
            cls._apply()
        if cls.queue.running:
            cls.queue.add(key, urgent)

    @classmethod
    def changed(cls) -> None:
        """The Lease was taken or lost (any thread): start or pause the workers."""
        if cls.loop is not None:
            with contextlib.suppress(RuntimeError):  # kopf has ended: nothing acts now
                cls.loop.call_soon_threadsafe(cls._apply, context=cls.context)

    @classmethod
    def _apply(cls) -> None:
        queue = cls.queue
        if queue is None or queue.running == kube.LEADING.is_set():
            return
        if queue.running:
            queue.pause()
            return
        queue.start()
        for key in list(cls.indexes.get("job_index") or {}):
            job = watches.job(cls.indexes, *key)
            if job is not None:
                queue.add(key, urgent=not (job.get("status") or {}).get("jobSetName"))


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
        if not any(ns == key[0] for ns, _ in kwargs.get("job_index") or ()):
            trainer_access.forget(key[0])  # its last job (say, the namespace is deleted)
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


@kopf.on.event("batch", "v1", "jobs", labels={JOB_NAME_LABEL: kopf.PRESENT})
async def on_batch_job_event(namespace: str, labels: kopf.Labels, **kwargs: Any) -> None:
    Queue.add((namespace, labels[JOB_NAME_LABEL]), kwargs)


@kopf.on.event(watches.KUEUE_GROUP, watches.KUEUE_VERSION, "workloads", when=watches.jobset_owned)
async def on_workload_event(namespace: str, body: kopf.Body, **kwargs: Any) -> None:
    for owner in body["metadata"].get("ownerReferences") or []:
        if owner.get("kind") == "JobSet":
            Queue.add((namespace, owner["name"]), kwargs)


@kopf.on.event("v1", "events")
async def on_refusal_event(namespace: str, body: kopf.Body, **kwargs: Any) -> None:
    involved = body.get("involvedObject") or {}
    if involved.get("kind") == "JobSet" and involved.get("name"):
        Queue.add((namespace, involved["name"]), kwargs)


@kopf.on.event("events.k8s.io", "v1", "events")
async def on_pod_refusal_event(namespace: str, body: kopf.Body, **kwargs: Any) -> None:
    regarding = body.get("regarding") or {}
    uid = regarding.get("uid")
    if regarding.get("kind") != "Job" or not uid:
        return
    for key, jobs in list((kwargs.get("batch_job_index") or {}).items()):
        if key[0] == namespace and any(job == uid for job, _ in jobs):
            Queue.add(key, kwargs)
            return
