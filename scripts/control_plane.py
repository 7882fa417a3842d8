#!/usr/bin/env python3
"""A real Kubernetes control plane for posttrain's integration and e2e tests.

Everything is built from pinned Go modules (no binary downloads) and runs as plain
processes on loopback, without containers:

    python scripts/control_plane.py build          # compile the pinned binaries (once)
    python scripts/control_plane.py up [--full]    # etcd + kube-apiserver (+ the rest)
    export KUBECONFIG=$PWD/.cache/control-plane/run/kubeconfig
    python scripts/control_plane.py status
    python scripts/control_plane.py down

Tiers:
  basic (integration): etcd, kube-apiserver, CRDs (JobSet, Kueue, crds/*.yaml).
  full  (e2e):         + kube-controller-manager, kube-scheduler, kwok (fake TPU/GPU/CPU
                       nodes), the JobSet controller and Kueue, each with its webhooks
                       registered through `clientConfig.url` on 127.0.0.1.

The module is importable (tests/cluster.py does): see `up`, `down`, `status`,
`kubectl`, `ensure_built`, `install_crds`, `register_url_webhooks`, `tpu_node` & co.
Docs: docs/control-plane.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------
# Pinned versions: the one place to bump. `build` rebuilds what changed.
# --------------------------------------------------------------------------------------
KUBERNETES_VERSION = "v1.36.3"  # k8s.io/kubernetes; staging modules pinned to v0.36.3
ETCD_VERSION = "v3.6.16"  # go.etcd.io/etcd/server/v3
KWOK_VERSION = "v0.8.0"  # sigs.k8s.io/kwok
JOBSET_VERSION = "v0.12.0"  # sigs.k8s.io/jobset
KUEUE_VERSION = "v0.19.1"  # sigs.k8s.io/kueue
HELM_VERSION = "v3.22.0"  # helm.sh/helm/v3

ROOT = Path(__file__).resolve().parent.parent
BUILD_MODULES = ROOT / "scripts" / "control-plane"
CACHE_DIR = ROOT / ".cache" / "control-plane"
BIN_DIR = CACHE_DIR / "bin"
# POSTTRAIN_CONTROL_PLANE_RUN_DIR runs a second, independent plane (own ports, pki, etcd).
RUN_DIR = Path(os.environ.get("POSTTRAIN_CONTROL_PLANE_RUN_DIR") or CACHE_DIR / "run").resolve()
KUBECONFIG = RUN_DIR / "kubeconfig"
STATE_FILE = RUN_DIR / "state.json"
PID_DIR = RUN_DIR / "pids"
LOG_DIR = RUN_DIR / "logs"
PKI_DIR = RUN_DIR / "pki"
SESSIONS_DIR = RUN_DIR / "sessions"
LOCK_FILE = RUN_DIR.parent / f".{RUN_DIR.name}.lock"

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
POD_CIDR = "10.244.0.1/16"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_ANNOTATION_VALUE = "fake"

BASIC = ("etcd", "kube-apiserver")
FULL = BASIC + ("kube-controller-manager", "kube-scheduler", "kwok", "jobset", "kueue")


class ControlPlaneError(RuntimeError):
    """Raised when the control plane cannot be built, started or reached."""


def log(msg: str) -> None:
    print(f"[control-plane] {msg}", file=sys.stderr, flush=True)


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


# --------------------------------------------------------------------------------------
# PKI
# --------------------------------------------------------------------------------------


def _pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: Any, pkcs1: bool = False) -> bytes:
    from cryptography.hazmat.primitives import serialization

    fmt = (
        serialization.PrivateFormat.TraditionalOpenSSL
        if pkcs1
        else serialization.PrivateFormat.PKCS8
    )
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())


@dataclass
class CA:
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def create(
        cls,
        common_name: str = "posttrain-control-plane-ca",
        hosts: Sequence[str] = (),
        rsa_pkcs1: bool = False,
    ) -> CA:
        """A self-signed CA (EC P-256; RSA-2048 with a PKCS#1 key if `rsa_pkcs1`), valid
        for `hosts` (IP addresses or DNS names) too."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        if rsa_pkcs1:
            from cryptography.hazmat.primitives.asymmetric import rsa

            key: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        else:
            key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = _dt.datetime.now(_dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(hours=1))
            .not_valid_after(now + _dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        )
        if hosts:
            cert = cert.add_extension(_subject_alt_names(hosts), critical=False)
        cert = (
            cert.add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(_pem_cert(cert), _pem_key(key, pkcs1=rsa_pkcs1))

    @classmethod
    def load(cls, directory: Path, name: str = "ca") -> CA:
        return cls(
            (directory / f"{name}.crt").read_bytes(), (directory / f"{name}.key").read_bytes()
        )

    def save(self, directory: Path, name: str = "ca") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{name}.crt").write_bytes(self.cert_pem)
        _write_private(directory / f"{name}.key", self.key_pem)

    def issue(
        self,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        hosts: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
    ) -> tuple[bytes, bytes]:
        """Issue a leaf certificate; returns (cert_pem, key_pem)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        ca_key = serialization.load_pem_private_key(self.key_pem, password=None)
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = _dt.datetime.now(_dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(hours=1))
            .not_valid_after(now + _dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
                critical=False,
            )
        )
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if hosts:
            builder = builder.add_extension(_subject_alt_names(hosts), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return _pem_cert(cert), _pem_key(key)


def _subject_alt_names(hosts: Sequence[str]) -> Any:
    """The SubjectAlternativeName extension of `hosts`: IP addresses and DNS names."""
    import ipaddress

    from cryptography import x509

    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(sans)


def self_signed(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """`directory`/tls.crt and tls.key: a serving certificate for `host` that is its own
    CA (the `caBundle` of a webhook configuration pointing at it is tls.crt)."""
    ca = CA.create(host, hosts=[host])
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(ca.cert_pem)
    _write_private(key_path, ca.key_pem)
    return cert_path, key_path


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def serving_cert(directory: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> bytes:
    """Write tls.crt/tls.key (signed by the control-plane CA) to `directory`.

    For webhook servers run outside the cluster (the posttrain operator, JobSet, Kueue).
    Returns the CA bundle (PEM) to put in the webhook configuration's `caBundle`.
    """
    ca = CA.load(PKI_DIR)
    cert, key = ca.issue(hosts[0], hosts=hosts, server=True)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert)
    _write_private(directory / "tls.key", key)
    (directory / "ca.crt").write_bytes(ca.cert_pem)
    return ca.cert_pem


def _create_pki() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    if PKI_DIR.exists():
        shutil.rmtree(PKI_DIR)
    ca = CA.create()
    ca.save(PKI_DIR)
    hosts = [
        "127.0.0.1",
        "localhost",
        SERVICE_IP,
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    cert, key = ca.issue("kube-apiserver", hosts=hosts, server=True)
    (PKI_DIR / "apiserver.crt").write_bytes(cert)
    _write_private(PKI_DIR / "apiserver.key", key)
    cert, key = ca.issue("kubernetes-admin", organizations=["system:masters"], client=True)
    (PKI_DIR / "admin.crt").write_bytes(cert)
    _write_private(PKI_DIR / "admin.key", key)
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_private(PKI_DIR / "sa.key", _pem_key(sa))
    (PKI_DIR / "sa.pub").write_bytes(
        sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _write_kubeconfig(apiserver_port: int) -> None:
    import base64

    def b64(p: str) -> str:
        return base64.b64encode((PKI_DIR / p).read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "posttrain-local",
                "cluster": {
                    "server": f"https://127.0.0.1:{apiserver_port}",
                    "certificate-authority-data": b64("ca.crt"),
                },
            }
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate-data": b64("admin.crt"),
                    "client-key-data": b64("admin.key"),
                },
            }
        ],
        "contexts": [
            {"name": "posttrain-local", "context": {"cluster": "posttrain-local", "user": "admin"}}
        ],
        "current-context": "posttrain-local",
    }
    tmp = KUBECONFIG.with_suffix(".tmp")
    _write_private(tmp, json.dumps(cfg, indent=2).encode())
    tmp.replace(KUBECONFIG)


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


# --------------------------------------------------------------------------------------
# CRDs and webhooks
# --------------------------------------------------------------------------------------


def crd_files() -> list[Path]:
    """CRD YAMLs: JobSet and Kueue from the pinned modules, then the repo's crds/."""
    files = sorted(
        (module_dir("sigs.k8s.io/jobset", JOBSET_VERSION) / "config/components/crd/bases").glob(
            "*.yaml"
        )
    )
    files += sorted(
        (module_dir("sigs.k8s.io/kueue", KUEUE_VERSION) / "config/components/crd/bases").glob(
            "*.yaml"
        )
    )
    repo_crds = ROOT / "crds"
    if repo_crds.is_dir():
        files += sorted(p for p in repo_crds.rglob("*") if p.suffix in (".yaml", ".yml"))
    return files


def install_crds(
    extra: Iterable[Path] = (), *, force: bool = False, state: State | None = None
) -> list[Path]:
    """Apply the CRDs (server-side) and wait until they are Established.

    Skipped when the same files (by content hash) were applied to this control plane
    already, unless `force`. Returns the files.
    """
    import hashlib

    files = [f for f in [*crd_files(), *extra] if f.read_text().strip()]
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f).encode() + b"\0" + f.read_bytes())
    state = state or State.load()
    if not force and state.crd_hash == digest.hexdigest():
        return files
    if files:
        out = kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=posttrain-control-plane",
            "-o",
            "name",
            *[a for f in files for a in ("-f", str(f))],
        ).stdout
        crds = [n for n in out.split() if n.startswith("customresourcedefinition")]
        if crds:
            kubectl("wait", "--for=condition=Established", "--timeout=120s", *crds)
    state.crd_hash = digest.hexdigest()
    state.save()
    return files


