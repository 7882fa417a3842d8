"""The processes of the plane: state (ports), start, stop, wait; kubectl and applying objects."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local_plane.settings import (
    BIN_DIR,
    KUBECONFIG,
    LOCK_FILE,
    LOG_DIR,
    PID_DIR,
    PKI_DIR,
    RUN_DIR,
    STATE_FILE,
    ControlPlaneError,
)

# --------------------------------------------------------------------------------------
# State, processes
# --------------------------------------------------------------------------------------


@dataclass
class State:
    ports: dict[str, int] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)  # component -> "cli" | "pytest"
    crd_hash: str = ""  # what install_crds applied last

    @classmethod
    def load(cls) -> State:
        if STATE_FILE.is_file():
            data = json.loads(STATE_FILE.read_text())
            return cls(
                ports=data.get("ports", {}),
                owners=data.get("owners", {}),
                crd_hash=data.get("crd_hash", ""),
            )
        return cls()

    def save(self) -> None:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        data = {"ports": self.ports, "owners": self.owners, "crd_hash": self.crd_hash}
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(STATE_FILE)

    def port(self, name: str) -> int:
        if name not in self.ports:
            self.ports[name] = free_port()
        return self.ports[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_children: dict[int, subprocess.Popen] = {}  # reaped when stopped from this process


def _pid(name: str) -> int | None:
    """PID of a running component started by this script, else None (stale files removed)."""
    pidfile = PID_DIR / f"{name}.pid"
    if not pidfile.is_file():
        return None
    try:
        pid = int(pidfile.read_text().strip())
    except ValueError:
        pidfile.unlink(missing_ok=True)
        return None
    if _alive(pid, name):
        return pid
    pidfile.unlink(missing_ok=True)
    return None


def _alive(pid: int, name: str) -> bool:
    child = _children.get(pid)
    if child is not None:
        # Our own child: poll() reaps it once it exited. (Its /proc cmdline is briefly
        # empty right after exec, so do not judge it by that.)
        return child.poll() is None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    # Guard against PID reuse: the process must run one of our binaries.
    return bool(cmdline) and cmdline[0].decode(errors="replace").startswith(str(BIN_DIR))


def _start(name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    PID_DIR.mkdir(parents=True, exist_ok=True)
    logf = open(LOG_DIR / f"{name}.log", "wb")  # noqa: SIM115 (handed to the child)
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=logf,
        stderr=subprocess.STDOUT,
        cwd=RUN_DIR,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # survives the CLI; never gets the terminal's ^C
    )
    logf.close()
    _children[proc.pid] = proc
    (PID_DIR / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def _stop(name: str, timeout: float = 15.0) -> bool:
    pid = _pid(name)
    (PID_DIR / f"{name}.pid").unlink(missing_ok=True)
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid, name):
        time.sleep(0.1)
    if _alive(pid, name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while _alive(pid, name):
            time.sleep(0.05)
    child = _children.pop(pid, None)
    if child is not None:
        with contextlib.suppress(Exception):
            child.wait(timeout=5)
    return True


def _tail(name: str, lines: int = 30) -> str:
    path = LOG_DIR / f"{name}.log"
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait(name: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _pid(name) is None:
            raise ControlPlaneError(
                f"{name} exited during startup; log {LOG_DIR / name}.log:\n{_tail(name)}"
            )
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.2)
    raise ControlPlaneError(
        f"{name} not ready after {timeout:.0f}s; log {LOG_DIR / name}.log:\n{_tail(name)}"
    )


def _http_ok(
    url: str, *, client_cert: bool = False, verify: bool = False, body: str | None = None
) -> bool:
    ctx = None
    if url.startswith("https"):
        ctx = (
            ssl.create_default_context(cafile=str(PKI_DIR / "ca.crt"))
            if verify
            else ssl._create_unverified_context()
        )  # noqa: S323
        if client_cert:
            ctx.load_cert_chain(PKI_DIR / "admin.crt", PKI_DIR / "admin.key")
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=3) as resp:  # noqa: S310
            text = resp.read().decode(errors="replace")
            return resp.status == 200 and (body is None or body in text)
    except (urllib.error.URLError, OSError):
        return False


# --------------------------------------------------------------------------------------
# kubectl
# --------------------------------------------------------------------------------------


def kubectl(
    *args: str,
    input: str | None = None,  # noqa: A002
    check: bool = True,
    capture: bool = True,
    timeout: float | None = 120,
) -> subprocess.CompletedProcess[str]:
    """Run the pinned kubectl against the local control plane."""
    proc = subprocess.run(
        [str(BIN_DIR / "kubectl"), f"--kubeconfig={KUBECONFIG}", *args],
        input=input,
        text=True,
        capture_output=capture,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise ControlPlaneError(
            f"kubectl {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stdout or ''}{proc.stderr or ''}"
        )
    return proc


def apply_objects(
    objs: Sequence[dict[str, Any]], field_manager: str = "posttrain-control-plane"
) -> None:
    if objs:
        kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager={field_manager}",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}),
        )
