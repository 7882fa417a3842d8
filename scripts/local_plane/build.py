"""Building the pinned binaries from Go modules (`build`, `ensure_built`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from local_plane.settings import (
    BIN_DIR,
    BUILD_MODULES,
    ETCD_VERSION,
    HELM_VERSION,
    JOBSET_VERSION,
    KUBERNETES_VERSION,
    KUEUE_VERSION,
    KWOK_VERSION,
    ROOT,
    ControlPlaneError,
    log,
)

# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------


def _kube_ldflags() -> str:
    major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={KUBERNETES_VERSION}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
        ]
    return " ".join(flags)


@dataclass(frozen=True)
class Component:
    """One `build` unit: a pinned version producing one or more binaries."""

    name: str  # also the build module folder: scripts/control-plane/<name>/
    version: str
    binaries: tuple[str, ...]
    module: str  # the Go module required at `version`
    packages: tuple[str, ...]  # Go package per binary (same order as binaries)
    ldflags: str = "-s -w"


COMPONENTS: tuple[Component, ...] = (
    Component(
        "kubernetes",
        KUBERNETES_VERSION,
        ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"),
        "k8s.io/kubernetes",
        tuple(
            f"k8s.io/kubernetes/cmd/{c}"
            for c in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
        ),
        _kube_ldflags(),
    ),
    Component(
        "etcd", ETCD_VERSION, ("etcd",), "go.etcd.io/etcd/server/v3", ("go.etcd.io/etcd/server/v3",)
    ),
    Component(
        "kwok",
        KWOK_VERSION,
        ("kwok", "kwokctl"),
        "sigs.k8s.io/kwok",
        ("sigs.k8s.io/kwok/cmd/kwok", "sigs.k8s.io/kwok/cmd/kwokctl"),
    ),
    Component(
        "jobset",
        JOBSET_VERSION,
        ("jobset",),
        "sigs.k8s.io/jobset",
        ("sigs.k8s.io/jobset",),  # the controller's main sits at the module root
        f"-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion={JOBSET_VERSION}",
    ),
    Component(
        "kueue",
        KUEUE_VERSION,
        ("kueue",),
        "sigs.k8s.io/kueue",
        ("sigs.k8s.io/kueue/cmd/kueue",),
        f"-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE_VERSION}",
    ),
    Component("helm", HELM_VERSION, ("helm",), "helm.sh/helm/v3", ("helm.sh/helm/v3/cmd/helm",)),
)

# Binaries each tier needs (`ensure_built` checks these).
BASIC_BINARIES = ("etcd", "kube-apiserver", "kubectl")
FULL_BINARIES = BASIC_BINARIES + (
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "jobset",
    "kueue",
)


def _stamp(component: Component, binary: str) -> str:
    # The stamp names the pinned version and the flags: a bump of either rebuilds.
    return json.dumps({"version": component.version, "ldflags": component.ldflags}, sort_keys=True)


def _stamp_path(binary: str) -> Path:
    return BIN_DIR / ".stamps" / f"{binary}.json"


def _component_of(binary: str) -> Component:
    for c in COMPONENTS:
        if binary in c.binaries:
            return c
    raise KeyError(binary)


def binary_ok(binary: str) -> bool:
    """True when BIN_DIR/binary exists and was built for the pinned version."""
    path, stamp = BIN_DIR / binary, _stamp_path(binary)
    if not path.is_file() or not stamp.is_file():
        return False
    return stamp.read_text() == _stamp(_component_of(binary), binary)


def missing_binaries(full: bool = False) -> list[str]:
    return [b for b in (FULL_BINARIES if full else BASIC_BINARIES) if not binary_ok(b)]


def ensure_built(full: bool = False) -> None:
    """Raise ControlPlaneError naming the build command when binaries are missing."""
    missing = missing_binaries(full)
    if missing:
        raise ControlPlaneError(
            f"control-plane binaries missing or built for other versions: {', '.join(missing)}."
            f" Run `python scripts/control_plane.py build` (a cold build takes about an hour on"
            f" 2 cores; later builds are no-ops). Binaries go to {BIN_DIR}."
        )


def _go_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    # Default GOMODCACHE/GOCACHE (whatever `go env` says) so CI caches are reused.
    for var in ("GOMODCACHE", "GOCACHE"):
        if not env.get(var):
            env.pop(var, None)
    env["CGO_ENABLED"] = "0"
    env["GOFLAGS"] = " ".join(
        f for f in ["-trimpath", "-buildvcs=false", env.get("GOFLAGS", "")] if f
    )
    env.setdefault("GOTOOLCHAIN", "local")
    return env


def _go(
    *args: str, cwd: Path | None = None, capture: bool = False, env: dict[str, str] | None = None
) -> str:
    if not shutil.which("go"):
        raise ControlPlaneError(
            "`go` is not on PATH; install Go >= 1.26 to build the control plane"
        )
    proc = subprocess.run(
        ["go", *args],
        cwd=cwd,
        env=_go_env(env),
        text=True,
        stdout=subprocess.PIPE if capture else None,
        check=False,
    )
    if proc.returncode != 0:
        raise ControlPlaneError(f"`go {' '.join(args)}` failed (exit {proc.returncode})")
    return proc.stdout or ""


def module_dir(module: str, version: str) -> Path:
    """Directory of module@version in the Go module cache (downloaded if absent)."""
    gomodcache = os.environ.get("GOMODCACHE") or _go("env", "GOMODCACHE", capture=True).strip()
    # Module cache paths escape upper-case letters as !lower.
    escaped = "".join(f"!{ch.lower()}" if ch.isupper() else ch for ch in module)
    path = Path(gomodcache) / f"{escaped}@{version}"
    if not path.is_dir():
        info = json.loads(_go("mod", "download", "-json", f"{module}@{version}", capture=True))
        if info.get("Error"):
            raise ControlPlaneError(f"go mod download {module}@{version}: {info['Error']}")
        path = Path(info["Dir"])
    return path


def _module_gomod(module: str, version: str) -> Path:
    info = json.loads(_go("mod", "download", "-json", f"{module}@{version}", capture=True))
    if info.get("Error"):
        raise ControlPlaneError(f"go mod download {module}@{version}: {info['Error']}")
    return Path(info["GoMod"])


def _staging_modules(kube_version: str) -> list[str]:
    """k8s.io staging modules, read from the release's own go.mod replace block."""
    text = _module_gomod("k8s.io/kubernetes", kube_version).read_text()
    mods = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("./staging/"):
            mods.append(parts[0])
    if not mods:
        raise ControlPlaneError("no staging replace directives found in k8s.io/kubernetes go.mod")
    return mods


