"""Reconcile one job: gather it and its children from the watches' indexes (no reads),
decide with `actions.decide`, apply with `kube`.

Both run in a worker thread, `apply` with a copy, and make only the calls the decision
asks for: the JobSet when it is not there (after the namespace's trainer
ServiceAccount, made once per namespace: `trainer_access`), a JobSet patch for a
spec.scheduling change or to suspend a failed job's JobSet (and a Workload patch to
deactivate it), a status patch when the status changed. What it writes is
remembered (`Written`) until the watches bring it back, so the next reconcile does not
take it for missing or stale.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kopf

from posttrain.api.spec import Phase, PostTrainJob
from posttrain.checks import validate
from posttrain.controller import deadline, kube, metrics, preflight, trainer_access, watches
from posttrain.controller.actions import (
    Actions,
    Event,
    Observed,
    decide,
    scheduling_annotation,
    status_write,
)
from posttrain.controller.phase import (
    Observation,
    observation_patch,
    status_reason,
    waits_in_queue,
)
from posttrain.controller.preflight import CACHE_CONFIGMAP
from posttrain.controller.watches import SCHEDULING_ANNOTATION, job_summary, jobset_summary
from posttrain.controller.workqueue import WorkQueue
from posttrain.render import RenderConfig, render
from posttrain.render import preflight as preflight_render
from posttrain.render.preflight import PreflightConfig

log = logging.getLogger("posttrain.operator")
Key = tuple[str, str]


class State:
    """Operator-wide settings, set once by `posttrain operator` before kopf starts."""

    render_config = RenderConfig()
    preflight = PreflightConfig()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _version(obj: dict[str, Any] | None) -> int:
    try:
        return int((obj or {}).get("metadata", {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


class Written:
    """The job and JobSet bodies this operator's last writes returned, by job key, until
    the watches bring that version (or a newer one) back."""

    jobs: dict[Key, dict[str, Any]] = {}
    jobsets: dict[Key, dict[str, Any]] = {}

    @classmethod
    def newest(cls, store: dict[Key, dict], key: Key, seen: dict | None) -> dict | None:
        mine = store.get(key)
        if mine is None:
            return seen
        same = seen is None or mine["metadata"].get("uid") == seen["metadata"].get("uid")
        if same and _version(mine) > _version(seen):
            return mine
        store.pop(key, None)
        return seen

    @classmethod
    def forget_jobset(cls, key: Key, uid: str) -> None:
        """A JobSet is gone: what was written of it is no longer there."""
        if (cls.jobsets.get(key) or {}).get("metadata", {}).get("uid") == uid:
            cls.jobsets.pop(key, None)

    @classmethod
    def forget(cls, key: Key) -> None:
        cls.jobs.pop(key, None)
        cls.jobsets.pop(key, None)
        cls.ended.pop(key, None)

    # The JobSet attempt (UID, restarts) whose Jobs this operator ended for a job whose
    # trainer stopped reporting (`actions.stalled`), so that it does so once.
    ended: dict[Key, tuple[str, int]] = {}

    @classmethod
    def attempt(cls, jobset: dict[str, Any] | None) -> tuple[str, int] | None:
        if jobset is None:
            return None
        restarts = int((jobset.get("status") or {}).get("restarts") or 0)
        return jobset["metadata"].get("uid"), restarts


def gather(key: Key, indexes: dict[str, Any]) -> tuple[dict[str, Any], Observed] | None:
    """The job and its children as last seen; None when it is gone. (A queued job's
    position is read from Kueue's visibility API, at most once per queue and 10 s.)"""
    namespace, name = key
    seen = watches.job(indexes, namespace, name)
    if seen is None:  # deleted: what was written of it is gone too
        Written.forget(key)
        return None
    job = Written.newest(Written.jobs, key, seen)
    uid = job["metadata"]["uid"]
    jobset = watches.jobset(indexes, namespace, name, uid)
    mine = Written.jobsets.get(key)
    if mine is not None and uid not in kube.owner_uids(mine):
        Written.jobsets.pop(key, None)  # of an earlier job of this name
    jobset = Written.newest(Written.jobsets, key, jobset)
    pods = tuple(watches.pods(indexes, namespace, name, jobset))
    observed = Observed(
        jobset=jobset,
        pods=pods,
        workload=watches.workload(indexes, namespace, jobset),
        blocked=watches.blocked(indexes, namespace, jobset, len(pods)),
        restart_requested=(attempt := Written.attempt(jobset)) is not None
        and Written.ended.get(key) == attempt,
        preflight=tuple(watches.preflight_pods(indexes, namespace, name)) if jobset is None else (),
        preflight_of_key=(lambda label: watches.preflight_of_key(indexes, namespace, label))
        if jobset is None
        else None,
    )
    # The index's copy is the caller's own; what a write returned is shared with Written.
    return (job if job is seen else copy.deepcopy(job)), observed


@dataclass
class Result:
    """What a reconcile did: filled as it goes, so a retry after a partial one keeps it."""

    kind: str = "status"  # "create" when it made (or found) the job's objects
    job: dict[str, Any] | None = None  # the job after its status write
    jobset: dict[str, Any] | None = None  # the JobSet after its create or patch
    events: list[Event] = field(default_factory=list)
    waiting: bool = False  # it waits in a Kueue queue
    deferred: bool = False  # its JobSet was made, its status is left for the next reconcile
    check_in: float | None = None  # seconds until its progress deadline passes


def _fail(job: dict[str, Any], reason: str, message: str) -> Actions:
    """The job cannot run: Failed with `reason` and `message`, a Warning Event, no retry."""
    meta = job["metadata"]
    log.warning("job %s/%s failed: %s: %s", meta["namespace"], meta["name"], reason, message)
    return _observed(job, Observation(Phase.failed, reason, message))


def _observed(job: dict[str, Any], obs: Observation) -> Actions:
    previous = job.get("status") or {}
    patch = observation_patch(
        obs, job.get("spec") or {}, previous, _now(), job["metadata"].get("generation")
    )
    return status_write(previous, patch)


def _write_status(job: dict[str, Any], actions: Actions, result: Result) -> None:
    if actions.status is None:
        return
    meta = job["metadata"]
    stored = kube.patch_job_status(meta["namespace"], meta["name"], actions.status)
    result.job = job_summary(stored) if stored is not None else None
    result.events.extend(actions.events)


def _children(
    job: dict[str, Any], result: Result, observed: Observed | None = None
) -> dict[str, Any] | None:
    """Make whatever of the job's objects is missing and return its JobSet; None when
    the job cannot run (its status says why), or waits for its preflight."""
    result.kind = "create"
    parsed, errors = validate(job)
    # With a preflight the TPU compiler decides whether it fits, not the fast estimate
    # (which stands again when the compiler gives no answer).
    memory = [e for e in errors if e.message.startswith(preflight.MEMORY_REFUSAL)]
    compile_first = (
        parsed is not None
        and len(memory) == len(errors)
        and preflight_render.applies(parsed, State.preflight)
    )
    if parsed is None or (errors and not (compile_first and len(memory) == len(errors))):
        _write_status(job, _fail(job, "InvalidSpec", "; ".join(str(e) for e in errors)), result)
        return None
    namespace = job["metadata"]["namespace"]
    if compile_first and not _preflight(job, parsed, memory, observed, result):
        return None
    *first, jobset = render(parsed, State.render_config)  # first: its NetworkPolicy
    annotations = jobset["metadata"].setdefault("annotations", {})
    annotations[SCHEDULING_ANNOTATION] = scheduling_annotation(job.get("spec") or {})
    try:
        # The JobSet's trainer pods run as the namespace's trainer ServiceAccount.
        trainer_access.ensure(namespace, State.render_config.trainer_cluster_role)
        for obj in first:
            kube.create_or_get_owned(namespace, obj)
        stored, created = kube.create_or_get_owned(namespace, jobset)
    except kube.Refused as e:
        _write_status(job, _fail(job, e.reason, str(e)), result)
        return None
    except kube.Waiting as e:
        _write_status(job, _observed(job, Observation(Phase.pending, e.reason, str(e))), result)
        raise
    result.jobset = jobset_summary(stored)
    if created:  # no Event of its own: the job's new phase (Pending) has one
        log.info("created JobSet %s/%s", namespace, jobset["metadata"]["name"])
    return result.jobset


def _preflight(
    job: dict[str, Any],
    parsed: PostTrainJob,
    memory: list[Any],
    observed: Observed | None,
    result: Result,
) -> bool:
    """The TPU compiler's check of a TPU job before its JobSet is made: True to go on
    (it fits, or no answer came and the fast estimate admits it); False while it waits
    for the preflight pod (its Job made, status Pending with reason Preflight), or when
    the job failed (it does not fit). Answers are cached per namespace by program key."""
    meta = job["metadata"]
    namespace = meta["namespace"]
    config, render_config = State.preflight, State.render_config
    key = preflight_render.program_key(parsed, preflight_render.image(parsed, render_config))
    name = preflight_render.job_name(parsed, key)
    previous = (job.get("status") or {}).get("preflight") or {}
    accelerator = parsed.spec.resources.accelerator
    pods = list(observed.preflight) if observed is not None else []
    label = key[: preflight_render.KEY_LABEL_LENGTH]
    lookup = observed.preflight_of_key if observed is not None else None
    others, jobs = lookup(label) if lookup is not None else ([], [])
    mine = {p.name for p in pods}
    others = [p for p in others if p.name not in mine]
    elsewhere = next((j.name for j in jobs if not j.finished and j.name != name), None)
    elsewhere = elsewhere or InFlight.other(namespace, label, name)
    cache_path = f"{kube.COLLECTIONS['ConfigMap'].format(namespace=namespace)}/{CACHE_CONFIGMAP}"

    def next_step(entry: dict[str, Any] | None) -> preflight.Step:
        return preflight.next_step(key, previous, pods, entry, _now(), config.timeout_seconds,
                                   name, others, elsewhere)  # fmt: skip

    step = next_step(None)
    if (step.create or step.shared) and not pods:  # an earlier compile may have answered
        cache = kube.read(cache_path)
        step = next_step(preflight.cached_answer((cache or {}).get("data"), key))
    if step.create and (other := InFlight.claim(namespace, label, name)) is not None:
        step = preflight.Step(shared=other, check_in=preflight.SHARED_POLL_SECONDS)
    if step.shared is not None:  # the same program compiles for another job: its answer
        fields = preflight.status_fields(None, key, step.shared, _now(), accelerator)
        obs = Observation(Phase.pending, preflight.CONDITION, fields["message"])
        _write_status(job, _with_preflight(job, _observed(job, obs), fields), result)
        result.check_in = step.check_in
        return False
    if step.answer is None:
        result.check_in = step.check_in
        if not step.create:
            return False
        pf_job = preflight_render.render_preflight(parsed, render_config, config, key)
        try:
            # Its pod runs as the namespace's trainer ServiceAccount (without its token).
            trainer_access.ensure(namespace, render_config.trainer_cluster_role)
            kube.create_or_get_owned(namespace, pf_job)
        except kube.Refused as e:  # the API server refuses the Job: no answer will come
            step = preflight.Step(preflight.Answer(preflight.UNKNOWN, why=str(e)))
        except kube.Waiting as e:
            obs = Observation(Phase.pending, e.reason, str(e))
            _write_status(job, _observed(job, obs), result)
            raise
        else:
            now = _now()
            fields = preflight.status_fields(None, key, name, now, accelerator)
            obs = Observation(Phase.pending, preflight.CONDITION, fields["message"])
            actions = _observed(job, obs)
            _write_status(job, _with_preflight(job, actions, fields), result)
            return False
    answer = step.answer
    assert answer is not None
    if previous.get("key") != key or previous.get("result") != answer.result:
        metrics.PREFLIGHT.labels(answer.result, str(answer.cached).lower()).inc()
    same = previous.get("key") == key
    start = previous.get("startTime") if same else None
    # The Job that answered: this job's, or the one of another job it waited on.
    answered_by = previous.get("job") if same and previous.get("job") else name
    fields = preflight.status_fields(answer, key, answered_by, start, accelerator)
    if (entry := preflight.cache_entry(answer, _now())) is not None:
        try:
            _cache_write(namespace, cache_path, key, entry)
        except (kube.Retry, kube.Refused) as e:  # the answer stands; only the cache misses it
            log.info("preflight cache of %s not written: %s", namespace, e)
    if answer.result == preflight.DOES_NOT_FIT:
        actions = _fail(job, preflight.DOES_NOT_FIT, fields["message"])
        _write_status(job, _with_preflight(job, actions, fields), result)
        return False
    if answer.result == preflight.UNKNOWN:
        if memory:  # the fast estimate refuses it, and the compiler did not answer
            message = "; ".join(str(e) for e in memory) + f" ({fields['message']})"
            actions = _fail(job, "InvalidSpec", message)
            _write_status(job, _with_preflight(job, actions, fields), result)
            return False
        if previous.get("result") != answer.result:  # once, not on a later JobSet create
            result.events.append(Event("Warning", preflight.NO_ANSWER, fields["message"]))
            log.warning("job %s/%s: %s", namespace, meta["name"], fields["message"])
    elif previous.get("result") != answer.result:
        result.events.append(Event("Normal", preflight.FITS, fields["message"]))
    status = job.get("status") or {}
    if status.get("preflight") != fields:
        conditions = preflight.with_condition(
            status.get("conditions") or [], fields, _now(), meta.get("generation")
        )
        written = Actions(status={"preflight": fields, "conditions": conditions})
        _write_status(job, written, result)
        if result.job is not None:  # what follows builds on the status as written
            job["status"] = result.job["status"]
    return True


class InFlight:
    """The preflight Jobs this operator made in the last CLAIM_SECONDS, by (namespace,
    program key): jobs of one program created in a burst, reconciled at once before the
    watches show the first one's Job, wait for it instead of compiling it again."""

    CLAIM_SECONDS = 30.0
    claims: dict[tuple[str, str], tuple[str, float]] = {}
    lock = threading.Lock()

    @classmethod
    def other(cls, namespace: str, label: str, mine: str) -> str | None:
        """Another job's preflight Job of this program made just now, if any."""
        with cls.lock:
            name, at = cls.claims.get((namespace, label), ("", 0.0))
        fresh = time.monotonic() - at < cls.CLAIM_SECONDS
        return name if fresh and name != mine else None

    @classmethod
    def claim(cls, namespace: str, label: str, mine: str) -> str | None:
        """Claim the compile of this program for `mine`; the other Job's name when
        another job's claim is fresh (then `mine` is not made)."""
        with cls.lock:
            name, at = cls.claims.get((namespace, label), ("", 0.0))
            if name and name != mine and time.monotonic() - at < cls.CLAIM_SECONDS:
                return name
            if len(cls.claims) > 4096:  # old claims go
                cls.claims.clear()
            cls.claims[(namespace, label)] = (mine, time.monotonic())
            return None


def _with_preflight(job: dict[str, Any], actions: Actions, fields: dict[str, Any]) -> Actions:
    """`actions`' status write with status.preflight and its condition added."""
    patch = dict(actions.status or {})
    if not patch:  # the job finished meanwhile
        return actions
    patch["preflight"] = fields
    generation = job["metadata"].get("generation")
    patch["conditions"] = preflight.with_condition(
        patch.get("conditions") or [], fields, _now(), generation
    )
    return Actions(status=patch, events=actions.events)


def _cache_write(namespace: str, path: str, key: str, entry: str) -> None:
    """Add an answer to the namespace's preflight cache (a ConfigMap, made on first use)."""
    existing = kube.read(path)
    if existing is None:
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": CACHE_CONFIGMAP,
                "labels": {"app.kubernetes.io/managed-by": "posttrain-operator"},
            },
            "data": {key: entry},
        }
        stored, created = kube.create_or_get(namespace, body)
        if created:
            return
        existing = stored
    kube.patch(path, preflight.cache_patch(existing.get("data"), key, entry))