def _json_pointer_set(doc: Any, pointer: str, value: Any, op: str) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    target = doc
    for p in parts[:-1]:
        target = target[int(p)] if isinstance(target, list) else target.setdefault(p, {})
    last = parts[-1]
    if isinstance(target, list):
        idx = len(target) if last == "-" else int(last)
        if op == "add":
            target.insert(idx, value)
        else:
            target[idx] = value
    else:
        target[last] = value


def register_url_webhooks(
    docs: Iterable[dict[str, Any]],
    *,
    url_base: str,
    ca_bundle: bytes,
    name_prefix: str,
    keep: Callable[[dict[str, Any]], bool] = lambda _w: True,
    namespace_selector: dict[str, Any] | None = None,
    failure_policy: str | None = None,
    apply: bool = True,
) -> list[dict[str, Any]]:
    """Point (Mutating|Validating)WebhookConfigurations at a webhook server on loopback.

    `docs` are the configurations as a controller ships them (clientConfig.service with a
    path); each becomes `clientConfig.url: {url_base}{path}` with `caBundle`, renamed
    `{name_prefix}{name}`. `keep(webhook)` filters webhooks; `namespace_selector` and
    `failure_policy` override those fields. Returns the objects (applied unless
    apply=False). Remove them with `delete_webhooks(name_prefix)`.
    """
    import base64

    out = []
    for doc in docs:
        if not doc or doc.get("kind") not in (
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ):
            continue
        obj = copy.deepcopy(doc)
        obj["metadata"] = {
            "name": name_prefix + doc["metadata"]["name"],
            "labels": {"app.kubernetes.io/managed-by": "posttrain-control-plane"},
        }
        hooks = []
        for wh in obj.get("webhooks", []):
            if not keep(wh):
                continue
            path = wh["clientConfig"].get("service", {}).get("path", "/")
            wh["clientConfig"] = {
                "url": url_base.rstrip("/") + path,
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
            if namespace_selector is not None:
                wh["namespaceSelector"] = namespace_selector
            if failure_policy is not None:
                wh["failurePolicy"] = failure_policy
            hooks.append(wh)
        obj["webhooks"] = hooks
        if hooks:
            out.append(obj)
    if apply:
        apply_objects(out)
    return out


def delete_webhooks(name_prefix: str) -> None:
    """Delete the (Mutating|Validating)WebhookConfigurations named `{name_prefix}...`."""
    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        out = kubectl("get", kind, "-o", "name", check=False, timeout=20).stdout or ""
        names = [n for n in out.split() if n.split("/", 1)[-1].startswith(name_prefix)]
        if names:
            kubectl("delete", *names, "--ignore-not-found", "--wait=false", check=False, timeout=20)


def _jobset_webhook_docs() -> list[dict[str, Any]]:
    """JobSet's webhooks with its kustomize JSON patches (pod objectSelector) applied."""
    import yaml

    webhook_dir = module_dir("sigs.k8s.io/jobset", JOBSET_VERSION) / "config/components/webhook"
    docs = [d for d in yaml.safe_load_all((webhook_dir / "manifests.yaml").read_text()) if d]
    kustomization = yaml.safe_load((webhook_dir / "kustomization.yaml").read_text()) or {}
    for patch in kustomization.get("patches", []):
        target = patch.get("target", {})
        ops = yaml.safe_load((webhook_dir / patch["path"]).read_text()) if "path" in patch else []
        for doc in docs:
            if doc["kind"] == target.get("kind") and doc["metadata"]["name"] == target.get("name"):
                for op in ops:
                    if op["op"] in ("add", "replace"):
                        _json_pointer_set(doc, op["path"], op["value"], op["op"])
    return docs


# --------------------------------------------------------------------------------------
# Fake nodes (kwok)
# --------------------------------------------------------------------------------------


def _node(
    name: str,
    *,
    labels: dict[str, str],
    capacity: dict[str, str],
    taints: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    base_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": labels.get("node.kubernetes.io/instance-type", "kwok"),
        "type": "kwok",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {**base_labels, **labels},
            "annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_ANNOTATION_VALUE},
        },
        "spec": {"taints": list(taints)},
        "status": {"capacity": dict(capacity), "allocatable": dict(capacity)},
    }


