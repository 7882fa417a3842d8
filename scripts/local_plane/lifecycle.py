"""The plane as a whole: up, down, status, and pytest sessions sharing one plane."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from local_plane.build import ensure_built
from local_plane.components import (
    _kueue_conversion,
    _kueue_visibility,
    _start_apiserver,
    _start_controller_manager,
    _start_etcd,
    _start_jobset,
    _start_kueue,
    _start_kwok,
    _start_scheduler,
)
from local_plane.nodes import create_nodes, default_nodes
from local_plane.pki import _create_pki, _write_kubeconfig
from local_plane.processes import State, _http_ok, _locked, _pid, _stop
from local_plane.settings import (
    BASIC,
    FULL,
    KUBECONFIG,
    LOG_DIR,
    RUN_DIR,
    SESSIONS_DIR,
    STATE_FILE,
    log,
)
from local_plane.webhooks import delete_webhooks, install_crds

_STARTERS: dict[str, Callable[[State], None]] = {
    "etcd": _start_etcd,
    "kube-apiserver": _start_apiserver,
    "kube-controller-manager": _start_controller_manager,
    "kube-scheduler": _start_scheduler,
    "kwok": _start_kwok,
    "jobset": _start_jobset,
    "kueue": _start_kueue,
}

WEBHOOK_PREFIXES = {"jobset": "jobset-", "kueue": "kueue-"}


# --------------------------------------------------------------------------------------
# up / down / status
# --------------------------------------------------------------------------------------


def running() -> dict[str, int]:
    """Components of FULL that run now -> pid."""
    return {name: pid for name in FULL if (pid := _pid(name)) is not None}


def apiserver_ready() -> bool:
    state = State.load()
    port = state.ports.get("kube-apiserver")
    return (
        bool(port)
        and KUBECONFIG.is_file()
        and _http_ok(f"https://127.0.0.1:{port}/readyz", client_cert=True, verify=True, body="ok")
    )


def is_up(full: bool = False) -> bool:
    names = FULL if full else BASIC
    now = running()
    return all(n in now for n in names) and apiserver_ready()


def up(
    full: bool = False, *, owner: str = "cli", nodes: bool = True, crds: bool = True
) -> list[str]:
    """Start what is not running yet (basic tier, or all with full=True).

    Idempotent: a healthy running plane is reused; `full=True` on top of a basic plane
    adds the rest. Returns the components this call started (stop them with
    `down(components)`). `owner` ("cli" or "pytest") decides who may tear it down.
    """
    ensure_built(full)
    wanted = FULL if full else BASIC
    started: list[str] = []
    with _locked():
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        now = running()
        if ("etcd" in now) != ("kube-apiserver" in now) or (now and not apiserver_ready()):
            log("found a partial or unhealthy control plane; restarting it")
            _down_locked(list(now))
            now = {}
        state = State.load() if now else State()
        try:
            if not now:
                _create_pki()
                _write_kubeconfig(state.port("kube-apiserver"))
            elif crds:
                install_crds(state=state)  # no-op unless crds/ (or a pin) changed
            for name in wanted:
                if name in now:
                    if owner == "cli":
                        state.owners[name] = "cli"  # the user wants it kept
                    continue
                t0 = time.monotonic()
                _STARTERS[name](state)
                state.owners[name] = owner
                state.save()
                started.append(name)
                log(f"{name} ready in {time.monotonic() - t0:.1f}s")
                if name == "kube-apiserver" and crds:
                    t0 = time.monotonic()
                    install_crds(state=state)
                    log(f"CRDs installed in {time.monotonic() - t0:.1f}s")
            state.save()
            if full and nodes:
                create_nodes(default_nodes())  # idempotent (server-side apply)
        except BaseException:
            # Also stop the component that failed to come up (it may still run).
            failed = [n for n in wanted if n not in now and n not in started][:1]
            log(f"startup failed; stopping {', '.join(started + failed)}")
            _down_locked(started + failed)
            raise
    return started


def _down_locked(components: Sequence[str] | None = None) -> list[str]:
    targets = list(FULL if components is None else components)
    state = State.load()
    everything = components is None or {"etcd", "kube-apiserver"} <= set(targets)
    stopped = []
    # Webhooks of controllers that stop while the API server stays would block requests.
    if not everything and apiserver_ready():
        for name, prefix in WEBHOOK_PREFIXES.items():
            if name in targets and _pid(name) is not None:
                delete_webhooks(prefix)
        if "kueue" in targets and _pid("kueue") is not None:
            _kueue_conversion(None)
            _kueue_visibility(None)
    for name in reversed(FULL):
        if name in targets and _stop(name):
            stopped.append(name)
        if name in targets:
            state.owners.pop(name, None)
    if everything or not running():
        for p in (STATE_FILE, KUBECONFIG):
            p.unlink(missing_ok=True)
    elif STATE_FILE.exists():
        state.save()
    return stopped


def down(components: Sequence[str] | None = None) -> list[str]:
    """Stop the given components (default: all) that this script started."""
    with _locked():
        return _down_locked(components)


def status() -> dict[str, Any]:
    state = State.load()
    now = running()
    return {
        "kubeconfig": str(KUBECONFIG) if KUBECONFIG.is_file() else None,
        "apiserver_ready": apiserver_ready() if "kube-apiserver" in now else False,
        "components": {
            name: {
                "pid": now.get(name),
                "running": name in now,
                "owner": state.owners.get(name),
                "log": str(LOG_DIR / f"{name}.log"),
            }
            for name in FULL
        },
        "ports": state.ports,
    }


# Sessions: pytest processes using a pytest-owned plane. The last one out stops it.


def enter_session() -> None:
    SESSIONS_DIR.mkdir(parents=True, exist_ok=True)
    (SESSIONS_DIR / str(os.getpid())).touch()


def leave_session() -> list[str]:
    """Drop this process's lease; if no other live session remains, stop pytest-owned parts."""
    with _locked():
        (SESSIONS_DIR / str(os.getpid())).unlink(missing_ok=True)
        others = []
        if SESSIONS_DIR.is_dir():
            for f in SESSIONS_DIR.iterdir():
                if f.name.isdigit() and Path(f"/proc/{f.name}").exists():
                    others.append(f.name)
                else:
                    f.unlink(missing_ok=True)
        if others:
            return []
        owned = [n for n, o in State.load().owners.items() if o == "pytest"]
        return _down_locked(owned) if owned else []
