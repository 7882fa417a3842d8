"""Installing posttrain on a real kube-apiserver: Helm, Kustomize, RBAC, images.

- `helm template | kubectl apply --dry-run=server` and a real `helm install`/`upgrade`/
  `uninstall` of charts/posttrain;
- `kubectl kustomize manifests/overlays/{dev,production}` (+ the webhook component)
  through `kubectl apply --dry-run=server`;
- RBAC proven, not assumed: a `kubectl auth can-i --as=<operator ServiceAccount>` matrix,
  the objects the renderer makes created while impersonating that ServiceAccount, and the
  operator itself run with that ServiceAccount's token;
- the operator image's pip commands replayed in a fresh venv (no container engine here).

The API server runs with `--authorization-mode=Node,RBAC`, so can-i answers are real.
Everything cluster-scoped a test creates is named after a unique release and removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from invalid_jobs import valid_job
from operator_process import OperatorProcess, token_kubeconfig
from trainer_access import impersonating, patch_status

import tests.unit.test_dockerfiles as dockerfiles
from tests.cluster import Cluster, control_plane, unique_name, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "posttrain"
MANIFESTS = ROOT / "manifests"
HELM = control_plane.BIN_DIR / "helm"
LEASE = "posttrain-operator"
GROUP, VERSION, PLURAL = "posttrain.dev", "v1alpha1", "posttrainjobs"
CERT_MANAGER_KINDS = {"Certificate", "Issuer", "ClusterIssuer"}


def helm(apiserver: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if not HELM.is_file():
        pytest.fail(
            f"helm is missing: run `python scripts/control_plane.py build helm` ({HELM})",
            pytrace=False,
        )
    proc = subprocess.run(
        [str(HELM), f"--kubeconfig={apiserver.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "HELM_CACHE_HOME": "/tmp/posttrain-helm-cache"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def dump(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


# -- helm template / kubectl kustomize through the API server's validation --------------


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"webhook": {"enabled": True}},
        {"replicaCount": 1, "defaults": {"queue": "team-a"}, "logLevel": "DEBUG"},
    ],
    ids=["defaults", "webhook", "single"],
)
def test_helm_template_server_dry_run(
    apiserver: Cluster, namespace: str, values: dict[str, Any], tmp_path: Path
) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    release = unique_name("dry", 20)
    out = helm(
        apiserver,
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--include-crds",
        "-f",
        str(values_file),
    ).stdout
    kinds = {d["kind"] for d in docs_of(out)}
    assert {"CustomResourceDefinition", "ClusterRole", "Deployment"} <= kinds
    proc = apiserver.kubectl("apply", "--dry-run=server", "-f", "-", input=out)
    assert "(server dry run)" in proc.stdout


def kustomize(apiserver: Cluster, path: Path) -> list[dict[str, Any]]:
    return docs_of(apiserver.kubectl("kustomize", str(path)).stdout)


def server_dry_run(apiserver: Cluster, docs: list[dict[str, Any]]) -> str:
    apiserver.ensure_namespace("posttrain-system")  # a dry run creates no namespace
    return apiserver.kubectl("apply", "--dry-run=server", "-f", "-", input=dump(docs)).stdout


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_kustomize_dev_overlay(apiserver: Cluster) -> None:
    docs = kustomize(apiserver, MANIFESTS / "overlays" / "dev")
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["metadata"]["namespace"] == "posttrain-system"
    assert deploy["spec"]["replicas"] == 1
    env = {
        e["name"]: e.get("value")
        for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["POSTTRAIN_LOG_LEVEL"] == "DEBUG"
    assert not by_kind(docs, "PodDisruptionBudget")
    assert "(server dry run)" in server_dry_run(apiserver, docs)


def test_kustomize_production_overlay(apiserver: Cluster) -> None:
    docs = kustomize(apiserver, MANIFESTS / "overlays" / "production")
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["metadata"]["namespace"] == "posttrain-system"
    (crd,) = by_kind(docs, "CustomResourceDefinition")
    assert "Prune=false" in crd["metadata"]["annotations"]["argocd.argoproj.io/sync-options"]
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "posttrain"
    assert "(server dry run)" in server_dry_run(apiserver, docs)


def test_kustomize_production_with_webhook_component(apiserver: Cluster, tmp_path: Path) -> None:
    """The production overlay plus components/webhook, as the overlay's comment says."""
    tree = tmp_path / "manifests"  # kustomize takes no absolute paths: use a copy
    shutil.copytree(MANIFESTS, tree)
    overlay = tree / "overlays" / "production-webhook"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["../production"],
                "components": ["../../components/webhook"],
            }
        )
    )
    docs = kustomize(apiserver, overlay)
    (deploy,) = by_kind(docs, "Deployment")
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][-6:-4] == ["--webhook-port", "9443"]
    (vwc,) = by_kind(docs, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        "posttrain-system/posttrain-webhook"
    )
    assert {d["kind"] for d in docs} >= {"Certificate", "Issuer", "Service"}
    # cert-manager's CRDs are not on this API server: its objects are checked above only.
    rest = [d for d in docs if d["kind"] not in CERT_MANAGER_KINDS]
    assert "(server dry run)" in server_dry_run(apiserver, rest)


