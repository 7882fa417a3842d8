"""Decide a PostTrainJob's status from its JobSet: pure functions, table-tested.

`observe(jobset, spec, previous, now)` returns the status fields the operator owns
(phase, message, conditions, restarts, times). It never touches `progress`, which the
trainer writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.api.spec import USER_ERROR_EXIT_CODE, Phase
from posttrain.render.jobset import KUEUE_QUEUE_LABEL

TERMINAL = {Phase.succeeded, Phase.failed}
CONDITION_TYPES = ["Queued", "Running", "Suspended", "Succeeded", "Failed"]


@dataclass(frozen=True)
class Observation:
    phase: Phase
    reason: str
    message: str
    restarts: int = 0


def _condition(jobset: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in jobset.get("status", {}).get("conditions") or []:
        if c.get("type") == ctype and c.get("status") == "True":
            return c
    return None


def _expected_jobs(jobset: dict[str, Any]) -> int:
    return sum(int(r.get("replicas", 1)) for r in jobset.get("spec", {}).get("replicatedJobs", []))


def phase_from(jobset: dict[str, Any] | None, user_suspended: bool) -> Observation:
    """The phase a JobSet's state means for its PostTrainJob."""
    if jobset is None:
        return Observation(Phase.pending, "Creating", "creating the JobSet")
    status = jobset.get("status") or {}
    restarts = int(status.get("restarts") or 0)
    if c := _condition(jobset, "Completed"):
        return Observation(
            Phase.succeeded, "Completed", c.get("message") or "training finished", restarts
        )
    if c := _condition(jobset, "Failed"):
        if c.get("reason") == "FailJobSetFailurePolicyAction":
            # Only the UserError rule fails the JobSet at once (see render.jobset).
            return Observation(
                Phase.failed,
                "InvalidInput",
                f"the trainer exited with code {USER_ERROR_EXIT_CODE}: an error in the job's "
                "own input (data, model or config) that a restart cannot fix; its log names "
                f"the field or file ({c.get('message', '')})",
                restarts,
            )
        return Observation(
            Phase.failed,
            c.get("reason") or "JobSetFailed",
            c.get("message") or "JobSet failed",
            restarts,
        )
    if jobset.get("spec", {}).get("suspend"):
        if user_suspended:
            return Observation(
                Phase.suspended, "Suspended", "suspended by spec.scheduling.suspend", restarts
            )
        queue = jobset.get("metadata", {}).get("labels", {}).get(KUEUE_QUEUE_LABEL)
        if queue:
            return Observation(
                Phase.queued, "WaitingForAdmission", f"waiting for Kueue queue {queue!r}", restarts
            )
        return Observation(Phase.suspended, "Suspended", "the JobSet is suspended", restarts)
    jobs = status.get("replicatedJobsStatus") or []
    ready = sum(int(r.get("ready") or 0) + int(r.get("succeeded") or 0) for r in jobs)
    active = sum(int(r.get("active") or 0) for r in jobs)
    expected = _expected_jobs(jobset)
    if restarts and ready < expected:
        return Observation(
            Phase.restarting,
            "Restarting",
            f"restart {restarts}: waiting for {expected - ready} of {expected} jobs",
            restarts,
        )
    if active or ready:
        return Observation(Phase.running, "Running", f"{ready} of {expected} jobs ready", restarts)
    return Observation(Phase.pending, "WaitingForPods", "waiting for pods to start", restarts)


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
    out = []
    for ctype in CONDITION_TYPES:
        status = "True" if ctype in true_types else "False"
        old = before.get(ctype, {})
        cond = {
            "type": ctype,
            "status": status,
            "reason": obs.reason if status == "True" else f"Not{ctype}",
            "message": obs.message if status == "True" else f"phase is {obs.phase}",
            "lastTransitionTime": old.get("lastTransitionTime", now)
            if old.get("status") == status
            else now,
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    return out


def outputs_for(output_uri: str) -> dict[str, str]:
    base = output_uri.rstrip("/")
    return {
        "checkpoints": f"{base}/checkpoints",
        "tensorboard": f"{base}/tensorboard",
        "hfExport": f"{base}/hf",
    }


def status_patch(
    jobset: dict[str, Any] | None,
    spec: dict[str, Any],
    previous: dict[str, Any] | None,
    now: str,
    generation: int | None,
) -> dict[str, Any]:
    """The status fields the operator owns, given the JobSet (None before it exists)."""
    previous = previous or {}
    user_suspended = bool(spec.get("scheduling", {}).get("suspend"))
    old_phase = previous.get("phase")
    if old_phase in TERMINAL and (
        jobset is None or phase_from(jobset, user_suspended).phase not in TERMINAL
    ):
        # A finished job stays finished, even once ttlSecondsAfterFinished removed its JobSet.
        return {}
    obs = phase_from(jobset, user_suspended)
    if obs.phase == Phase.pending and jobset is not None and previous.get("startTime"):
        # Between pods finishing and their Jobs being marked complete nothing is active;
        # a job that has run does not go back to Pending.
        obs = Observation(Phase.running, "Running", "pods finishing", obs.restarts)
    patch: dict[str, Any] = {
        "phase": str(obs.phase),
        "message": obs.message,
        "conditions": conditions_for(obs, previous.get("conditions", []), now, generation),
        "restarts": obs.restarts,
        "outputs": outputs_for(spec.get("output", {}).get("uri", "")),
    }
    if generation is not None:
        patch["observedGeneration"] = generation
    if jobset is not None:
        patch["jobSetName"] = jobset["metadata"]["name"]
    if obs.phase in (Phase.running, Phase.restarting, Phase.succeeded, Phase.failed):
        patch["startTime"] = previous.get("startTime") or now
    if obs.phase in TERMINAL:
        patch["completionTime"] = previous.get("completionTime") or now
    return patch


def changed(previous: dict[str, Any] | None, patch: dict[str, Any]) -> bool:
    """Whether applying patch would change anything but timestamps-only noise."""
    previous = previous or {}
    return any(previous.get(k) != v for k, v in patch.items())