def apply(
    job: dict[str, Any],
    observed: Observed,
    result: Result,
    creates_waiting: Callable[[], bool],
) -> None:
    """Carry out what `decide` asks for (in a worker thread). Raises kube.Retry for what
    a retry may fix. Once it made the JobSet, the status is left for the next reconcile
    (`result.deferred`) while `creates_waiting()`: in a burst of new jobs, the JobSet
    creates go first and the API server spends nothing on statuses until they are done."""
    actions = decide(job, observed, _now())
    if actions.create:
        result.events.extend(actions.events)
        jobset = _children(job, result, observed)
        if jobset is None:
            return
        if creates_waiting():
            result.deferred = True
            return
        observed = Observed(jobset, observed.pods, observed.workload, observed.blocked)
        actions = decide(job, observed, _now())
    meta = job["metadata"]
    workload = observed.workload
    if actions.workload_active is not None and workload is not None and workload.name:
        path = kube.workload_path(meta["namespace"], workload.name)
        kube.patch(path, {"spec": {"active": actions.workload_active}})
    if actions.jobset_patch:
        path = kube.jobset_path(meta["namespace"], meta["name"])
        if (stored := kube.patch(path, actions.jobset_patch)) is not None:
            result.jobset = jobset_summary(stored)
        result.events.extend(actions.jobset_events)
    if actions.restart is not None and observed.jobset is not None:
        ended = kube.end_attempt(meta["namespace"], observed.jobset)
        log.warning("job %s/%s: %s (Jobs %s)", meta["namespace"], meta["name"],
                    actions.restart.message, ", ".join(ended) or "none left")  # fmt: skip
        Written.ended[(meta["namespace"], meta["name"])] = Written.attempt(observed.jobset)
        metrics.PROGRESS_DEADLINE.labels("restart").inc()
        result.events.append(actions.restart)
    _write_status(job, actions, result)
    written = actions.status or {}
    if written.get("phase") == Phase.failed and status_reason(written) == deadline.REASON:
        metrics.PROGRESS_DEADLINE.labels("fail").inc()
    result.check_in = actions.check_in