@pytest.mark.parametrize("path", ["tpu-v6e.yaml", "gpu-h100.yaml"])
def test_kueue_examples_server_dry_run(apiserver: Cluster, namespace: str, path: str) -> None:
    """manifests/kueue/*.yaml against the real Kueue CRDs (LocalQueue moved to a test
    namespace)."""
    docs = docs_of((MANIFESTS / "kueue" / path).read_text())
    for d in docs:
        if d["kind"] == "LocalQueue":
            d["metadata"]["namespace"] = namespace
    out = apiserver.kubectl("apply", "--dry-run=server", "-f", "-", input=dump(docs)).stdout
    assert out.count("(server dry run)") == len(docs), out


# -- helm install, upgrade, uninstall -----------------------------------------------------


@dataclass
class Release:
    name: str
    namespace: str  # the release namespace (the Lease lives here)
    other: str  # another namespace, where jobs run
    serviceaccount: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.serviceaccount}"


@pytest.fixture(scope="module")
def release(apiserver: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    """A real `helm install` with the webhook on. The webhook is scoped to the release's
    namespace and set to Ignore, so it never blocks other tests on this API server (no
    operator pod runs here: there are no nodes in this tier)."""
    ns = apiserver.create_namespace("install")
    other = apiserver.create_namespace("jobs")
    name = unique_name("pt", 20)
    values = tmp_path_factory.mktemp("helm") / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "webhook": {
                    "enabled": True,
                    "failurePolicy": "Ignore",
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                }
            }
        )
    )
    try:
        out = helm(
            apiserver, "install", name, str(CHART), "--namespace", ns, "-f", str(values)
        ).stdout
        assert "STATUS: deployed" in out
        assert f"rollout status deployment/{name}-posttrain" in out  # NOTES.txt
        yield Release(name, ns, other, f"{name}-posttrain")
    finally:
        helm(apiserver, "uninstall", name, "--namespace", ns, "--wait", check=False)
        apiserver.delete_namespace(ns)
        apiserver.delete_namespace(other)


def test_helm_install_creates_the_objects(apiserver: Cluster, release: Release) -> None:
    full = f"{release.name}-posttrain"
    ns = release.namespace
    for kind, name in [
        ("serviceaccount", full),
        ("deployment", full),
        ("service", f"{full}-metrics"),
        ("service", f"{full}-webhook"),
        ("secret", f"{full}-webhook-tls"),
        ("role", f"{full}-leader-election"),
        ("rolebinding", f"{full}-leader-election"),
        ("poddisruptionbudget", full),
    ]:
        apiserver.get(kind, name, ns)
    for kind in ("clusterrole", "clusterrolebinding", "validatingwebhookconfiguration"):
        apiserver.get(kind, full)
    apiserver.get("clusterrole", f"{full}-trainer")
    for kind in ("validatingadmissionpolicy", "validatingadmissionpolicybinding"):
        apiserver.get(kind, f"{full}-trainer-status")
    deploy = apiserver.get("deployment", full, ns)
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:5] == ["operator", "--metrics-port", "8080", "--lease-namespace", ns]
    crd = apiserver.get("crd", "posttrainjobs.posttrain.dev")
    assert crd["spec"]["names"]["shortNames"] == ["ptj"]
    listed = helm(apiserver, "list", "--namespace", ns, "-o", "json").stdout
    assert [r["status"] for r in json.loads(listed)] == ["deployed"]