def _replaces(component: Component) -> list[str]:
    """Modules the main module's own go.mod replaces with local paths, pinned to tags."""
    if component.name == "kubernetes":
        staging = "v0." + component.version.lstrip("v").split(".", 1)[1]
        return [f"{m} => {m} {staging}" for m in _staging_modules(component.version)]
    if component.name == "etcd":
        mods = ("api/v3", "client/pkg/v3", "client/v3", "pkg/v3")
        return [f"go.etcd.io/etcd/{m} => go.etcd.io/etcd/{m} {component.version}" for m in mods]
    return []


def _write_build_module(component: Component, moddir: Path) -> None:
    lines = [
        f"// Build module for {', '.join(component.binaries)}: written by",
        "// scripts/control_plane.py from its pinned versions; go.sum is the lock.",
        f"module posttrain.dev/control-plane/{component.name}",
        "",
        "go 1.26.0",
        "",
        f"require {component.module} {component.version}",
        "",
    ]
    if replaces := _replaces(component):
        lines += ["replace (", *[f"\t{r}" for r in replaces], ")", ""]
    lines += ["tool (", *[f"\t{p}" for p in component.packages], ")", ""]
    (moddir / "go.mod").write_text("\n".join(lines))


def _ensure_build_module(component: Component) -> Path:
    """scripts/control-plane/<name>/ requiring the pinned module (rewritten on a bump).

    A build module rather than `go install pkg@version`: k8s.io/kubernetes and etcd's
    server module replace modules with local paths (not installable), and `go install
    @version` also reads the module's version list, which some proxies refuse. With the
    pinned module as the only requirement, minimal version selection picks exactly the
    versions in that module's own go.mod.
    """
    moddir = BUILD_MODULES / component.name
    moddir.mkdir(parents=True, exist_ok=True)
    gomod = moddir / "go.mod"
    pinned = f"{component.module} {component.version}"
    if gomod.is_file() and pinned in gomod.read_text() and (moddir / "go.sum").is_file():
        return moddir
    log(f"writing build module {moddir.relative_to(ROOT)} for {pinned}")
    _write_build_module(component, moddir)
    _go("mod", "tidy", cwd=moddir)
    return moddir


def _build_component(component: Component, binaries: Sequence[str]) -> None:
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    pkgs = [component.packages[component.binaries.index(b)] for b in binaries]
    moddir = _ensure_build_module(component)
    ldflags = f"-ldflags={component.ldflags}"
    if len(pkgs) == 1:
        _go("build", ldflags, "-o", str(BIN_DIR / binaries[0]), pkgs[0], cwd=moddir)
    else:  # one go command: packages compile once, binaries link in parallel
        _go("build", ldflags, "-o", str(BIN_DIR) + "/", *pkgs, cwd=moddir)
    for b in binaries:
        if not (BIN_DIR / b).is_file():
            raise ControlPlaneError(f"build of {component.name} produced no {BIN_DIR / b}")
        _stamp_path(b).parent.mkdir(parents=True, exist_ok=True)
        _stamp_path(b).write_text(_stamp(component, b))


def build(only: Iterable[str] | None = None, force: bool = False) -> dict[str, float]:
    """Build missing/outdated binaries; return seconds per component."""
    wanted = set(only) if only else None
    timings: dict[str, float] = {}
    total0 = time.monotonic()
    for c in COMPONENTS:
        if wanted is not None and c.name not in wanted and not (wanted & set(c.binaries)):
            continue
        todo = [b for b in c.binaries if force or not binary_ok(b)]
        if not todo:
            print(f"{c.name:<11} {c.version:<9} up to date ({', '.join(c.binaries)})", flush=True)
            timings[c.name] = 0.0
            continue
        print(f"{c.name:<11} {c.version:<9} building {', '.join(todo)} ...", flush=True)
        t0 = time.monotonic()
        _build_component(c, todo)
        timings[c.name] = time.monotonic() - t0
        print(f"{c.name:<11} {c.version:<9} built in {timings[c.name]:.1f}s", flush=True)
    print(f"total build time {time.monotonic() - total0:.1f}s; binaries in {BIN_DIR}", flush=True)
    return timings
