"""The Argo CD health check for PostTrainJob, run by a real Lua interpreter.

Argo CD evaluates `resource.customizations.health.posttrain.dev_PostTrainJob` with the
live object in the global `obj` (a Lua table decoded from JSON) and reads `hs.status` and
`hs.message`. This test does the same with `lua5.4` (Debian package `lua5.4`); the script
sticks to Lua 5.1 syntax, which is what Argo CD's gopher-lua runs.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.api.spec import Phase

ROOT = Path(__file__).resolve().parents[2]
LUA_SCRIPT = ROOT / "manifests" / "argocd" / "health-posttrainjob.lua"
ARGOCD_CM = ROOT / "manifests" / "argocd" / "argocd-cm.yaml"
CM_KEY = "resource.customizations.health.posttrain.dev_PostTrainJob"
INSTALL = "apt-get install -y lua5.4"


def lua_binary() -> str:
    """The Lua interpreter; FAILS (never skips) with the install command when absent."""
    for name in ("lua5.4", "lua"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"no Lua interpreter on PATH: install it with `{INSTALL}`", pytrace=False)


def _lua_string(s: str) -> str:
    out = ['"']
    for ch in s.encode("utf-8"):
        c = chr(ch)
        if c in '"\\':
            out.append("\\" + c)
        elif 32 <= ch < 127:
            out.append(c)
        else:
            out.append(f"\\{ch:03d}")  # decimal escape: bytes, so UTF-8 passes through
    out.append('"')
    return "".join(out)


def to_lua(value: Any) -> str:
    """A Lua table literal for a JSON value, as Argo CD decodes it (null -> absent)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("JSON has no NaN/Infinity")
        return repr(value)
    if isinstance(value, str):
        return _lua_string(value)
    if isinstance(value, list):
        return "{" + ", ".join(to_lua(v) for v in value) + "}"
    if isinstance(value, dict):
        items = [
            f"[{_lua_string(str(k))}] = {to_lua(v)}" for k, v in value.items() if v is not None
        ]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"not a JSON value: {value!r}")


def run_health(obj: dict[str, Any], script: Path = LUA_SCRIPT) -> tuple[str, str]:
    """Run the health script on obj; return (hs.status, hs.message)."""
    harness = (
        f"obj = {to_lua(obj)}\n"
        f"local check = assert(loadfile({_lua_string(str(script))}))\n"
        "local hs = check()\n"
        'io.write(tostring(hs.status), "\\0", tostring(hs.message))\n'
    )
    proc = subprocess.run(
        [lua_binary(), "-"], input=harness, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, f"lua failed:\n{proc.stderr}\n--- harness ---\n{harness}"
    status, message = proc.stdout.split("\0", 1)
    return status, message


def job(status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "qwen3-lora", "namespace": "team-a", "generation": 1},
        "spec": {"technique": "sft", "training": {"steps": 1000}},
    }
    if status is not None:
        obj["status"] = status
    return obj


CASES = [
    pytest.param(job(), "Progressing", "Waiting for the operator", id="no-status"),
    pytest.param(job({}), "Progressing", "Waiting for the operator", id="empty-status"),
    pytest.param(
        job({"message": "x", "restarts": 0}),
        "Progressing",
        "Waiting for the operator",
        id="no-phase",
    ),
    pytest.param(
        job({"phase": "Pending", "message": "creating the JobSet"}),
        "Progressing",
        "creating the JobSet",
        id="pending",
    ),
    pytest.param(
        job({"phase": "Queued", "message": "waiting for Kueue queue 'team-a'"}),
        "Progressing",
        "waiting for Kueue queue 'team-a'",
        id="queued",
    ),
    pytest.param(
        job(
            {
                "phase": "Running",
                "message": "2 of 2 jobs ready",
                "progress": {"step": 120, "totalSteps": 1000, "loss": 1.25},
            }
        ),
        "Progressing",
        "2 of 2 jobs ready (step 120/1000)",
        id="running-with-progress",
    ),
    pytest.param(
        job({"phase": "Running", "progress": {"step": 5}}),
        "Progressing",
        "Running",
        id="running-no-message-partial-progress",
    ),
    pytest.param(
        job({"phase": "Restarting", "message": "restart 1: waiting for 1 of 2 jobs"}),
        "Progressing",
        "restart 1: waiting for 1 of 2 jobs",
        id="restarting",
    ),
    pytest.param(
        job({"phase": "Suspended", "message": "suspended by spec.scheduling.suspend"}),
        "Suspended",
        "suspended by spec.scheduling.suspend",
        id="suspended",
    ),
    pytest.param(
        job(
            {
                "phase": "Succeeded",
                "message": "training finished",
                "progress": {"step": 1000, "totalSteps": 1000},
            }
        ),
        "Healthy",
        "training finished (step 1000/1000)",
        id="succeeded",
    ),
    pytest.param(
        job({"phase": "Failed", "message": 'JobSet failed: "worker" exceeded maxRestarts'}),
        "Degraded",
        'JobSet failed: "worker" exceeded maxRestarts',
        id="failed-quotes",
    ),
    pytest.param(
        job({"phase": "Failed", "message": "spec.lora.rank: must be > 0\n100% wrong — ünïcode"}),
        "Degraded",
        "spec.lora.rank: must be > 0\n100% wrong — ünïcode",
        id="failed-newline-percent-unicode",
    ),
    pytest.param(
        job({"phase": "Exploded", "message": "?"}),
        "Unknown",
        "unknown phase Exploded",
        id="unknown-phase",
    ),
]


