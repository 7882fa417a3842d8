"""Flags of `posttrain operator` (kept free of kopf so the CLI starts without it)."""

from __future__ import annotations

import argparse
import os
import socket
import uuid


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace", "-n", action="append", help="watch these namespaces (default: all)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("POSTTRAIN_METRICS_PORT", 8080)),
        help="serve /metrics and /healthz here",
    )
    p.add_argument(
        "--lease-namespace", default=os.environ.get("POSTTRAIN_LEASE_NAMESPACE", "default")
    )
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
    )
    p.add_argument(
        "--webhook-port", type=int, default=0, help="serve admission on this port (0: off)"
    )
    p.add_argument("--webhook-address", default="0.0.0.0")
    p.add_argument("--webhook-host", help="host name the API server uses to reach the webhook")
    p.add_argument("--webhook-cert")
    p.add_argument("--webhook-key")
    p.add_argument("--webhook-ca")
    p.add_argument(
        "--webhook-register",
        action="store_true",
        help="create/patch the ValidatingWebhookConfiguration itself",
    )
