"""Run `posttrain operator` as a real process against the local control plane.

Tests start it, kill it (SIGKILL to test crash recovery), and read its logs and its
/metrics and /healthz endpoint. The webhook variant serves admission on 127.0.0.1 with a
self-signed certificate and registers itself with the API server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def trainer_images(image: str) -> dict[str, str]:
    """The operator's environment that gives every job without spec.image `image`,
    whatever its accelerator kind."""
    return {f"POSTTRAIN_TRAINER_IMAGE_{kind}": image for kind in ("CPU", "TPU", "GPU")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    def __init__(
        self,
        kubeconfig: Path,
        workdir: Path,
        lease_namespace: str,
        *extra: str,
        identity: str = "op",
    ):
        self.metrics_port = free_port()
        self.log_path = workdir / f"operator-{identity}-{self.metrics_port}.log"
        self.args = [
            sys.executable,
            "-m",
            "posttrain.cli",
            "operator",
            "--metrics-port",
            str(self.metrics_port),
            "--lease-namespace",
            lease_namespace,
            "--identity",
            identity,
            *extra,
        ]
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            **trainer_images("posttrain-trainer:test"),
        }
        self.proc: subprocess.Popen | None = None

    def start(self, wait_leader: bool = True) -> OperatorProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.logs()}")
            if self.healthy() and (not wait_leader or self.metric("posttrain_leader") == 1.0):
                return self
            time.sleep(0.3)
        raise AssertionError(f"operator did not become ready:\n{self.logs()}")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}{path}", timeout=3
            ) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def healthy(self) -> bool:
        return self.get("/healthz")[0] == 200

    def metric(self, name: str, labels: str = "") -> float | None:
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + (("{" + labels + "}") if labels else " ")):
                return float(line.rsplit(" ", 1)[1])
        return None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_log", None):
            self._log.close()


RBAC_KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def chart_env(namespace: str) -> dict[str, str]:
    """The operator's environment the chart sets that chart_identity(plane, namespace)
    needs: the trainer ClusterRole of that release."""
    # The chart's fullname: the release's name when it holds the chart's, as Helm's does.
    fullname = namespace if "posttrain" in namespace else f"{namespace}-posttrain"
    return {"POSTTRAIN_TRAINER_CLUSTER_ROLE": f"{fullname[:63].rstrip('-')}-trainer"}


def chart_identity(plane, namespace: str, path: Path) -> Path:
    """Install the Helm chart's ServiceAccount and RBAC (with the trainer ClusterRole and
    status policy) into `namespace` and write a kubeconfig that authenticates as that
    ServiceAccount: the identity the operator has when installed with the chart (run it
    with chart_env(namespace)). The release is named after the namespace, so the
    cluster-scoped objects are this caller's alone (remove them with
    drop_chart_identity)."""
    import json

    import yaml

    root = Path(__file__).resolve().parents[1]
    helm = root / ".cache" / "control-plane" / "bin" / "helm"
    rendered = subprocess.run(
        [
            str(helm),
            "template",
            namespace,
            str(root / "charts" / "posttrain"),
            "--namespace",
            namespace,
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "HELM_CACHE_HOME": "/tmp/posttrain-helm-cache"},
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in RBAC_KINDS]
    plane.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
    )
    (account,) = [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"]
    return token_kubeconfig(plane, namespace, account, path)


def drop_chart_identity(plane, namespace: str) -> None:
    """Delete the cluster-scoped RBAC chart_identity(plane, namespace, ...) made."""
    plane.kubectl(
        "delete",
        "clusterrole,clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding",
        "-l",
        f"app.kubernetes.io/instance={namespace}",
        "--ignore-not-found",
        check=False,
    )


def token_kubeconfig(
    plane, namespace: str, account: str, path: Path, pod: dict | None = None
) -> Path:
    """A kubeconfig for `plane` that authenticates with a token of ServiceAccount
    `namespace/account`; bound to `pod` (a Pod object) as the kubelet's are, when given:
    its user info then carries the pod's name."""
    import yaml

    bound = (
        [
            "--bound-object-kind=Pod",
            f"--bound-object-name={pod['metadata']['name']}",
            f"--bound-object-uid={pod['metadata']['uid']}",
        ]
        if pod
        else []
    )
    token = plane.kubectl(
        "create", "token", account, "-n", namespace, "--duration=2h", *bound
    ).stdout.strip()
    cluster = yaml.safe_load(Path(plane.kubeconfig).read_text())["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [
                    {"name": account, "context": {"cluster": cluster["name"], "user": account}}
                ],
                "current-context": account,
            }
        )
    )
    return path