def test_helm_upgrade_keeps_the_webhook_certificate(apiserver: Cluster, release: Release) -> None:
    full = f"{release.name}-posttrain"
    before = apiserver.get("secret", f"{full}-webhook-tls", release.namespace)["data"]
    helm(
        apiserver,
        "upgrade",
        release.name,
        str(CHART),
        "--namespace",
        release.namespace,
        "--reuse-values",
        "--set",
        "logLevel=DEBUG",
    )
    after = apiserver.get("secret", f"{full}-webhook-tls", release.namespace)["data"]
    assert after == before, "helm upgrade must reuse the webhook certificate (lookup)"
    vwc = apiserver.get("validatingwebhookconfiguration", full)
    (hook,) = vwc["webhooks"]
    assert hook["clientConfig"]["caBundle"] == after["ca.crt"]
    assert hook["clientConfig"]["service"]["path"] == "/validate-posttrainjob.posttrain.dev"
    env = apiserver.get("deployment", full, release.namespace)["spec"]["template"]["spec"][
        "containers"
    ][0]["env"]
    assert {"name": "POSTTRAIN_LOG_LEVEL", "value": "DEBUG"} in env


# -- RBAC: kubectl auth can-i as the operator's ServiceAccount ------------------------------

# (verb, resource, namespace: "release" | "other" | "-" for cluster scope)
ALLOWED = [
    ("create", "jobsets.jobset.x-k8s.io", "other"),
    ("patch", "jobsets.jobset.x-k8s.io", "other"),
    ("watch", "jobsets.jobset.x-k8s.io", "-"),
    ("list", "posttrainjobs.posttrain.dev", "-"),
    ("watch", "posttrainjobs.posttrain.dev", "-"),
    ("patch", "posttrainjobs.posttrain.dev/status", "other"),
    ("update", "posttrainjobs.posttrain.dev/finalizers", "other"),
    ("create", "rolebindings.rbac.authorization.k8s.io", "other"),
    ("get", "rolebindings.rbac.authorization.k8s.io", "other"),
    ("create", "serviceaccounts", "other"),
    ("get", "serviceaccounts", "other"),
    ("create", "events", "other"),
    ("patch", "events", "other"),
    ("create", "events.events.k8s.io", "other"),
    ("list", "events", "-"),  # the JobSet controller's JobCreationFailed, field selected
    ("watch", "events", "-"),
    ("list", "events.events.k8s.io", "-"),  # the Job controller's FailedCreate
    ("watch", "events.events.k8s.io", "-"),
    ("create", "leases.coordination.k8s.io", "release"),
    ("get", f"leases.coordination.k8s.io/{LEASE}", "release"),
    ("update", f"leases.coordination.k8s.io/{LEASE}", "release"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io", "-"),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", "-"),
    ("list", "namespaces", "-"),
    ("watch", "namespaces", "-"),
    ("get", "priorityclasses.scheduling.k8s.io/high", "-"),
    ("get", "workloadpriorityclasses.kueue.x-k8s.io/high", "-"),
    ("list", "priorityclasses.scheduling.k8s.io", "-"),
    ("watch", "priorityclasses.scheduling.k8s.io", "-"),
    ("list", "workloadpriorityclasses.kueue.x-k8s.io", "-"),
    ("watch", "workloadpriorityclasses.kueue.x-k8s.io", "-"),
    ("get", "localqueues.kueue.x-k8s.io/tpu", "other"),
    ("list", "pods", "-"),
    ("watch", "pods", "-"),
    ("list", "jobs.batch", "-"),
    ("watch", "jobs.batch", "-"),
    ("patch", "jobs.batch", "other"),  # a job whose trainer stopped reporting: end its Jobs
    ("create", "jobs.batch", "other"),  # a TPU job's preflight Job
    ("get", "configmaps", "other"),  # the preflight's answers, posttrain-preflight
    ("create", "configmaps", "other"),
    ("patch", "configmaps", "other"),
    ("create", "networkpolicies.networking.k8s.io", "other"),  # spec.network.restrictEgress
    ("get", "networkpolicies.networking.k8s.io", "other"),
    ("list", "workloads.kueue.x-k8s.io", "-"),
    ("watch", "workloads.kueue.x-k8s.io", "-"),
    ("patch", "workloads.kueue.x-k8s.io", "other"),
    ("list", "clusterqueues.kueue.x-k8s.io", "-"),
    ("watch", "clusterqueues.kueue.x-k8s.io", "-"),
    ("get", "localqueues.visibility.kueue.x-k8s.io/pendingworkloads", "other"),
]
DENIED = [
    ("create", "priorityclasses.scheduling.k8s.io", "-"),
    ("delete", "priorityclasses.scheduling.k8s.io", "-"),
    ("create", "localqueues.kueue.x-k8s.io", "other"),
    ("list", "localqueues.kueue.x-k8s.io", "-"),
    ("patch", "workloadpriorityclasses.kueue.x-k8s.io", "-"),
    ("get", "secrets", "release"),
    ("get", "secrets", "other"),
    ("list", "secrets", "-"),
    ("watch", "secrets", "-"),
    ("create", "pods/exec", "other"),
    ("get", "pods/exec", "other"),
    ("create", "pods", "other"),
    ("patch", "pods", "other"),
    ("delete", "pods", "other"),
    ("delete", "jobs.batch", "other"),
    ("update", "jobs.batch/status", "other"),
    ("update", "pods/status", "other"),
    ("delete", "workloads.kueue.x-k8s.io", "other"),
    ("update", "workloads.kueue.x-k8s.io/status", "other"),
    ("patch", "clusterqueues.kueue.x-k8s.io", "-"),
    ("get", "clusterqueues.visibility.kueue.x-k8s.io/pendingworkloads", "-"),
    ("get", "pods/log", "other"),
    ("delete", "namespaces", "-"),
    ("create", "namespaces", "-"),
    ("update", f"leases.coordination.k8s.io/{LEASE}", "other"),
    ("create", "leases.coordination.k8s.io", "other"),
    ("update", "leases.coordination.k8s.io/someone-elses-lease", "release"),
    ("delete", f"leases.coordination.k8s.io/{LEASE}", "release"),
    ("create", "clusterroles.rbac.authorization.k8s.io", "-"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", "-"),
    ("escalate", "roles.rbac.authorization.k8s.io", "other"),
    ("bind", "roles.rbac.authorization.k8s.io", "other"),
    ("impersonate", "serviceaccounts", "other"),
    ("delete", "jobsets.jobset.x-k8s.io", "other"),
    ("delete", "posttrainjobs.posttrain.dev", "other"),
    ("update", "posttrainjobs.posttrain.dev/status", "other"),
    ("patch", "posttrainjobs.posttrain.dev", "other"),
    ("get", "posttrainjobs.posttrain.dev/status", "other"),
    ("create", "roles.rbac.authorization.k8s.io", "other"),
    ("delete", "configmaps", "other"),
    ("list", "configmaps", "-"),
    ("delete", "networkpolicies.networking.k8s.io", "other"),
    ("patch", "networkpolicies.networking.k8s.io", "other"),
    ("update", "serviceaccounts", "other"),
    ("create", "serviceaccounts/token", "other"),
    ("update", "rolebindings.rbac.authorization.k8s.io", "other"),
    ("create", "validatingwebhookconfigurations.admissionregistration.k8s.io", "-"),
    ("patch", "validatingwebhookconfigurations.admissionregistration.k8s.io", "-"),
    ("update", "customresourcedefinitions.apiextensions.k8s.io", "-"),
]


SUBRESOURCES = ("status", "finalizers", "exec", "log", "pendingworkloads", "token")


def can_i(apiserver: Cluster, release: Release, verb: str, resource: str, where: str) -> bool:
    """What `kubectl auth can-i --as=<operator>` asks, as a SelfSubjectAccessReview with
    the group, resource and subresource spelled out: kubectl would look the resource up
    in discovery first, and an aggregated API that is not served here (Kueue's
    visibility API in the integration tier) would turn into a question about nothing."""
    kind, _, rest = resource.partition("/")
    plural, _, group = kind.partition(".")
    attributes = {"verb": verb, "resource": plural, "group": group}
    if rest in SUBRESOURCES:
        attributes["subresource"] = rest
    elif rest:
        attributes["name"] = rest
    if where != "-":
        attributes["namespace"] = release.namespace if where == "release" else release.other
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attributes},
    }
    proc = apiserver.kubectl(
        "create", "-f", "-", "-o", "json", f"--as={release.user}", input=json.dumps(review)
    )
    return json.loads(proc.stdout)["status"]["allowed"]


