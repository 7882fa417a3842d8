"""Pinned versions, paths and tiers of the local control plane, and its error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# --------------------------------------------------------------------------------------
# Pinned versions: the one place to bump. `build` rebuilds what changed.
# --------------------------------------------------------------------------------------
KUBERNETES_VERSION = "v1.36.3"  # k8s.io/kubernetes; staging modules pinned to v0.36.3
ETCD_VERSION = "v3.6.16"  # go.etcd.io/etcd/server/v3
KWOK_VERSION = "v0.8.0"  # sigs.k8s.io/kwok
JOBSET_VERSION = "v0.12.0"  # sigs.k8s.io/jobset
KUEUE_VERSION = "v0.19.1"  # sigs.k8s.io/kueue
HELM_VERSION = "v3.22.0"  # helm.sh/helm/v3

ROOT = Path(__file__).resolve().parents[2]
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
