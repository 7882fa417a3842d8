"""Shared fixtures: a real local Kubernetes control plane (scripts/control_plane.py).

- `apiserver` (session): etcd + kube-apiserver with the JobSet, Kueue and crds/ CRDs.
  For tests marked `integration`.
- `cluster` (session): + kube-controller-manager, kube-scheduler, kwok fake TPU/GPU/CPU
  nodes, the JobSet controller and Kueue with their webhooks. For tests marked `e2e`.
- `namespace` (function): a fresh namespace on whichever of the two the test uses.

One control plane per session: reused when already up (e.g. after
`python scripts/control_plane.py up --full`), else started here and stopped at session
end. Missing binaries FAIL the test with the build command; these tiers never skip.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.cluster import Cluster, ControlPlaneError, start, stop  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run e2e tests last: the `cluster` fixture upgrades the session's plane to the full
    tier (controllers that act on JobSets/pods), and integration tests expect none."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


@pytest.fixture(scope="session")
def _control_plane_session() -> Iterator[list[Cluster]]:
    """Owns the session's lease on the control plane; tears down once, at the end."""
    used: list[Cluster] = []
    yield used
    if used:
        stop(used[-1])


def _start(session: list[Cluster], full: bool) -> Cluster:
    try:
        cluster = start(full)
    except ControlPlaneError as e:
        error = str(e)
    else:
        session.append(cluster)
        return cluster
    pytest.fail(error, pytrace=False)  # outside `except`: no chained traceback noise


@pytest.fixture(scope="session")
def apiserver(_control_plane_session: list[Cluster]) -> Cluster:
    """Integration tier: a real kube-apiserver + etcd with CRDs installed."""
    return _start(_control_plane_session, full=False)


@pytest.fixture(scope="session")
def cluster(_control_plane_session: list[Cluster]) -> Cluster:
    """E2E tier: the full control plane with kwok nodes, JobSet and Kueue."""
    return _start(_control_plane_session, full=True)


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    """A unique namespace for this test on `cluster` if the test uses it, else `apiserver`."""
    which = "cluster" if "cluster" in request.fixturenames else "apiserver"
    plane: Cluster = request.getfixturevalue(which)
    name = plane.create_namespace(request.node.name[:30])
    yield name
    plane.delete_namespace(name)
