"""The status the operator writes: phase, message, conditions, restarts, times and
outputs, from an observation (`status_patch`, `observation_patch`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from posttrain.api import rollout_split
from posttrain.api.locations import GS, PATH, location_error
from posttrain.api.spec import Phase
from posttrain.controller.phase.jobset import phase_from
from posttrain.controller.phase.model import (
    CONDITION_MESSAGE_MAX,
    CONDITION_TYPES,
    MESSAGE_MAX,
    TERMINAL,
    Cause,
    Observation,
    PodState,
    WorkloadState,
)


def conditions_for(
    obs: Observation, previous: list[dict[str, Any]], now: str, generation: int | None
) -> list[dict[str, Any]]:
    """One condition per type; lastTransitionTime moves only when status flips."""
    before = {c.get("type"): c for c in previous or []}
    true_types = {
        Phase.queued: {"Queued"},
        Phase.running: {"Running"},
        Phase.restarting: {"Running"},
        Phase.suspended: {"Suspended"},
        Phase.succeeded: {"Succeeded"},
        Phase.failed: {"Failed"},
        Phase.pending: set(),
    }[obs.phase]
    # A Pending job has no True condition; Running=False says why it does not run.
    explained = true_types or {"Running"}
    out = []
    for ctype in CONDITION_TYPES:
        status = "True" if ctype in true_types else "False"
        old = before.get(ctype, {})
        cond = {
            "type": ctype,
            "status": status,
            "reason": obs.reason if ctype in explained else f"Not{ctype}",
            "message": obs.message if ctype in explained else f"phase is {obs.phase}",
            "lastTransitionTime": old.get("lastTransitionTime", now)
            if old.get("status") == status
            else now,
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    # Conditions of other types (the preflight's) are kept as they are.
    return out + [c for c in previous or [] if c.get("type") not in CONDITION_TYPES]


def outputs_for(output_uri: Any) -> dict[str, str]:
    """Where the job's outputs go; nothing for a URI validate refuses (it may carry a
    credential, `gs://TOKEN@bucket`, which never reaches the status)."""
    if not isinstance(output_uri, str) or not output_uri:
        return {}
    if location_error(output_uri, (PATH, GS)) is not None:
        return {}
    base = output_uri.rstrip("/")
    return {
        "checkpoints": f"{base}/checkpoints",
        "tensorboard": f"{base}/tensorboard",
        "hfExport": f"{base}/hf",
    }


def one_line(text: str, limit: int = MESSAGE_MAX) -> str:
    """`text` as one line of at most `limit` characters: control characters (newlines,
    ESC, ...) escaped, so that text from elsewhere cannot forge lines or terminal codes."""
    out = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )
    return out if len(out) <= limit else out[: limit - 1] + "…"


def _patch(
    obs: Observation,
    jobset: dict[str, Any] | None,
    spec: dict[str, Any],
    previous: dict[str, Any],
    now: str,
    generation: int | None,
) -> dict[str, Any]:
    message = obs.message
    split = ((jobset or {}).get("metadata", {}).get("annotations") or {}).get(
        rollout_split.ANNOTATION
    )
    if split and obs.phase in (Phase.running, Phase.restarting):
        message = f"{message}; {split}"
    obs = Observation(obs.phase, obs.reason, one_line(message, CONDITION_MESSAGE_MAX), obs.restarts)
    patch: dict[str, Any] = {
        "phase": str(obs.phase),
        "message": one_line(message),
        "conditions": conditions_for(obs, previous.get("conditions", []), now, generation),
        "restarts": obs.restarts,
    }
    output = spec.get("output")
    if outputs := outputs_for(output.get("uri") if isinstance(output, dict) else None):
        patch["outputs"] = outputs
    if generation is not None:
        patch["observedGeneration"] = generation
    if jobset is not None:
        patch["jobSetName"] = jobset["metadata"]["name"]
    if obs.phase in (Phase.running, Phase.restarting, Phase.succeeded, Phase.failed):
        patch["startTime"] = previous.get("startTime") or now
    if obs.phase in TERMINAL:
        patch["completionTime"] = previous.get("completionTime") or now
    return patch


def status_patch(
    jobset: dict[str, Any] | None,
    spec: dict[str, Any],
    previous: dict[str, Any] | None,
    now: str,
    generation: int | None,
    pods: Iterable[PodState] = (),
    workload: WorkloadState | None = None,
    blocked: Cause | None = None,
) -> dict[str, Any]:
    """The status fields the operator owns, given the JobSet (None before it exists), the
    summaries of its pods and of its Kueue Workload (None without Kueue), and why no pod
    can be made (`missing_priority_class`)."""
    previous = previous or {}
    pods = list(pods)
    user_suspended = bool(spec.get("scheduling", {}).get("suspend"))
    obs = phase_from(jobset, user_suspended, pods, workload, blocked)
    if previous.get("phase") in TERMINAL and obs.phase not in TERMINAL:
        # A finished job stays finished, even once ttlSecondsAfterFinished removed its JobSet.
        return {}
    if (
        previous.get("phase") == Phase.running
        and obs.phase == Phase.pending
        and obs.reason in ("WaitingForPods", "PodsStarting")
        and all(p.running or p.done for p in pods)
    ):
        # Between pods finishing and their Jobs being marked complete nothing is active
        # (and a pod's events may trail the JobSet's): a running job does not go back to
        # Pending for that.
        obs = Observation(Phase.running, "Running", "pods finishing", obs.restarts)
    return _patch(obs, jobset, spec, previous, now, generation)


def status_reason(status: dict[str, Any]) -> str | None:
    """The reason of a status's phase: the True condition's, or for Pending the Running
    condition's (why it does not run)."""
    conditions = [c for c in status.get("conditions") or [] if c.get("type") in CONDITION_TYPES]
    for c in conditions:
        if c.get("status") == "True":
            return c.get("reason")
    return next((c.get("reason") for c in conditions if c.get("type") == "Running"), None)


def observation_patch(
    obs: Observation,
    spec: dict[str, Any],
    previous: dict[str, Any] | None,
    now: str,
    generation: int | None,
) -> dict[str, Any]:
    """Status for a job whose objects could not all be made (invalid spec, refused by the
    API server, a foreign object in the way, a leftover to wait for); empty once the job
    has finished."""
    previous = previous or {}
    if previous.get("phase") in TERMINAL:
        return {}
    return _patch(obs, None, spec, previous, now, generation)


def changed(previous: dict[str, Any] | None, patch: dict[str, Any]) -> bool:
    """Whether applying patch would change anything but timestamps-only noise."""
    previous = previous or {}
    return any(previous.get(k) != v for k, v in patch.items())