def tpu_node(
    name: str,
    pool: str,
    *,
    accelerator: str = "tpu-v6e-slice",
    topology: str = "2x4",
    chips: int = 4,
    machine_type: str = "ct6e-standard-4t",
) -> dict[str, Any]:
    """A fake TPU host as GKE labels it (one VM of a multi-host slice node pool)."""
    return _node(
        name,
        labels={
            "cloud.google.com/gke-tpu-accelerator": accelerator,
            "cloud.google.com/gke-tpu-topology": topology,
            "cloud.google.com/gke-nodepool": pool,
            "cloud.google.com/gke-accelerator-count": str(chips),
            "node.kubernetes.io/instance-type": machine_type,
        },
        capacity={"cpu": "180", "memory": "720Gi", "pods": "110", "google.com/tpu": str(chips)},
        taints=[{"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}],
    )


def gpu_node(
    name: str,
    pool: str,
    *,
    accelerator: str = "nvidia-h100-80gb",
    gpus: int = 8,
    machine_type: str = "a3-highgpu-8g",
) -> dict[str, Any]:
    """A fake GPU node (GKE taints GPU nodes with nvidia.com/gpu=present:NoSchedule)."""
    return _node(
        name,
        labels={
            "cloud.google.com/gke-accelerator": accelerator,
            "cloud.google.com/gke-accelerator-count": str(gpus),
            "cloud.google.com/gke-nodepool": pool,
            "node.kubernetes.io/instance-type": machine_type,
        },
        capacity={"cpu": "208", "memory": "1872Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
        taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    )


def cpu_node(
    name: str, pool: str = "cpu-pool", *, cpu: str = "32", memory: str = "128Gi"
) -> dict[str, Any]:
    return _node(
        name,
        labels={
            "cloud.google.com/gke-nodepool": pool,
            "node.kubernetes.io/instance-type": "n2-standard-32",
        },
        capacity={"cpu": cpu, "memory": memory, "pods": "110"},
    )


def tpu_slice_nodes(pool: str, *, hosts: int = 2, **kwargs: Any) -> list[dict[str, Any]]:
    """All hosts of one TPU slice node pool: `{pool}-{i}`."""
    return [tpu_node(f"{pool}-{i}", pool, **kwargs) for i in range(hosts)]


def default_nodes() -> list[dict[str, Any]]:
    """What `up --full` creates: two v6e 2x4 slices (2 hosts each), 2 H100 nodes, 2 CPU nodes."""
    return [
        *tpu_slice_nodes("tpu-v6e-2x4-a"),
        *tpu_slice_nodes("tpu-v6e-2x4-b"),
        gpu_node("gpu-h100-0", "gpu-h100"),
        gpu_node("gpu-h100-1", "gpu-h100"),
        cpu_node("cpu-0"),
        cpu_node("cpu-1"),
    ]


def create_nodes(nodes: Sequence[dict[str, Any]]) -> None:
    """Create (or update) fake nodes; kwok marks them Ready and runs their pods."""
    apply_objects(nodes)


def _kwok_stages() -> list[dict[str, Any]]:
    """Stages from the pinned kwok module: node init + lease heartbeat, pod general lifecycle.

    The pod stages (`kustomize/stage/pod/general`) walk a pod Pending -> Running ->
    Succeeded for Job-owned pods. Each waits a random time between `delay` and `jitter`
    (shipped: 1 s and 6 s), shortened here to POSTTRAIN_KWOK_DELAY_MS (default 200) and
    POSTTRAIN_KWOK_JITTER_MS (default 300). Per-pod annotations still override them
    (set both `<stage>.stage.kwok.x-k8s.io/delay` and `.../jitter-delay`: kwok uses the
    jitter whenever it is below the delay). scripts/control-plane/kwok-stages.yaml, if
    present, adds the project's own stages.
    """
    import yaml

    base = module_dir("sigs.k8s.io/kwok", KWOK_VERSION) / "kustomize/stage"
    delay = int(os.environ.get("POSTTRAIN_KWOK_DELAY_MS", "200"))
    jitter = int(os.environ.get("POSTTRAIN_KWOK_JITTER_MS", "300"))
    stages: list[dict[str, Any]] = []
    for sub in ("node/fast", "node/heartbeat-with-lease", "pod/general"):
        kustomization = yaml.safe_load((base / sub / "kustomization.yaml").read_text())
        for res in kustomization["resources"]:
            for doc in yaml.safe_load_all((base / sub / res).read_text()):
                if not doc:
                    continue
                d = doc["spec"].get("delay")
                if sub.startswith("pod/") and d:
                    d["durationMilliseconds"] = delay
                    d["jitterDurationMilliseconds"] = jitter
                stages.append(doc)
    # posttrain's own stages: fail or slow down trainer pods by image tag (e2e tier).
    own = BUILD_MODULES / "kwok-stages.yaml"
    if own.is_file():
        stages += [d for d in yaml.safe_load_all(own.read_text()) if d]
    return stages


# --------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------


def _start_etcd(state: State) -> None:
    data = RUN_DIR / "etcd"
    if data.exists():
        shutil.rmtree(data)
    client, peer = state.port("etcd"), state.port("etcd-peer")
    _start(
        "etcd",
        [
            str(BIN_DIR / "etcd"),
            "--name=posttrain",
            f"--data-dir={data}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=posttrain=http://127.0.0.1:{peer}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync=true",  # a throwaway test store: speed over durability
            "--quota-backend-bytes=4294967296",
            "--log-level=warn",
        ],
    )
    _wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{client}/health", body='"health":"true"'), 60)


def _start_apiserver(state: State) -> None:
    port = state.port("kube-apiserver")
    p = PKI_DIR
    _start(
        "kube-apiserver",
        [
            str(BIN_DIR / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{state.port('etcd')}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={RUN_DIR / 'apiserver-certs'}",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
            *_front_proxy_args(),
        ],
    )
    _wait(
        "kube-apiserver",
        lambda: _http_ok(
            f"https://127.0.0.1:{port}/readyz", client_cert=True, verify=True, body="ok"
        ),
        120,
    )


def _component_kubeconfig_args() -> list[str]:
    return [
        f"--kubeconfig={KUBECONFIG}",
        f"--authentication-kubeconfig={KUBECONFIG}",
        f"--authorization-kubeconfig={KUBECONFIG}",
    ]


def _start_controller_manager(state: State) -> None:
    port = state.port("kube-controller-manager")
    _start(
        "kube-controller-manager",
        [
            str(BIN_DIR / "kube-controller-manager"),
            *_component_kubeconfig_args(),
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={RUN_DIR / 'kcm-certs'}",
            "--leader-elect=false",
            f"--service-account-private-key-file={PKI_DIR / 'sa.key'}",
            f"--root-ca-file={PKI_DIR / 'ca.crt'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--use-service-account-credentials=false",
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            "--concurrent-job-syncs=10",
            "--v=1",
        ],
    )
    _wait(
        "kube-controller-manager",
        lambda: _http_ok(f"https://127.0.0.1:{port}/healthz", body="ok"),
        60,
    )


def _start_scheduler(state: State) -> None:
    port = state.port("kube-scheduler")
    cfg = RUN_DIR / "kube-scheduler.yaml"
    cfg.write_text(
        json.dumps(
            {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": str(KUBECONFIG), "qps": 200, "burst": 400},
                "leaderElection": {"leaderElect": False},
            },
            indent=2,
        )
    )
    _start(
        "kube-scheduler",
        [
            str(BIN_DIR / "kube-scheduler"),
            f"--config={cfg}",
            f"--authentication-kubeconfig={KUBECONFIG}",
            f"--authorization-kubeconfig={KUBECONFIG}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={RUN_DIR / 'scheduler-certs'}",
            "--v=1",
        ],
    )
    _wait("kube-scheduler", lambda: _http_ok(f"https://127.0.0.1:{port}/healthz", body="ok"), 60)


def _start_kwok(state: State) -> None:
    """kwok runs the fake nodes and is their kubelet: every node's address is 127.0.0.1
    and its kubelet port kwok's own HTTPS server, so the API server's pod-log requests
    reach kwok, which answers them from `Logs` objects (kwok.x-k8s.io/v1alpha1, one per
    pod: see `pod_log`)."""
    import yaml

    port = state.port("kwok")
    cfg = RUN_DIR / "kwok.yaml"
    cfg.write_text(yaml.safe_dump_all(_kwok_stages(), sort_keys=False))
    crd = (
        module_dir("sigs.k8s.io/kwok", KWOK_VERSION) / "kustomize/crd/bases/kwok.x-k8s.io_logs.yaml"
    )
    kubectl("apply", "--server-side", "--field-manager=posttrain-control-plane", "-f", str(crd))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/logs.kwok.x-k8s.io")
    certs = RUN_DIR / "kwok-certs"
    serving_cert(certs)
    _start(
        "kwok",
        [
            str(BIN_DIR / "kwok"),
            f"--kubeconfig={KUBECONFIG}",
            f"--config={cfg}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_ANNOTATION_VALUE}",
            "--node-lease-duration-seconds=40",
            f"--cidr={POD_CIDR}",
            "--node-ip=127.0.0.1",
            f"--node-port={port}",
            f"--server-address=127.0.0.1:{port}",
            f"--tls-cert-file={certs / 'tls.crt'}",
            f"--tls-private-key-file={certs / 'tls.key'}",
            "--enable-crds=Logs",
        ],
    )
    _wait("kwok", lambda: _http_ok(f"https://127.0.0.1:{port}/healthz", verify=True), 60)


def pod_log(namespace: str, pod: str, lines: Sequence[str], path: Path) -> None:
    """Give a kwok pod's `trainer` container a log: `lines` written to `path` in the CRI
    log format a kubelet reads, served by kwok through the API server's pod-log endpoint."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime())
    path.write_text("".join(f"{stamp} stdout F {line}\n" for line in lines))
    apply_objects(
        [
            {
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "Logs",
                "metadata": {"name": pod, "namespace": namespace},
                "spec": {"logs": [{"containers": ["trainer"], "logsFile": str(path)}]},
            }
        ]
    )


def _start_jobset(state: State) -> None:
    import yaml

    webhook, health = state.port("jobset-webhook"), state.port("jobset-health")
    certs = RUN_DIR / "jobset-certs"
    ca = serving_cert(certs)
    cfg = RUN_DIR / "jobset.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
                "kind": "Configuration",
                "leaderElection": {"leaderElect": False},
                "internalCertManagement": {"enable": False},
                "webhook": {"port": webhook, "host": "127.0.0.1", "certDir": str(certs)},
                "metrics": {"bindAddress": "0"},
                "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
            }
        )
    )
    _start(
        "jobset",
        [str(BIN_DIR / "jobset"), f"--config={cfg}", "--zap-devel=false"],
        env={"KUBECONFIG": str(KUBECONFIG)},
    )
    _wait("jobset", lambda: _http_ok(f"http://127.0.0.1:{health}/readyz"), 90)
    register_url_webhooks(
        _jobset_webhook_docs(),
        url_base=f"https://127.0.0.1:{webhook}",
        ca_bundle=ca,
        name_prefix="jobset-",
    )


KUEUE_FRAMEWORKS = ("batch/job", "jobset.x-k8s.io/jobset")
KUEUE_WEBHOOK_GROUPS = {"kueue.x-k8s.io", "batch", "jobset.x-k8s.io"}


KUEUE_NAMESPACE = "kueue-system"
KUEUE_WEBHOOK_SERVICE = "kueue-webhook-service"  # Kueue's defaults; its cert rotator
KUEUE_WEBHOOK_SECRET = "kueue-webhook-server-cert"  # derives names from them


def _kueue_certs(certs: Path) -> bytes:
    """Kueue's webhook cert, pre-seeded where its internal cert rotator looks for it.

    Kueue v0.19 insists on either internal cert management or metrics certs under the
    hard-coded /etc/kueue/metrics/certs. We keep internal cert management on and hand
    the rotator a Secret it accepts as valid (a CA with SAN `kueue-ca`; a serving cert
    for `kueue-webhook-service.kueue-system.svc`), so it neither rotates nor rewrites
    anything. The serving cert also carries 127.0.0.1, which is what the API server
    dials through `clientConfig.url`. The rotator only injects this same CA.
    """
    import base64

    # cert-controller parses the CA key as PKCS#1 RSA.
    ca = CA.create("kueue-ca", hosts=["kueue-ca"], rsa_pkcs1=True)
    svc = f"{KUEUE_WEBHOOK_SERVICE}.{KUEUE_NAMESPACE}.svc"
    cert, key = ca.issue(svc, hosts=[svc, "127.0.0.1", "localhost"], server=True)
    certs.mkdir(parents=True, exist_ok=True)
    (certs / "tls.crt").write_bytes(cert)
    _write_private(certs / "tls.key", key)
    (certs / "ca.crt").write_bytes(ca.cert_pem)
    data = {"ca.crt": ca.cert_pem, "ca.key": ca.key_pem, "tls.crt": cert, "tls.key": key}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": KUEUE_WEBHOOK_SECRET, "namespace": KUEUE_NAMESPACE},
        "type": "kubernetes.io/tls",
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }
    apply_objects(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}}, secret]
    )
    return ca.cert_pem


KUEUE_VISIBILITY_CERTS = Path("/visibility")  # Kueue hard-codes it (pkg/visibility)
KUEUE_VISIBILITY_APISERVICE = "v1beta2.visibility.kueue.x-k8s.io"


def _front_proxy_args() -> list[str]:
    """kube-apiserver's front proxy: it forwards requests for aggregated APIs (Kueue's
    visibility API) with a client cert of the cluster CA named front-proxy-client and the
    user in X-Remote-* headers, which the aggregated server trusts from that cert only."""
    cert, key = PKI_DIR / "front-proxy-client.crt", PKI_DIR / "front-proxy-client.key"
    if not cert.exists():
        pem, private = CA.load(PKI_DIR).issue("front-proxy-client", client=True)
        cert.write_bytes(pem)
        _write_private(key, private)
    return [
        f"--requestheader-client-ca-file={PKI_DIR / 'ca.crt'}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={cert}",
        f"--proxy-client-key-file={key}",
    ]


def _kueue_visibility(state: State | None) -> tuple[dict[str, Any], list[str]]:
    """Kueue's visibility API (pending workloads with their queue positions), an
    aggregated API server: registers its APIService and returns Kueue's config and
    flags for it (state None: removes the APIService, whose discovery would fail once
    Kueue stops). The APIService reaches 127.0.0.1 through a Service of type
    ExternalName (this plane has no Service network) and skips TLS verification as
    Kueue's own manifest does. Kueue writes its self-signed serving cert to
    /visibility, a path it hard-codes; where that cannot be written the API stays off."""
    import yaml

    if state is None:
        kubectl("delete", "apiservice", KUEUE_VISIBILITY_APISERVICE, "--ignore-not-found",
                "--wait=false", check=False, timeout=20)  # fmt: skip
        return {}, []
    try:
        KUEUE_VISIBILITY_CERTS.mkdir(exist_ok=True)
        if not os.access(KUEUE_VISIBILITY_CERTS, os.W_OK):
            raise PermissionError(f"{KUEUE_VISIBILITY_CERTS} is not writable")
    except OSError as e:
        log(f"kueue: visibility API off ({e})")
        return {}, ["--feature-gates=VisibilityOnDemand=false"]
    port = state.port("kueue-visibility")
    path = module_dir("sigs.k8s.io/kueue", KUEUE_VERSION) / "config/components/visibility"
    api = yaml.safe_load((path / "apiservice_v1beta2.yaml").read_text())
    name = "kueue-visibility-server"
    api["spec"]["service"] = {"name": name, "namespace": KUEUE_NAMESPACE, "port": port}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": KUEUE_NAMESPACE},
        "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"port": port}]},
    }
    apply_objects([service, api])
    config = {"visibilityServer": {"bindAddress": "127.0.0.1", "bindPort": port}}
    # Its delegated authentication and authorization read the --kubeconfig flag.
    return config, [f"--kubeconfig={KUBECONFIG}"]


def _register_kueue_webhooks(
    docs: list[dict[str, Any]], url_base: str, ca: bytes, failure_policy: str | None = None
) -> None:
    """Kueue's webhooks of the groups posttrain uses, at its server on loopback, for every
    namespace but kube-system and Kueue's own; ``failure_policy`` overrides Kueue's."""
    register_url_webhooks(
        docs,
        url_base=url_base,
        ca_bundle=ca,
        name_prefix="kueue-",
        keep=lambda wh: all(
            set(r.get("apiGroups", [])) <= KUEUE_WEBHOOK_GROUPS for r in wh.get("rules", [])
        ),
        namespace_selector={
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "NotIn",
                    "values": ["kube-system", KUEUE_NAMESPACE],
                }
            ]
        },
        failure_policy=failure_policy,
    )


def _start_kueue(state: State) -> None:
    import yaml

    webhook, health = state.port("kueue-webhook"), state.port("kueue-health")
    certs = RUN_DIR / "kueue-certs"
    ca = _kueue_certs(certs)
    url_base = f"https://127.0.0.1:{webhook}"
    # Webhook configurations and CRD conversion first: the rotator injects its CA
    # into them (the same CA) before Kueue reports ready.
    docs = list(
        yaml.safe_load_all(
            (
                module_dir("sigs.k8s.io/kueue", KUEUE_VERSION)
                / "config/components/webhook/manifests.yaml"
            ).read_text()
        )
    )
    # Until Kueue serves, do not block Jobs/JobSets cluster-wide.
    _register_kueue_webhooks(docs, url_base, ca, failure_policy="Ignore")
    _kueue_conversion(f"{url_base}/convert", ca)
    visibility, visibility_args = _kueue_visibility(state)
    cfg = RUN_DIR / "kueue.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "config.kueue.x-k8s.io/v1beta2",
                "kind": "Configuration",
                "namespace": KUEUE_NAMESPACE,
                "leaderElection": {"leaderElect": False},
                "internalCertManagement": {
                    "enable": True,
                    "webhookServiceName": KUEUE_WEBHOOK_SERVICE,
                    "webhookSecretName": KUEUE_WEBHOOK_SECRET,
                },
                "webhook": {"port": webhook, "host": "127.0.0.1", "certDir": str(certs)},
                "metrics": {"bindAddress": "0"},
                "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
                "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
                **visibility,
            }
        )
    )
    _start(
        "kueue",
        [str(BIN_DIR / "kueue"), f"--config={cfg}", *visibility_args],
        env={"KUBECONFIG": str(KUBECONFIG)},
    )
    _wait("kueue", lambda: _http_ok(f"http://127.0.0.1:{health}/readyz"), 120)
    if visibility:  # it serves a moment after readyz; until then discovery fails
        available = "jsonpath={.status.conditions[?(@.type=='Available')].status}"
        get = ("get", "apiservice", KUEUE_VISIBILITY_APISERVICE, "-o", available)
        try:
            _wait("kueue", lambda: kubectl(*get, check=False, timeout=10).stdout == "True", 60)
        except ControlPlaneError:
            if _pid("kueue") is None:
                raise
            # e.g. an API server started without the front-proxy flags: no visibility API.
            log("kueue: visibility API not available; removing its APIService")
            _kueue_visibility(None)
    # Serving now: make its webhooks as strict as Kueue ships them.
    _register_kueue_webhooks(docs, url_base, ca)


def _kueue_conversion_crds() -> list[str]:
    """CRDs Kueue's kustomization patches to a conversion webhook (v1beta1 <-> v1beta2)."""
    import yaml

    crd_dir = module_dir("sigs.k8s.io/kueue", KUEUE_VERSION) / "config/components/crd"
    kustomization = yaml.safe_load((crd_dir / "kustomization.yaml").read_text()) or {}
    names = []
    for patch in kustomization.get("patches", []):
        doc = yaml.safe_load((crd_dir / patch["path"]).read_text())
        if (doc.get("spec", {}).get("conversion") or {}).get("strategy") == "Webhook":
            names.append(doc["metadata"]["name"])
    return names


def _kueue_conversion(url: str | None, ca: bytes = b"") -> None:
    """Point Kueue's multi-version CRDs at its /convert webhook (url=None: back to None)."""
    import base64

    if url:
        conversion = {
            "strategy": "Webhook",
            "webhook": {
                "clientConfig": {"url": url, "caBundle": base64.b64encode(ca).decode()},
                "conversionReviewVersions": ["v1"],
            },
        }
    else:
        conversion = {"strategy": "None", "webhook": None}
    patch = json.dumps({"spec": {"conversion": conversion}})
    for name in _kueue_conversion_crds():
        kubectl("patch", "crd", name, "--type=merge", "-p", patch, check=url is not None)


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


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _print_status(st: dict[str, Any]) -> None:
    for name, c in st["components"].items():
        state = f"running pid {c['pid']}" if c["running"] else "stopped"
        port = (
            (st["ports"].get(name) or st["ports"].get(f"{name}-webhook", ""))
            if c["running"]
            else ""
        )
        owner = f"(started by {c['owner']})" if c["running"] and c["owner"] else ""
        print(f"{name:<24} {state:<20} {port!s:<6} {owner}")
    print(f"apiserver ready: {st['apiserver_ready']}")
    if st["kubeconfig"] and st["apiserver_ready"]:
        print(f"export KUBECONFIG={st['kubeconfig']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the pinned binaries into .cache/control-plane/bin")
    b.add_argument(
        "components", nargs="*", help=f"subset of: {', '.join(c.name for c in COMPONENTS)}"
    )
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    u = sub.add_parser("up", help="start etcd + kube-apiserver (+ the rest with --full)")
    u.add_argument(
        "--full",
        action="store_true",
        help="also controller-manager, scheduler, kwok, JobSet, Kueue",
    )
    u.add_argument(
        "--no-nodes", action="store_true", help="with --full: create no default fake nodes"
    )
    sub.add_parser("down", help="stop every process this script started")
    sub.add_parser("status", help="show what runs")
    sub.add_parser("env", help="print `export KUBECONFIG=...`")
    sub.add_parser("versions", help="print the pinned versions")
    k = sub.add_parser("kubectl", help="run the pinned kubectl against the local plane")
    k.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            build(args.components or None, force=args.force)
        elif args.cmd == "up":
            t0 = time.monotonic()
            started = up(full=args.full, nodes=not args.no_nodes)
            print(
                f"started: {', '.join(started) or 'nothing (already up)'} in {time.monotonic() - t0:.1f}s"
            )
            print(f"export KUBECONFIG={KUBECONFIG}")
        elif args.cmd == "down":
            stopped = down()
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
        elif args.cmd == "status":
            _print_status(status())
        elif args.cmd == "env":
            print(f"export KUBECONFIG={KUBECONFIG}")
        elif args.cmd == "versions":
            for c in COMPONENTS:
                print(f"{c.name:<11} {c.version:<9} {', '.join(c.packages)}")
        elif args.cmd == "kubectl":
            return kubectl(*args.args, check=False, capture=False, timeout=None).returncode
    except ControlPlaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
