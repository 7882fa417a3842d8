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
This file is the command line; the plane itself is scripts/local_plane/, one module a
concern: settings (the pins, paths and tiers), build, pki, processes, webhooks (and
CRDs), nodes (kwok's nodes and stages), components (starting each one), lifecycle (up,
down, status, sessions). Docs: docs/control-plane.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))  # scripts/, where local_plane is

from local_plane.build import (  # noqa: E402, F401  (the API tests/cluster.py uses)
    BASIC_BINARIES,
    COMPONENTS,
    FULL_BINARIES,
    Component,
    binary_ok,
    build,
    ensure_built,
    missing_binaries,
    module_dir,
)
from local_plane.components import (  # noqa: E402, F401  (the API tests/cluster.py uses)
    KUEUE_FRAMEWORKS,
    KUEUE_NAMESPACE,
    KUEUE_VISIBILITY_APISERVICE,
    KUEUE_VISIBILITY_CERTS,
    KUEUE_WEBHOOK_GROUPS,
    KUEUE_WEBHOOK_SECRET,
    KUEUE_WEBHOOK_SERVICE,
    _start_apiserver,
    pod_log,
)
from local_plane.lifecycle import (  # noqa: E402, F401  (the API tests/cluster.py uses)
    WEBHOOK_PREFIXES,
    apiserver_ready,
    down,
    enter_session,
    is_up,
    leave_session,
    running,
    status,
    up,
)
from local_plane.nodes import (  # noqa: E402, F401  (the API tests/cluster.py uses)
    cpu_node,
    create_nodes,
    default_nodes,
    gpu_node,
    tpu_node,
    tpu_slice_nodes,
)
from local_plane.pki import (  # noqa: E402, F401  (the API tests/cluster.py uses)
    CA,
    self_signed,
    serving_cert,
)
from local_plane.processes import (  # noqa: E402, F401  (the API tests/cluster.py uses)
    State,
    _pid,
    _stop,
    apply_objects,
    free_port,
    kubectl,
)
from local_plane.settings import (  # noqa: E402, F401  (the API tests/cluster.py uses)
    BASIC,
    BIN_DIR,
    BUILD_MODULES,
    CACHE_DIR,
    ETCD_VERSION,
    FULL,
    HELM_VERSION,
    JOBSET_VERSION,
    KUBECONFIG,
    KUBERNETES_VERSION,
    KUEUE_VERSION,
    KWOK_NODE_ANNOTATION,
    KWOK_NODE_ANNOTATION_VALUE,
    KWOK_VERSION,
    LOCK_FILE,
    LOG_DIR,
    PID_DIR,
    PKI_DIR,
    POD_CIDR,
    ROOT,
    RUN_DIR,
    SERVICE_CIDR,
    SERVICE_IP,
    SESSIONS_DIR,
    STATE_FILE,
    ControlPlaneError,
    log,
)
from local_plane.webhooks import (  # noqa: E402, F401  (the API tests/cluster.py uses)
    crd_files,
    delete_webhooks,
    install_crds,
    register_url_webhooks,
)

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
