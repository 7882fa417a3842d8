"""The preflight's decisions, as pure functions (table-tested): what a TPU job's preflight
pod answered (`pod_state`, `answer_from`), what to do next (`next_step`), the status it
writes (`status_fields`, `with_condition`) and the cache of answers by program key
(`cache_entry`, `cache_patch`). `reconcile` gathers the inputs and carries it out.

Answers:
- Fits: the TPU compiler's total per device is within HBM; the JobSet is made, the
  figures in status.preflight, condition Preflight True.
- DoesNotFit: over HBM; the job fails with the compiler's figures (status.message, a
  Warning Event DoesNotFit) before its JobSet or Kueue Workload exists.
- Unknown: no answer (the image could not be pulled, the pod crashed or could not
  compile the job's input, no answer within the timeout): the job goes on as it would
  without a preflight, the fast estimate deciding, with condition Preflight Unknown and
  a Warning Event PreflightNoAnswer saying why.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.controller.phase import one_line
from posttrain.render.preflight import KEY_LABEL_LENGTH

CONDITION = "Preflight"
FITS, DOES_NOT_FIT, UNKNOWN, COMPILING = "Fits", "DoesNotFit", "Unknown", "Compiling"
NO_ANSWER = "PreflightNoAnswer"
CACHE_CONFIGMAP = "posttrain-preflight"
# How the fast estimate's refusal begins (posttrain.capacity.refusal): with a preflight,
# the compiler's answer decides instead.
MEMORY_REFUSAL = "the job does not fit"
CACHE_ENTRIES = 256  # the most answers one namespace's cache keeps (the oldest go)
# A container waiting for one of these never runs: no answer will come.
STUCK = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
         "CreateContainerConfigError", "CreateContainerError"}  # fmt: skip
FIGURES = ("peakGiB", "hbmGiB", "argumentsGiB", "temporariesGiB", "outputsGiB", "flops",
           "compiler", "samplerPeakGiB")  # fmt: skip


@dataclass(frozen=True)
class PreflightPod:
    """What the preflight needs of one of its pods."""

    name: str
    key: str  # the program key's label
    phase: str | None
    exit_code: int | None = None
    message: str | None = None  # the terminated container's message (its --result)
    reason: str | None = None  # the terminated container's reason, or the pod's
    waiting: str | None = None  # the waiting container's reason
    waiting_message: str | None = None


def pod_state(pod: dict[str, Any], key_label: str) -> PreflightPod:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    state = PreflightPod(
        name=meta.get("name", ""),
        key=(meta.get("labels") or {}).get(key_label, ""),
        phase=status.get("phase"),
        reason=status.get("reason"),
    )
    for c in status.get("containerStatuses") or []:
        st = c.get("state") or {}
        if term := st.get("terminated"):
            code = term.get("exitCode")
            return PreflightPod(state.name, state.key, state.phase,
                                code if isinstance(code, int) else None,
                                term.get("message"), term.get("reason") or state.reason)  # fmt: skip
        if wait := st.get("waiting"):
            return PreflightPod(state.name, state.key, state.phase, reason=state.reason,
                                waiting=wait.get("reason"),
                                waiting_message=wait.get("message"))  # fmt: skip
    return state


@dataclass(frozen=True)
class Answer:
    result: str  # FITS, DOES_NOT_FIT or UNKNOWN
    figures: dict[str, Any] = field(default_factory=dict)
    why: str = ""  # for UNKNOWN: why there is no answer; else the compiler's error, if any
    cached: bool = False


def _result_json(message: str | None) -> dict[str, Any] | None:
    """The --result object at the start of a termination message, if it is one."""
    if not message:
        return None
    try:
        doc = json.loads(message.strip())
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "fits" in doc else None


def answer_from(pod: PreflightPod) -> Answer | None:
    """The pod's answer; None while it has none yet (being made, pulling, compiling)."""
    if pod.waiting in STUCK:
        detail = f": {pod.waiting_message}" if pod.waiting_message else ""
        return Answer(UNKNOWN, why=f"preflight pod {pod.name}: {pod.waiting}{detail}")
    if pod.phase not in ("Succeeded", "Failed") and pod.exit_code is None:
        return None
    doc = _result_json(pod.message)
    if doc is not None and isinstance(doc.get("fits"), bool):
        figures = {k: doc[k] for k in FIGURES if k in doc}
        error = doc.get("error") if isinstance(doc.get("error"), str) else ""
        return Answer(FITS if doc["fits"] else DOES_NOT_FIT, figures, error)
    if doc is not None and isinstance(doc.get("error"), str):
        return Answer(UNKNOWN, why=f"the compile could not run: {doc['error']}")
    how = f"exit code {pod.exit_code}" if pod.exit_code is not None else (pod.reason or "")
    last = f": {one_line(pod.message, 300)}" if pod.message else ""
    return Answer(UNKNOWN, why=f"preflight pod {pod.name} ended ({how}) without an answer{last}")