@pytest.mark.parametrize(("obj", "status", "message"), CASES)
def test_health(obj: dict[str, Any], status: str, message: str) -> None:
    assert run_health(obj) == (status, message)


EXPECTED = {
    Phase.pending: "Progressing",
    Phase.queued: "Progressing",
    Phase.running: "Progressing",
    Phase.restarting: "Progressing",
    Phase.suspended: "Suspended",
    Phase.succeeded: "Healthy",
    Phase.failed: "Degraded",
}


def test_every_phase_of_the_api_is_mapped() -> None:
    """A phase added to the API must get a health mapping here and in the Lua."""
    assert set(EXPECTED) == set(Phase)
    for phase, status in EXPECTED.items():
        assert run_health(job({"phase": str(phase), "message": "m"}))[0] == status, phase


def test_real_operator_status() -> None:
    """The status the operator writes for a queued JobSet reads as Progressing."""
    from posttrain.controller.phase import status_patch

    jobset = {
        "metadata": {"name": "qwen3-lora", "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
        "spec": {"suspend": True, "replicatedJobs": [{"name": "worker", "replicas": 1}]},
        "status": {},
    }
    status = status_patch(jobset, {"output": {"uri": "gs://b/r"}}, None, "2025-01-01T00:00:00Z", 1)
    assert status["phase"] == "Queued"
    assert run_health(job(status)) == ("Progressing", status["message"])


def test_argocd_cm_snippet_is_the_script() -> None:
    cm = yaml.safe_load(ARGOCD_CM.read_text())
    assert cm["kind"] == "ConfigMap"
    assert cm["metadata"] == {**cm["metadata"], "name": "argocd-cm", "namespace": "argocd"}
    assert cm["data"][CM_KEY] == LUA_SCRIPT.read_text(), (
        "manifests/argocd/argocd-cm.yaml is out of date with health-posttrainjob.lua"
    )


def test_snippet_runs_as_embedded(tmp_path: Path) -> None:
    """The ConfigMap's copy (what Argo CD actually runs) behaves the same."""
    script = tmp_path / "health.lua"
    script.write_text(yaml.safe_load(ARGOCD_CM.read_text())["data"][CM_KEY])
    assert run_health(job({"phase": "Failed", "message": "boom"}), script) == ("Degraded", "boom")


def test_script_avoids_lua53_only_syntax() -> None:
    """Argo CD's gopher-lua is Lua 5.1: no integer division, bitwise operators or goto."""
    code = "\n".join(line.split("--", 1)[0] for line in LUA_SCRIPT.read_text().splitlines())
    for token in ("//", "goto", "<<", ">>", "&", "|"):
        assert token not in code, token


def test_application_targets_production_overlay() -> None:
    app = yaml.safe_load((ROOT / "manifests" / "argocd" / "application.yaml").read_text())
    assert app["apiVersion"] == "argoproj.io/v1alpha1" and app["kind"] == "Application"
    source = app["spec"]["source"]
    assert source["path"] == "manifests/overlays/production"
    assert (ROOT / source["path"] / "kustomization.yaml").is_file()
    assert source["repoURL"].endswith(".git")
    assert app["spec"]["destination"]["namespace"] == "posttrain-system"
    assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]