_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="reconcile")


def _record(key: Key, result: Result) -> None:
    if result.job is not None:
        Written.jobs[key] = result.job
    if result.jobset is not None:
        Written.jobsets[key] = result.jobset


def _run(
    key: Key, indexes: dict[str, Any], result: Result, creates_waiting: Callable[[], bool]
) -> dict[str, Any] | None:
    """Gather and apply (in a worker thread); the job as gathered, None when it is gone."""
    gathered = gather(key, indexes)
    if gathered is None:
        return None
    job, observed = gathered
    result.waiting = waits_in_queue(observed.workload)
    apply(job, observed, result, creates_waiting)
    return job


async def reconcile(key: Key, indexes: dict[str, Any], queue: WorkQueue) -> None:
    """One reconcile of the job at `key` (a WorkQueue's work): transient errors re-queue
    it with backoff; what was done before one is kept, and its Events are posted. A job
    waiting in a Kueue queue is looked at again every watches.POSITIONS.ttl seconds: its
    position there comes with no event."""
    result = Result()
    job = None
    start = time.monotonic()
    try:
        job = await asyncio.get_running_loop().run_in_executor(
            _pool, _run, key, indexes, result, queue.urgent_waiting
        )
        if job is None:
            queue.drop(key)
            return
    except kube.Leftover as e:
        queue.retry(key, e.delay, backoff=False)
    except kube.Retry as e:
        metrics.ERRORS.labels(result.kind).inc()
        log.info("job %s/%s: retrying: %s", *key, e)
        queue.retry(key, e.delay)
    except Exception:
        metrics.ERRORS.labels(result.kind).inc()
        raise
    else:
        queue.forget(key)
        if result.deferred:  # its status next, after the JobSets that wait (not urgent)
            queue.add(key)
        if result.waiting:
            queue.later(key, watches.POSITIONS.ttl)
        if result.check_in is not None:  # nothing else may come: look again then
            queue.later(key, result.check_in + 1)
    finally:
        metrics.RECONCILES.labels(result.kind).inc()
        metrics.LATENCY.labels(result.kind).observe(time.monotonic() - start)
        _record(key, result)
        for event in result.events if job is not None else ():
            kopf.event(job, type=event.type, reason=event.reason, message=event.message)