def test_rbac_matrix(apiserver: Cluster, release: Release) -> None:
    wrong = [
        f"cannot {v} {r} ({w})" for v, r, w in ALLOWED if not can_i(apiserver, release, v, r, w)
    ]
    wrong += [f"CAN {v} {r} ({w})" for v, r, w in DENIED if can_i(apiserver, release, v, r, w)]
    assert not wrong, "operator RBAC:\n" + "\n".join(wrong)


def test_can_i_matrix_is_meaningful(apiserver: Cluster, release: Release) -> None:
    """RBAC is on: a ServiceAccount with no bindings may do nothing, the admin everything."""
    nobody = f"system:serviceaccount:{release.other}:default"
    proc = apiserver.kubectl(
        "auth",
        "can-i",
        "create",
        "jobsets.jobset.x-k8s.io",
        f"--as={nobody}",
        "-n",
        release.other,
        check=False,
    )
    assert proc.stdout.strip() == "no"
    assert apiserver.kubectl("auth", "can-i", "get", "secrets", "-A").stdout.strip() == "yes"


def _render_for(job: dict[str, Any]) -> list[dict[str, Any]]:
    from posttrain.checks import validate
    from posttrain.render import render

    parsed, errors = validate(job)
    assert parsed is not None and not errors, errors
    return render(parsed)


