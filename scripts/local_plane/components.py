"""Starting each component: etcd, kube-apiserver, controller-manager, scheduler, kwok, JobSet, Kueue."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from local_plane.build import module_dir
from local_plane.nodes import _kwok_stages
from local_plane.pki import CA, _write_private, serving_cert
from local_plane.processes import State, _http_ok, _pid, _start, _wait, apply_objects, kubectl
from local_plane.settings import (
    BIN_DIR,
    KUBECONFIG,
    KUEUE_VERSION,
    KWOK_NODE_ANNOTATION,
    KWOK_NODE_ANNOTATION_VALUE,
    KWOK_VERSION,
    PKI_DIR,
    POD_CIDR,
    RUN_DIR,
    SERVICE_CIDR,
    ControlPlaneError,
    log,
)
from local_plane.webhooks import _jobset_webhook_docs, register_url_webhooks

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


def _start_apiserver(state: State, extra: Sequence[str] = ()) -> None:
    """kube-apiserver; `extra` flags for a test (e.g. a low --max-requests-inflight)."""
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
            *extra,
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