def _seconds_since(start: str | None, now: str) -> float | None:
    try:
        begin = datetime.datetime.fromisoformat(str(start).replace("Z", "+00:00"))
        end = datetime.datetime.fromisoformat(now.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (end - begin).total_seconds()


@dataclass(frozen=True)
class PreflightJob:
    """What the preflight needs of a preflight Job (of any job of the namespace)."""

    name: str
    job: str  # the PostTrainJob it was made for
    finished: bool


def job_state(body: dict[str, Any], job_label: str) -> PreflightJob:
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    done = any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return PreflightJob(
        meta.get("name", ""),
        (meta.get("labels") or {}).get(job_label, ""),
        done or bool(status.get("succeeded") or status.get("failed")),
    )


@dataclass(frozen=True)
class Step:
    """What to do next: answer (go on or fail), make the Job (create), wait for the
    compile of the same program by another job's Job (`shared`, its name), or wait."""

    answer: Answer | None = None
    create: bool = False
    shared: str | None = None
    check_in: float | None = None  # look again in this many seconds


# How often a job waiting on another job's compile of its program looks again (that
# pod's events wake only its own job).
SHARED_POLL_SECONDS = 10.0


def next_step(
    key: str,
    previous: dict[str, Any],
    pods: Sequence[PreflightPod],
    cached: dict[str, Any] | None,
    now: str,
    timeout: float,
    own_job: str = "",
    others: Sequence[PreflightPod] = (),
    running_elsewhere: str | None = None,
) -> Step:
    """The preflight's next step for program `key`, given the job's status.preflight
    (`previous`), its preflight pods (those of another key are ignored), the cache's
    entry for the key (None when it has none), the pods of other jobs' preflights of the
    same program (`others`: their answer is this job's, marked cached) and the name of
    another job's preflight Job of the same program that has not finished
    (`running_elsewhere`; `own_job` is this job's preflight Job's name)."""
    if previous.get("key") == key and previous.get("result") in (FITS, DOES_NOT_FIT, UNKNOWN):
        kept = {k: previous[k] for k in FIGURES if k in previous}
        return Step(Answer(previous["result"], kept, previous.get("message") or ""))
    label = key[:KEY_LABEL_LENGTH]
    own = [a for p in pods if p.key == label and (a := answer_from(p))]
    shared = [
        Answer(a.result, a.figures, a.why, cached=True)
        for p in others
        if p.key == label and (a := answer_from(p))
    ]
    for answers in ([a for a in own if a.result != UNKNOWN],
                    [a for a in shared if a.result != UNKNOWN], own, shared):  # fmt: skip
        if answers:
            return Step(answers[0])
    if cached is not None and cached.get("result") in (FITS, DOES_NOT_FIT):
        figures = {k: cached[k] for k in FIGURES if k in cached}
        return Step(Answer(cached["result"], figures, cached.get("error") or "", cached=True))
    started = previous.get("startTime") if previous.get("key") == key else None
    waits_on = previous.get("job") if started else None
    if started is None or (waits_on != own_job and waits_on != running_elsewhere):
        # Not started, or the other job's compile it waited on is gone unanswered.
        if running_elsewhere:
            return Step(shared=running_elsewhere, check_in=min(SHARED_POLL_SECONDS, timeout))
        return Step(create=True, check_in=timeout)
    elapsed = _seconds_since(started, now)
    if elapsed is not None and elapsed >= timeout:
        why = f"no answer from the preflight Job {previous.get('job')} within {timeout:.0f} s"
        return Step(Answer(UNKNOWN, why=why))
    left = timeout - (elapsed or 0)
    return Step(check_in=min(left, SHARED_POLL_SECONDS) if waits_on != own_job else left)


def _gib(value: Any) -> str:
    return f"{value:.2f} GiB" if isinstance(value, int | float) else "?"


def describe(answer: Answer, accelerator: str) -> str:
    """The answer in one line: the compiler's figures per device against HBM."""
    f = answer.figures
    by = f" ({f['compiler']})" if f.get("compiler") else ""
    parts = [(n, f[k]) for n, k in (("arguments", "argumentsGiB"),
             ("temporaries", "temporariesGiB"), ("outputs", "outputsGiB")) if k in f]  # fmt: skip
    terms = ", ".join(f"{n} {_gib(v)}" for n, v in parts)
    cached = " (cached: the same program was compiled before)" if answer.cached else ""
    sampler = f.get("samplerPeakGiB")  # GRPO's sampler, with what stays beside it
    if answer.result == FITS:
        also = f" and GRPO's sampler in {_gib(sampler)}" if sampler is not None else ""
        return (f"the TPU compiler{by} fits the train step in {_gib(f.get('peakGiB'))} per "
                f"device ({terms}){also} of {_gib(f.get('hbmGiB'))} HBM on {accelerator}{cached}")  # fmt: skip
    if answer.result == DOES_NOT_FIT:
        step_fits = (f.get("peakGiB") or 0) <= (f.get("hbmGiB") or 0)
        if sampler is not None and step_fits:
            need = (f"{_gib(sampler)} per device for GRPO's sampler (the train step: "
                    f"{_gib(f.get('peakGiB'))})")  # fmt: skip
        elif parts:
            need = f"{_gib(f.get('peakGiB'))} per device ({terms})"
        else:
            need = f"{_gib(f.get('peakGiB'))} per device for its temporaries alone"
        return (f"the job does not fit: the TPU compiler{by} needs {need}, over the "
                f"{_gib(f.get('hbmGiB'))} of HBM of each chip of {accelerator}{cached}; "
                "posttrain estimate --compile shows the figures with one change")  # fmt: skip
    return f"no answer from the TPU compiler: {answer.why}"


def status_fields(
    answer: Answer | None, key: str, job: str, start: str | None, accelerator: str
) -> dict[str, Any]:
    """status.preflight: Compiling (answer None) or the answer with its figures."""
    out: dict[str, Any] = {"key": key, "job": job, "result": COMPILING}
    if start:
        out["startTime"] = start
    if answer is None:
        out["message"] = f"compiling the train step for {accelerator} (Job {job})"
        return out
    out["result"] = answer.result
    out.update({k: v for k, v in answer.figures.items() if k in FIGURES})
    out["message"] = one_line(describe(answer, accelerator), 1000)
    if answer.cached:
        out["cached"] = True
    return out


def with_condition(
    conditions: list[dict[str, Any]],
    preflight: dict[str, Any],
    now: str,
    generation: int | None,
) -> list[dict[str, Any]]:
    """`conditions` with the Preflight condition set from status.preflight: True (Fits),
    False (DoesNotFit), Unknown (Compiling, or no answer); lastTransitionTime moves only
    when its status does."""
    result = preflight.get("result")
    status = {FITS: "True", DOES_NOT_FIT: "False"}.get(result, "Unknown")
    reason = {UNKNOWN: NO_ANSWER}.get(result, result)
    old = next((c for c in conditions if c.get("type") == CONDITION), {})
    cond = {
        "type": CONDITION,
        "status": status,
        "reason": reason,
        "message": preflight.get("message", ""),
        "lastTransitionTime": old.get("lastTransitionTime", now)
        if old.get("status") == status
        else now,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return [c for c in conditions if c.get("type") != CONDITION] + [cond]


def cache_entry(answer: Answer, now: str) -> str | None:
    """The cache's value for an answer from a compile (none for Unknown or a cached one)."""
    if answer.result not in (FITS, DOES_NOT_FIT) or answer.cached:
        return None
    doc = {"result": answer.result, **answer.figures, "at": now}
    if answer.why:
        doc["error"] = answer.why[:400]
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def cached_answer(data: dict[str, str] | None, key: str) -> dict[str, Any] | None:
    """The cache's entry for `key`; None when there is none or it is not one."""
    try:
        doc = json.loads((data or {})[key])
    except (KeyError, TypeError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def cache_patch(data: dict[str, str] | None, key: str, entry: str) -> dict[str, Any]:
    """The ConfigMap merge patch that adds `entry` under `key` and drops the oldest
    entries past CACHE_ENTRIES (null deletes a key in a merge patch)."""
    data = dict(data or {})
    data[key] = entry

    def at(item: tuple[str, str]) -> str:
        doc = cached_answer({item[0]: item[1]}, item[0]) or {}
        return str(doc.get("at") or "")

    stale = sorted(data.items(), key=at)[: max(0, len(data) - CACHE_ENTRIES)]
    patch: dict[str, Any] = {key: entry}
    patch.update({k: None for k, _ in stale if k != key})
    return {"data": patch}