def test_operator_creates_what_it_renders_as_its_serviceaccount(
    apiserver: Cluster, release: Release
) -> None:
    """Impersonating the operator: create a namespace's trainer ServiceAccount and its
    RoleBinding to the release's trainer ClusterRole (posttrainjobs/status patch: the
    escalation check passes because the operator holds it), a real job's JobSet, patch the
    job's status, take the Lease. Then what it must not do."""
    from posttrain.render.objects import trainer_access

    ns = release.other
    job = apiserver.custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, valid_job("rbac-proof")
    )
    as_op = f"--as={release.user}"
    access = trainer_access(ns, f"{release.name}-posttrain-trainer")
    objs = access + _render_for(job)
    assert [o["kind"] for o in objs] == ["ServiceAccount", "RoleBinding", "JobSet"]
    for obj in objs:
        apiserver.kubectl("create", "-n", ns, as_op, "-f", "-", input=json.dumps(obj))
    # A PATCH as the operator sends it (kubectl patch would GET the status first, which
    # the operator neither needs nor may).
    status = {"status": {"phase": "Pending", "message": "created by the operator's SA"}}
    as_operator = impersonating(release.user, None)
    assert patch_status(apiserver.api_client, ns, "rbac-proof", status, as_operator)[0] == 200
    assert apiserver.get("ptj", "rbac-proof", ns)["status"]["phase"] == "Pending"
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": LEASE, "namespace": release.namespace},
        "spec": {"holderIdentity": "rbac-test", "leaseDurationSeconds": 15},
    }
    apiserver.kubectl("create", as_op, "-f", "-", input=json.dumps(lease))
    held = apiserver.get("lease", LEASE, release.namespace)
    held["spec"]["holderIdentity"] = "rbac-test-2"
    apiserver.kubectl("replace", as_op, "-f", "-", input=json.dumps(held))  # update
    apiserver.kubectl("delete", "lease", LEASE, "-n", release.namespace)  # as admin

    # The escalation check bites: a RoleBinding to a role granting what the operator
    # lacks (here cluster-admin's everything) is refused, so it can only ever hand out
    # the trainer's role.
    greedy = trainer_access(ns, "cluster-admin")[1]
    greedy["metadata"]["name"] = "greedy"
    proc = apiserver.kubectl("create", as_op, "-f", "-", input=json.dumps(greedy), check=False)
    assert proc.returncode != 0 and "forbidden" in proc.stderr.lower(), proc.stderr
    proc = apiserver.kubectl("get", "secrets", "-n", ns, as_op, check=False)
    assert proc.returncode != 0 and "forbidden" in proc.stderr.lower(), proc.stderr


