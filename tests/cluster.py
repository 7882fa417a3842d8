"""Test helpers for the tiers that talk to a real Kubernetes API server.

The control plane comes from scripts/control_plane.py (pinned binaries built from Go
modules, run as plain processes on loopback). tests/conftest.py turns this module into
session-scoped fixtures:

    apiserver  (integration tier): etcd + kube-apiserver + CRDs (JobSet, Kueue, crds/)
    cluster    (e2e tier):         + controller-manager, scheduler, kwok fake nodes,
                                   JobSet controller + webhooks, Kueue + webhooks
    namespace  a fresh namespace per test, deleted afterwards

Both fixtures yield a `Cluster`: `.kubeconfig`, `.kubectl(*args)`, `.api_client`
(kubernetes.client.ApiClient), `.core`, `.custom`, `.apply(...)`, `.wait_for(...)`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = ROOT / "scripts" / "control_plane.py"


def _load_control_plane():
    name = "posttrain_control_plane"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _SCRIPT)
    assert spec and spec.loader, _SCRIPT
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


control_plane = _load_control_plane()
ControlPlaneError = control_plane.ControlPlaneError

# Fake node builders (plain dicts, create them with Cluster.create_nodes).
tpu_node = control_plane.tpu_node
tpu_slice_nodes = control_plane.tpu_slice_nodes
gpu_node = control_plane.gpu_node
cpu_node = control_plane.cpu_node
default_nodes = control_plane.default_nodes
# A serving certificate that is its own CA (for a webhook server run by a test).
self_signed = control_plane.self_signed

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    *,
    timeout: float = 60.0,
    interval: float = 0.5,
    what: str = "condition",
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll `predicate` until it returns something truthy; return that value.

    Exceptions inside the predicate count as "not yet". On timeout an AssertionError
    names `what` and carries `describe()` (e.g. a kubectl dump) for the failure report.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 (keep polling; reported on timeout)
            last_exc = e
        if time.monotonic() > deadline:
            detail = ""
            if describe is not None:
                try:
                    detail = "\n" + describe()
                except Exception as e:  # noqa: BLE001
                    detail = f"\n(describe failed: {e})"
            if last_exc is not None:
                detail += f"\nlast error: {last_exc!r}"
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


@dataclass
class Cluster:
    """A running local control plane, as the fixtures yield it."""

    kubeconfig: Path
    started: list[str] = field(default_factory=list)  # components this session started
    _api_client: Any = None

    @property
    def full(self) -> bool:
        """True when the e2e parts (controller manager, scheduler, kwok, ...) run."""
        return all(control_plane._pid(n) is not None for n in control_plane.FULL)

    # -- clients ------------------------------------------------------------------------
    @property
    def api_client(self):
        """kubernetes.client.ApiClient for this cluster (created on first use)."""
        if self._api_client is None:
            from kubernetes import config

            self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    @property
    def core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    @property
    def custom(self):
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client)

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocesses (e.g. the operator) that should use this cluster."""
        return {"KUBECONFIG": str(self.kubeconfig)}

    # -- kubectl ------------------------------------------------------------------------
    def kubectl(
        self,
        *args: str,
        input: str | None = None,  # noqa: A002
        check: bool = True,
        timeout: float | None = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl; returns CompletedProcess (text stdout/stderr).

        check=True raises AssertionError with stdout+stderr on a non-zero exit.
        """
        proc = control_plane.kubectl(*args, input=input, check=False, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
            )
        return proc

    def apply(
        self,
        objs: dict[str, Any] | str | Sequence[dict[str, Any]],
        namespace: str | None = None,
        *,
        server_side: bool = True,
        dry_run: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """kubectl apply a dict, a list of dicts, or YAML/JSON text."""
        if isinstance(objs, dict):
            text = json.dumps(objs)
        elif isinstance(objs, str):
            text = objs
        else:
            text = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)})
        args = ["apply", "-f", "-"]
        if server_side:
            args += ["--server-side", "--force-conflicts", "--field-manager=posttrain-tests"]
        if dry_run:
            args.append("--dry-run=server")
        if namespace:
            args += ["-n", namespace]
        return self.kubectl(*args, input=text)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """kubectl get -o json as a dict (raises AssertionError if absent)."""
        args = ["get", kind, name, "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        return json.loads(self.kubectl(*args).stdout)

    def describe(
        self, namespace: str | None = None, kinds: str = "jobsets,jobs,pods,events"
    ) -> str:
        """A dump for failure messages: `kubectl get <kinds> -o wide` (+ nodes)."""
        ns = ["-n", namespace] if namespace else ["-A"]
        out = self.kubectl("get", kinds, *ns, "-o", "wide", check=False).stdout
        nodes = self.kubectl("get", "nodes", "-o", "wide", check=False).stdout
        return f"{out}\n{nodes}"

    def wait_for(self, predicate: Callable[[], T], **kwargs: Any) -> T:
        return wait_for(predicate, **kwargs)

    # -- fake nodes ---------------------------------------------------------------------
    def create_nodes(
        self, nodes: Iterable[dict[str, Any]], *, wait_ready: bool = True
    ) -> list[str]:
        """Create fake (kwok-managed) nodes; wait until kwok marks them Ready."""
        nodes = list(nodes)
        self.apply(nodes)
        names = [n["metadata"]["name"] for n in nodes]
        if wait_ready and self.full:
            self.kubectl(
                "wait", "--for=condition=Ready", "--timeout=60s", *[f"node/{n}" for n in names]
            )
        return names

    def tpu_queue(
        self, namespace: str, name: str, *, topology: str = "2x4", chips: int = 8
    ) -> list[dict[str, Any]]:
        """A Kueue LocalQueue `name` in `namespace`, fed by a new ClusterQueue with quota
        for `chips` TPU v6e chips of one slice topology (a new ResourceFlavor). Returns the
        objects (ResourceFlavor, ClusterQueue, LocalQueue); remove them with delete_all."""
        kueue = "kueue.x-k8s.io/v1beta2"
        flavor, cq = unique_name(f"v6e-{topology}", 20), unique_name("tpu-cq", 20)
        labels = {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
            "cloud.google.com/gke-tpu-topology": topology,
        }
        quota = {"name": "google.com/tpu", "nominalQuota": chips}
        objects = [
            {
                "apiVersion": kueue,
                "kind": "ResourceFlavor",
                "metadata": {"name": flavor},
                "spec": {"nodeLabels": labels},
            },
            {
                "apiVersion": kueue,
                "kind": "ClusterQueue",
                "metadata": {"name": cq},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": ["google.com/tpu"],
                            "flavors": [{"name": flavor, "resources": [quota]}],
                        }
                    ],
                },
            },
            {
                "apiVersion": kueue,
                "kind": "LocalQueue",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"clusterQueue": cq},
            },
        ]
        self.apply(objects)
        return objects

    def delete_all(self, objects: Sequence[dict[str, Any]]) -> None:
        """Delete `objects` (newest first), ignoring those already gone; does not wait."""
        for obj in reversed(objects):
            namespace = obj["metadata"].get("namespace")
            self.kubectl(
                "delete", obj["kind"], obj["metadata"]["name"],
                *(["-n", namespace] if namespace else []),
                "--ignore-not-found", "--wait=false", check=False,
            )  # fmt: skip

    def create_tpu_slice(
        self,
        pool: str,
        *,
        accelerator: str = "tpu-v6e-slice",
        topology: str = "2x4",
        hosts: int = 2,
        chips: int = 4,
    ) -> list[str]:
        """One TPU slice node pool of `hosts` fake hosts (`{pool}-{i}`)."""
        return self.create_nodes(
            tpu_slice_nodes(
                pool, hosts=hosts, accelerator=accelerator, topology=topology, chips=chips
            )
        )

    def create_gpu_nodes(
        self, pool: str, *, count: int = 1, gpus: int = 8, accelerator: str = "nvidia-h100-80gb"
    ) -> list[str]:
        return self.create_nodes(
            [
                gpu_node(f"{pool}-{i}", pool, gpus=gpus, accelerator=accelerator)
                for i in range(count)
            ]
        )

    def create_cpu_nodes(self, pool: str, *, count: int = 1) -> list[str]:
        return self.create_nodes([cpu_node(f"{pool}-{i}", pool) for i in range(count)])

    def delete_nodes(self, names: Iterable[str]) -> None:
        names = list(names)
        if names:
            self.kubectl("delete", "node", *names, "--ignore-not-found", "--wait=false")

    # -- namespaces ---------------------------------------------------------------------
    def create_namespace(self, prefix: str = "t") -> str:
        name = unique_name(prefix)
        self.kubectl("create", "namespace", name)
        if control_plane._pid("kube-controller-manager") is not None:
            # The ServiceAccount admission plugin refuses pods until the controller
            # manager has made the namespace's `default` ServiceAccount.
            wait_for(
                lambda: (
                    self.kubectl(
                        "get", "serviceaccount", "default", "-n", name, check=False
                    ).returncode
                    == 0
                ),
                timeout=30,
                interval=0.2,
                what=f"serviceaccount default in {name}",
            )
        return name

    def ensure_namespace(self, name: str) -> None:
        """Create namespace `name` unless it exists (for the fixed names the guides use;
        never deleted: see delete_namespace)."""
        proc = self.kubectl("create", "namespace", name, check=False)
        assert proc.returncode == 0 or "AlreadyExists" in proc.stderr, proc.stderr

    def kubeconfig_in(self, namespace: str, path: Path) -> Path:
        """A copy of the admin kubeconfig whose default namespace is `namespace`."""
        import yaml

        config = yaml.safe_load(Path(self.kubeconfig).read_text())
        for context in config["contexts"]:
            context["context"]["namespace"] = namespace
        path.write_text(yaml.safe_dump(config))
        return path

    def delete_namespace(self, name: str) -> None:
        # Without the controller manager (integration tier) a namespace stays Terminating;
        # harmless, each test uses a new name.
        self.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false", check=False)

    # -- JobSets ------------------------------------------------------------------------
    def get_jobset(self, name: str, namespace: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name
        )


def unique_name(prefix: str = "t", max_len: int = 40) -> str:
    """DNS-1123 label `{prefix}-{random}` (prefix sanitised, length-capped)."""
    clean = "".join(c if c.isalnum() else "-" for c in prefix.lower()).strip("-") or "t"
    suffix = uuid.uuid4().hex[:6]
    return f"{clean[: max_len - len(suffix) - 1].rstrip('-')}-{suffix}"


def condition(obj: dict[str, Any], cond_type: str) -> dict[str, Any] | None:
    """The status condition of `cond_type`, if present."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == cond_type:
            return c
    return None


def has_condition(obj: dict[str, Any], cond_type: str, status: str = "True") -> bool:
    c = condition(obj, cond_type)
    return bool(c) and c.get("status") == status


def start(full: bool) -> Cluster:
    """Bring up (or reuse) the control plane for a test session.

    Fails (ControlPlaneError) with the build command when the binaries are missing:
    the integration and e2e tiers must not be skipped silently.
    """
    control_plane.ensure_built(full)
    control_plane.enter_session()
    try:
        # Reuses a running plane; re-applies CRDs when crds/ changed.
        started = control_plane.up(full=full, owner="pytest")
    except BaseException:
        control_plane.leave_session()
        raise
    return Cluster(kubeconfig=control_plane.KUBECONFIG, started=started)


def stop(cluster: Cluster | None = None) -> list[str]:
    """End this session's use; stops the pytest-started parts if no other session uses them."""
    if cluster is not None and cluster._api_client is not None:
        cluster._api_client.close()
    return control_plane.leave_session()
