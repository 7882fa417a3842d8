"""Pathways client start-up, before JAX touches a backend.

Under Pathways the trainer is one JAX client in the head pod: the operator sets
`JAX_PLATFORMS=proxy` and `JAX_BACKEND_TARGET=grpc://<head>:29000` (the pathways-proxy
sidecar). JAX only knows the `proxy` platform once `pathwaysutils.initialize()` has
registered it, so that runs first. The proxy is a sidecar that may still be starting:
its port is tried until `timeout` runs out; then the trainer exits with
UNREACHABLE_EXIT_CODE, which the JobSet treats as a failure worth a restart (it is not
the user-error code).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

UNREACHABLE_EXIT_CODE = 75  # EX_TEMPFAIL: try again later
PROXY_PLATFORM = "proxy"


class ProxyUnreachable(RuntimeError):
    """The Pathways proxy did not answer; the message names its address."""


def proxy_address(target: str) -> tuple[str, int]:
    """host and port of JAX_BACKEND_TARGET (grpc://host:port)."""
    parts = urlsplit(target if "://" in target else f"grpc://{target}")
    if not parts.hostname or not parts.port:
        raise ProxyUnreachable(
            f"JAX_BACKEND_TARGET={target!r} names no host:port of a Pathways proxy"
        )
    return parts.hostname, parts.port


def wait_for_proxy(target: str, timeout: float, interval: float = 2.0) -> None:
    """Return once a TCP connection to the proxy succeeds; raise ProxyUnreachable after
    `timeout` seconds."""
    host, port = proxy_address(target)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(interval, 5.0)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ProxyUnreachable(
                    f"the Pathways proxy at {host}:{port} (JAX_BACKEND_TARGET={target}) "
                    f"did not answer within {timeout:.0f}s: {e}; is the pathways-proxy "
                    "sidecar of the pathways-head pod running?"
                ) from e
            time.sleep(interval)


def initialize(env: Mapping[str, str] = os.environ, timeout: float | None = None) -> bool:
    """Under JAX_PLATFORMS=proxy: wait for the proxy, then `pathwaysutils.initialize()`.
    Returns whether Pathways was initialised (False for every other platform)."""
    if env.get("JAX_PLATFORMS") != PROXY_PLATFORM:
        return False
    target = env.get("JAX_BACKEND_TARGET", "")
    if timeout is None:
        timeout = float(env.get("POSTTRAIN_PATHWAYS_PROXY_TIMEOUT", "300"))
    wait_for_proxy(target, timeout)
    import pathwaysutils

    pathwaysutils.initialize()
    return True