def test_operator_runs_under_the_chart_rbac(
    apiserver: Cluster, release: Release, tmp_path: Path
) -> None:
    """`posttrain operator` with the chart's ServiceAccount token: it takes the Lease in
    the release namespace, creates a job's objects, writes status and events, and logs no
    Forbidden. (Watching one namespace, so it never touches other tests' jobs.)"""
    kubeconfig = token_kubeconfig(
        apiserver, release.namespace, release.serviceaccount, tmp_path / "operator.kubeconfig"
    )
    whoami = subprocess.run(
        [str(control_plane.BIN_DIR / "kubectl"), f"--kubeconfig={kubeconfig}", "auth", "whoami"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert release.user in whoami.stdout, whoami.stdout + whoami.stderr
    ns = release.other
    apiserver.custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, valid_job("under-rbac")
    )
    op = OperatorProcess(kubeconfig, tmp_path, release.namespace, "-n", ns, identity="rbac")
    op.env["POSTTRAIN_TRAINER_CLUSTER_ROLE"] = f"{release.name}-posttrain-trainer"
    op.start()
    try:

        def done() -> bool:
            job = apiserver.get("ptj", "under-rbac", ns)
            jobsets = apiserver.kubectl("get", "jobsets", "-n", ns, "-o", "name").stdout
            return bool((job.get("status") or {}).get("phase")) and "under-rbac" in jobsets

        wait_for(
            done, timeout=90, what="the operator to reconcile under its RBAC", describe=op.logs
        )
        lease = apiserver.get("lease", LEASE, release.namespace)
        assert lease["spec"]["holderIdentity"] == "rbac"
        binding = apiserver.get("rolebinding", "posttrain-trainer", ns)
        assert binding["roleRef"]["name"] == f"{release.name}-posttrain-trainer"
        apiserver.get("serviceaccount", "posttrain-trainer", ns)
        events = apiserver.kubectl(
            "get", "events", "-n", ns, "--field-selector=involvedObject.name=under-rbac",
            "-o", "jsonpath={.items[*].reason}",
        ).stdout  # fmt: skip
        assert "Pending" in events, events
    finally:
        op.stop()
    logs = op.logs()
    for word in ("Forbidden", "forbidden", " 403"):
        assert word not in logs, f"{word!r} in the operator log:\n{logs}"


# -- the operator image's pip commands in a fresh venv ---------------------------------------


def replay_build_stage(dockerfile: Path, workdir: Path) -> Path:
    """Run the `build` stage's COPY/WORKDIR/ENV/RUN in a scratch dir, with /opt/venv and
    /src mapped into it; return the venv. Only venv and pip commands may appear there."""
    df = dockerfiles.parse_dockerfile(dockerfile)
    venv, src = workdir / "venv", workdir / "src"
    mapping = {"/opt/venv": str(venv), "/src": str(src)}

    def mapped(path: str) -> Path:
        for a, b in mapping.items():
            if path == a or path.startswith(a + "/"):
                return Path(b + path[len(a) :])
        return cwd / path

    env = {**os.environ, **{k: v for k, v in df.global_args.items()}}
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    no_cache = "PIP_NO_CACHE_DIR"  # the image keeps no pip cache; a test rerun may use one
    cwd = workdir
    for ins in df.stage("build").instructions:
        if ins.cmd == "ARG":
            key, _, default = ins.value.partition("=")
            env[key] = default
        elif ins.cmd == "ENV":
            for pair in ins.value.split():
                key, _, value = pair.partition("=")
                if key != no_cache:
                    env[key] = value
        elif ins.cmd == "WORKDIR":
            cwd = mapped(ins.value)
            cwd.mkdir(parents=True, exist_ok=True)
        elif ins.cmd == "COPY":
            sources, dest = dockerfiles.copy_sources_of(ins)
            target = mapped(dest)
            for s in sources:
                origin = ROOT / s
                if origin.is_dir():
                    shutil.copytree(
                        origin,
                        target,
                        dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                    )
                else:
                    dst = target / origin.name if dest.endswith("/") or dest == "./" else target
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, dst)
        elif ins.cmd == "RUN":
            command = ins.value
            for a, b in mapping.items():
                command = command.replace(a, b)
            command = command.replace("python -m venv", f"{sys.executable} -m venv")
            for segment in command.split("&&"):
                first = segment.split()[0]
                assert first in (sys.executable, f"{venv}/bin/pip", f"{venv}/bin/python"), (
                    f"unexpected command in the build stage: {segment}"
                )
            proc = subprocess.run(
                ["sh", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
            )
            assert proc.returncode == 0, (
                f"RUN {ins.value}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
            )
        else:
            raise AssertionError(f"unexpected {ins.cmd} in the build stage")
    return venv


def test_operator_image_pip_install_in_a_fresh_venv(tmp_path: Path) -> None:
    """Dockerfile.operator's pip commands: posttrain.controller.main imports, JAX does not,
    and the venv holds exactly the pinned packages."""
    venv = replay_build_stage(ROOT / "Dockerfile.operator", tmp_path)
    python = venv / "bin" / "python"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )

    ok = run("-c", "import posttrain.controller.main, kopf, kubernetes; print('ok')")
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr
    no_jax = run("-c", "import jax")
    assert no_jax.returncode != 0 and "ModuleNotFoundError" in no_jax.stderr, no_jax.stderr
    freeze = run(
        "-m", "pip", "freeze", "--all", "--exclude", "posttrain", "--exclude", "setuptools"
    )
    assert freeze.returncode == 0, freeze.stderr
    from packaging.utils import canonicalize_name

    installed = {
        canonicalize_name(line.split("==")[0]): line.split("==")[1]
        for line in freeze.stdout.splitlines()
        if "==" in line
    }
    pins = dockerfiles.read_constraints(ROOT / "docker" / "constraints-operator.txt")
    assert installed == pins, "the operator venv differs from docker/constraints-operator.txt"
    # The entrypoint wrapper runs the venv's CLI (not PID 1 here, so no tini).
    proc = subprocess.run(
        ["sh", str(ROOT / "docker" / "entrypoint.sh"), "operator", "--help"],
        env={**os.environ, "POSTTRAIN_BIN": str(venv / "bin" / "posttrain")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--lease-namespace" in proc.stdout, proc.stderr


def _pip_resolve(install_args: list[str], cwd: Path, report: Path) -> dict[str, str]:
    """What `pip install <install_args>` would install (pip --dry-run): name -> version."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), *install_args],
        cwd=cwd, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    from packaging.utils import canonicalize_name

    return {
        canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }


def test_trainer_constraints_resolve_to_themselves(tmp_path: Path) -> None:
    """Dockerfile.trainer's `pip install -c docker/constraints-trainer.txt
    '.[trainer,mlflow,wandb]'` (the trainer and spec.tracking's clients),
    resolved without installing (pip --dry-run): it needs exactly the pinned set, so the
    image gets no unpinned package. (Installing JAX & co. here would take many minutes.)"""
    df = dockerfiles.parse_dockerfile(ROOT / "Dockerfile.trainer")
    src = tmp_path / "src"
    for ins in df.stage("build").instructions:
        if ins.cmd == "COPY":
            sources, dest = dockerfiles.copy_sources_of(ins)
            for s in sources:
                origin, target = ROOT / s, src / dest
                if origin.is_dir():
                    shutil.copytree(
                        origin, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
                    )
                else:
                    dst = target / origin.name if dest.endswith("/") else target
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, dst)
    installs = dockerfiles.pip_installs(df.stage("build"))
    (final,) = [i for i in installs if i.requirements and i.requirements[0].startswith(".")]
    assert final.requirements == [".[trainer,mlflow,wandb]"], final.argv
    resolved = _pip_resolve(final.argv[2:], src, tmp_path / "report.json")
    resolved.pop("posttrain")
    pins = dockerfiles.read_constraints(ROOT / "docker" / "constraints-trainer.txt")
    pins.pop("pip")
    assert resolved == pins, "docker/constraints-trainer.txt is not the resolved set"


@pytest.mark.parametrize("accelerator", sorted(dockerfiles.TRAINER_ACCELERATORS))
def test_trainer_accelerator_pins_resolve_to_themselves(tmp_path: Path, accelerator: str) -> None:
    """Dockerfile.trainer's `pip install -c ... 'jax[<ACCELERATOR>]'` for the TPU and CUDA
    images, resolved without installing: it adds exactly the accelerator's pins."""
    df = dockerfiles.parse_dockerfile(ROOT / "Dockerfile.trainer")
    (inst,) = [
        i for i in dockerfiles.pip_installs(df.stage("build")) if "jax[$ACCELERATOR]" in i.argv
    ]
    argv = [a.replace("$ACCELERATOR", accelerator) for a in inst.argv[2:]]
    resolved = _pip_resolve(argv, ROOT, tmp_path / "report.json")
    base = dockerfiles.read_constraints(ROOT / "docker" / "constraints-trainer.txt")
    extra = dockerfiles.read_constraints(ROOT / "docker" / f"constraints-trainer-{accelerator}.txt")
    added = {n: v for n, v in resolved.items() if n not in base}
    assert added == extra, f"docker/constraints-trainer-{accelerator}.txt is not what it adds"
    assert all(base[n] == v for n, v in resolved.items() if n in base)
