"""The Helm chart (charts/posttrain) and the Kustomize manifests agree with the operator.

`helm lint` and `helm template` run with the pinned helm from
`python scripts/control_plane.py build helm` (.cache/control-plane/bin/helm); the test
FAILS with that command when it is missing. Nothing here talks to a cluster: the
server-side checks and the RBAC matrix are in tests/integration/test_install.py.
"""

from __future__ import annotations

import base64
import copy
import datetime
import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "posttrain"
MANIFESTS = ROOT / "manifests"
CRD = ROOT / "crds" / "posttrain.dev_posttrainjobs.yaml"
HELM = ROOT / ".cache" / "control-plane" / "bin" / "helm"
BUILD_HELM = "python scripts/control_plane.py build helm"
NS = "posttrain-system"
LEASE = "posttrain-operator"
WEBHOOK_PATH = "/validate-posttrainjob.posttrain.dev"
CLUSTER_SCOPED = {
    "Namespace",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
HELM_ONLY_LABELS = (
    "helm.sh/chart",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
)

# What the operator touches, and nothing else: (apiGroup, resource) -> verbs.
EXPECTED_CLUSTER_RULES = {
    ("posttrain.dev", "posttrainjobs"): {"get", "list", "watch"},
    ("posttrain.dev", "posttrainjobs/status"): {"patch"},
    ("posttrain.dev", "posttrainjobs/finalizers"): {"update"},
    ("jobset.x-k8s.io", "jobsets"): {"get", "list", "watch", "create", "patch"},
    ("", "serviceaccounts"): {"create", "get"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"create", "get"},
    ("", "events"): {"create", "patch", "list", "watch"},
    ("events.k8s.io", "events"): {"create", "patch", "list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "namespaces"): {"get", "list", "watch"},
    ("scheduling.k8s.io", "priorityclasses"): {"get", "list", "watch"},
    ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get", "list", "watch"},
    ("kueue.x-k8s.io", "localqueues"): {"get"},
    ("", "pods"): {"list", "watch"},
    # patch: progressDeadlineSeconds ends its Jobs; create: the preflight Job
    ("batch", "jobs"): {"list", "watch", "patch", "create"},
    ("", "configmaps"): {"get", "create", "patch"},  # the preflight's cache
    ("networking.k8s.io", "networkpolicies"): {"get", "create"},  # spec.network
    ("kueue.x-k8s.io", "workloads"): {"list", "watch", "patch"},
    ("kueue.x-k8s.io", "clusterqueues"): {"list", "watch"},
    ("visibility.kueue.x-k8s.io", "localqueues/pendingworkloads"): {"get"},
}


# -- helpers ---------------------------------------------------------------------------


def helm_binary() -> Path:
    if not HELM.is_file():
        pytest.fail(f"helm is missing: run `{BUILD_HELM}` (builds {HELM})", pytrace=False)
    return HELM


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc


def set_args(values: dict[str, Any]) -> list[str]:
    out = []
    for key, value in values.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        out += ["--set", f"{key}={value}"]
    return out


@functools.cache
def _template(release: str, namespace: str, frozen: tuple[tuple[str, Any], ...]) -> str:
    return helm(
        "template", release, str(CHART), "--namespace", namespace, *set_args(dict(frozen))
    ).stdout


def template(
    values: dict[str, Any] | None = None, *, release: str = "posttrain", namespace: str = NS
) -> list[dict[str, Any]]:
    """`helm template` as a list of objects (a fresh deep copy per call)."""
    text = _template(release, namespace, tuple(sorted((values or {}).items())))
    return [d for d in yaml.safe_load_all(text) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, got {len(hits)}"
    return hits[0]


def kinds(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def rule_set(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for r in rules:
        for group in r.get("apiGroups", []):
            for res in r.get("resources", []):
                out.setdefault((group, res), set()).update(r["verbs"])
    return out


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["operator"]
    return pod["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def strip_helm(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    labels = obj["metadata"].get("labels", {})
    for key in HELM_ONLY_LABELS:
        labels.pop(key, None)
    return obj


def kustomize_base() -> list[dict[str, Any]]:
    """manifests/base as kustomize builds it, for the fields this chart cares about:
    resources in order, `namespace` set on namespaced objects. (The real `kubectl
    kustomize` build runs in tests/integration/test_install.py.)"""
    kust = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    docs = []
    for res in kust["resources"]:
        for d in load_yaml_docs(MANIFESTS / "base" / res):
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = kust["namespace"]
            docs.append(d)
    return docs


def json_patch_add(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply the `add` ops of a JSON6902 patch (all the webhook component uses)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = op["path"].lstrip("/").split("/")
        target: Any = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if last == "-":
            target.append(op["value"])
        elif isinstance(target, list):
            target.insert(int(last), op["value"])
        else:
            target[last] = op["value"]
    return doc


# -- the CRD copies --------------------------------------------------------------------


@pytest.mark.parametrize(
    "copy_path",
    [CHART / "crds" / CRD.name, MANIFESTS / "base" / CRD.name],
    ids=["chart", "kustomize-base"],
)
def test_crd_copy_equals_generated_crd(copy_path: Path) -> None:
    assert copy_path.read_bytes() == CRD.read_bytes(), (
        f"{copy_path.relative_to(ROOT)} is stale: cp {CRD.relative_to(ROOT)} "
        f"{copy_path.parent.relative_to(ROOT)}/"
    )


def test_chart_crds_folder_holds_only_the_crd() -> None:
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == [CRD.name]


# -- lint and schema -------------------------------------------------------------------

VALUE_SETS = {
    "defaults": {},
    "webhook": {"webhook.enabled": True},
    "webhook-cert-manager": {"webhook.enabled": True, "webhook.certManager.enabled": True},
    "everything": {
        "webhook.enabled": True,
        "webhook.certManager.enabled": True,
        "webhook.certManager.issuerRef.name": "ca",
        "webhook.certManager.issuerRef.kind": "ClusterIssuer",
        "metrics.serviceMonitor.enabled": True,
        "metrics.dashboard.enabled": True,
        "metrics.prometheusRule.enabled": True,
        "replicaCount": 1,
        "defaults.queue": "team-a",
        "image.digest": "sha256:" + "a" * 64,
    },
}


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_is_clean(values: dict[str, Any]) -> None:
    proc = helm("lint", "--strict", str(CHART), *set_args(values))
    out = proc.stdout + proc.stderr
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


@pytest.mark.parametrize(
    "values",
    [
        {"webhook.failurePolicy": "Maybe"},
        {"logLevel": "LOUD"},
        {"replicaCount": -1},
        {"noSuchValue": 1},
        {"image.digest": "latest"},
        {"defaults.queue": "Not_A_Queue"},
        {"webhook.timeoutSeconds": 31},
    ],
    ids=lambda v: next(iter(v)),
)
def test_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    proc = helm("template", "x", str(CHART), *set_args(values), check=False)
    assert proc.returncode != 0, f"accepted {values}"
    assert "schema" in proc.stderr.lower() or "values don't meet" in proc.stderr.lower()


def test_default_objects() -> None:
    assert kinds(template()) == {
        ("ServiceAccount", "posttrain"),
        ("ClusterRole", "posttrain"),
        ("ClusterRoleBinding", "posttrain"),
        ("ClusterRole", "posttrain-trainer"),
        ("ValidatingAdmissionPolicy", "posttrain-trainer-status"),
        ("ValidatingAdmissionPolicyBinding", "posttrain-trainer-status"),
        ("Role", "posttrain-leader-election"),
        ("RoleBinding", "posttrain-leader-election"),
        ("Deployment", "posttrain"),
        ("Service", "posttrain-metrics"),
        ("PodDisruptionBudget", "posttrain"),
    }


def test_release_name_prefixes_objects() -> None:
    docs = template(release="ml", namespace="ops")
    assert find(docs, "Deployment")["metadata"]["name"] == "ml-posttrain"
    for d in docs:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"]["namespace"] == "ops", d["kind"]


# -- RBAC ------------------------------------------------------------------------------


def test_cluster_role_is_exactly_what_the_operator_touches() -> None:
    docs = template()
    rules = find(docs, "ClusterRole", "posttrain")["rules"]
    assert rule_set(rules) == EXPECTED_CLUSTER_RULES
    for r in rules:
        assert "*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"]
        assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(
            r["verbs"]
        )
        assert not {"secrets", "pods/exec", "pods/attach", "pods/log"} & set(r["resources"])
        if "pods" in r["resources"]:
            assert set(r["verbs"]) == {"list", "watch"}  # read-only
    binding = find(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "posttrain",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "posttrain", "namespace": NS}]


def test_lease_role_is_namespaced_to_the_release() -> None:
    docs = template()
    role = find(docs, "Role", "posttrain-leader-election")
    assert role["metadata"]["namespace"] == NS
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [LEASE],
            "verbs": ["get", "update"],
        },
    ]
    binding = find(docs, "RoleBinding", "posttrain-leader-election")
    assert binding["metadata"]["namespace"] == NS
    assert binding["roleRef"]["kind"] == "Role"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "posttrain", "namespace": NS}]


def test_lease_name_matches_the_operator() -> None:
    from posttrain.controller.main import LEASE_NAME

    assert LEASE_NAME == LEASE


def _sample_job() -> Any:
    from posttrain.checks import validate

    doc = yaml.safe_load((ROOT / "examples" / "sft-lora-smollm2-cpu.yaml").read_text())
    doc["metadata"].update(namespace="team-a", uid="0000-1111")
    job, errors = validate(doc)
    assert job is not None and not errors, errors
    return job


PLURALS = {
    "ServiceAccount": ("", "serviceaccounts"),
    "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
    "JobSet": ("jobset.x-k8s.io", "jobsets"),
}


def test_operator_may_create_everything_the_renderer_makes() -> None:
    """Every object `render` and `trainer_access` return is creatable, and every rule of
    the trainer ClusterRole the RoleBinding grants is held by the operator itself (the RBAC
    escalation check on RoleBinding creation)."""
    from posttrain.render import RenderConfig, render
    from posttrain.render.objects import trainer_access

    docs = template()
    held = rule_set(find(docs, "ClusterRole", "posttrain")["rules"])
    env = env_of(container(docs))
    role = env["POSTTRAIN_TRAINER_CLUSTER_ROLE"]
    assert role == RenderConfig().trainer_cluster_role
    objs = render(_sample_job()) + trainer_access("team-a", role)
    for obj in objs:
        assert "create" in held[PLURALS[obj["kind"]]], obj["kind"]
    (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role
    granted = rule_set(find(docs, "ClusterRole", role)["rules"])
    assert granted == {("posttrain.dev", "posttrainjobs/status"): {"patch"}}
    for key, verbs in granted.items():
        assert verbs <= held.get(key, set()), (key, verbs)


def test_trainer_status_policy_names_what_the_renderer_makes() -> None:
    """The policy keeping each trainer to its own job's status matches the ServiceAccount
    and the trainer replicated jobs the renderer uses, and denies (its binding)."""
    from posttrain.render.names import TRAINER_REPLICATED_JOBS, TRAINER_SERVICE_ACCOUNT

    docs = template(release="ml", namespace="ops")
    policy = find(docs, "ValidatingAdmissionPolicy", "ml-posttrain-trainer-status")
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (match,) = spec["matchConditions"]
    assert f"':{TRAINER_SERVICE_ACCOUNT}')" in match["expression"]
    pattern = f"^({'|'.join(TRAINER_REPLICATED_JOBS)})-[0-9]+-[0-9]+-[a-z0-9]+$"
    assert any(pattern in rule["expression"] for rule in spec["validations"])
    binding = find(docs, "ValidatingAdmissionPolicyBinding", "ml-posttrain-trainer-status")
    assert binding["spec"] == {
        "policyName": "ml-posttrain-trainer-status",
        "validationActions": ["Deny"],
    }
    assert env_of(container(docs))["POSTTRAIN_TRAINER_CLUSTER_ROLE"] == "ml-posttrain-trainer"
    without = kinds(template({"rbac.create": False}))
    assert not {k for k, _ in without} & {"ValidatingAdmissionPolicy", "ClusterRole"}


# -- Deployment ------------------------------------------------------------------------


def test_deployment_runs_the_operator() -> None:
    docs = template()
    deploy = find(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "posttrain"
    c = container(docs)
    assert c["image"] == "ghcr.io/posttrain/operator:0.1.0"
    assert "command" not in c  # the image's entrypoint is `posttrain` (under tini)
    assert c["args"] == ["operator", "--metrics-port", "8080", "--lease-namespace", NS]
    env = env_of(c)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    values = yaml.safe_load((CHART / "values.yaml").read_text())["defaults"]
    for kind in ("cpu", "tpu", "gpu"):
        assert env[f"POSTTRAIN_TRAINER_IMAGE_{kind.upper()}"] == values["trainerImages"][kind]
    assert env["POSTTRAIN_PATHWAYS_SERVER_IMAGE"] == values["pathwaysServerImage"]
    assert env["POSTTRAIN_PATHWAYS_PROXY_IMAGE"] == values["pathwaysProxyImage"]
    assert env["POSTTRAIN_PATHWAYS_HEAD_NODE_POOL"] == values["pathwaysHeadNodePool"]
    assert env["POSTTRAIN_DEFAULT_QUEUE"] == ""
    assert env["POSTTRAIN_LOG_LEVEL"] == "INFO"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_operator_defaults_match_the_renderer() -> None:
    """Chart defaults = the operator's own defaults, so leaving values out changes nothing."""
    from posttrain.render import RenderConfig

    values = yaml.safe_load((CHART / "values.yaml").read_text())["defaults"]
    cfg = RenderConfig()
    for kind in ("cpu", "tpu", "gpu"):
        assert values["trainerImages"][kind] == cfg.trainer_image(kind)
    assert values["pathwaysServerImage"] == cfg.pathways_server_image
    assert values["pathwaysProxyImage"] == cfg.pathways_proxy_image
    assert values["pathwaysHeadNodePool"] == cfg.pathways_head_node_pool


def test_deployment_args_parse_with_the_operator_cli() -> None:
    import argparse

    from posttrain.controller.options import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    docs = template({"webhook.enabled": True})
    args = parser.parse_args(container(docs)["args"][1:])
    assert args.metrics_port == 8080 and args.lease_namespace == NS
    assert args.webhook_port == 9443
    assert (args.webhook_cert, args.webhook_key) == ("/certs/tls.crt", "/certs/tls.key")
    assert not args.webhook_register  # the chart owns the webhook configuration


def test_values_reach_the_environment() -> None:
    docs = template(
        {
            "defaults.trainerImages.tpu": "r.example/trainer:9-tpu",
            "defaults.queue": "team-a",
            "logLevel": "DEBUG",
            "image.tag": "1.2.3",
        }
    )
    c = container(docs)
    env = env_of(c)
    assert env["POSTTRAIN_TRAINER_IMAGE_TPU"] == "r.example/trainer:9-tpu"
    assert env["POSTTRAIN_DEFAULT_QUEUE"] == "team-a"
    assert env["POSTTRAIN_LOG_LEVEL"] == "DEBUG"
    assert c["image"] == "ghcr.io/posttrain/operator:1.2.3"
    assert env["POSTTRAIN_ALLOWED_FUNCTION_MODULES"] == ""  # any module but Python's own


def test_allowed_reward_function_modules_reach_the_operator() -> None:
    """The operator's webhook checks them and passes them to every trainer pod."""
    docs = template({"rewardFunctions.allowedModules": "{acme.rewards,lab}"})
    env = env_of(container(docs))
    assert env["POSTTRAIN_ALLOWED_FUNCTION_MODULES"] == "acme.rewards,lab"
    proc = helm("template", "x", str(CHART), "--set", "rewardFunctions.allowedModules={a b}",
                check=False)  # fmt: skip
    assert proc.returncode != 0 and "allowedModules" in proc.stderr


def test_image_digest_wins() -> None:
    digest = "sha256:" + "b" * 64
    c = container(template({"image.digest": digest}))
    assert c["image"] == f"ghcr.io/posttrain/operator@{digest}"


def test_security_context_is_restricted() -> None:
    docs = template()
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(docs)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # A writable /tmp, since the root filesystem is read-only.
    assert {"name": "tmp", "mountPath": "/tmp"} in container(docs)["volumeMounts"]


def test_ha_defaults_and_single_replica() -> None:
    docs = template()
    pdb = find(docs, "PodDisruptionBudget")
    deploy = find(docs, "Deployment")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == deploy["spec"]["selector"]
    assert "podAntiAffinity" in deploy["spec"]["template"]["spec"]["affinity"]
    one = template({"replicaCount": 1})
    assert ("PodDisruptionBudget", "posttrain") not in kinds(one)
    assert "affinity" not in find(one, "Deployment")["spec"]["template"]["spec"]


def test_metrics_service_and_service_monitor() -> None:
    docs = template({"metrics.serviceMonitor.enabled": True})
    svc = find(docs, "Service", "posttrain-metrics")
    pod_labels = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]
    sm = find(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert ("ServiceMonitor", "posttrain") not in kinds(template())


# -- admission webhook -----------------------------------------------------------------


def project_webhook(service: dict[str, Any]) -> dict[str, Any]:
    """The webhook entry posttrain's own server is built for."""
    from posttrain.controller.webhook import WEBHOOK_PATH, webhook_entry

    return webhook_entry({"service": {**service, "path": WEBHOOK_PATH}})


def test_webhook_points_where_the_operator_serves() -> None:
    docs = template({"webhook.enabled": True})
    vwc = find(docs, "ValidatingWebhookConfiguration")
    (hook,) = vwc["webhooks"]
    service = hook["clientConfig"]["service"]
    assert service == {
        "name": "posttrain-webhook",
        "namespace": NS,
        "port": 9443,
        "path": WEBHOOK_PATH,
    }
    expected = project_webhook({k: v for k, v in service.items() if k != "path"})
    assert expected["clientConfig"]["service"]["path"] == WEBHOOK_PATH
    assert hook["name"] == expected["name"]
    assert hook["sideEffects"] == expected["sideEffects"]
    assert set(hook["admissionReviewVersions"]) <= set(expected["admissionReviewVersions"])
    (rule,) = hook["rules"]
    (expected_rule,) = expected["rules"]
    for key in ("apiGroups", "apiVersions", "resources"):
        assert rule[key] == expected_rule[key]
    assert rule["operations"] == ["CREATE", "UPDATE"]
    assert hook["failurePolicy"] == "Fail"
    svc = find(docs, "Service", "posttrain-webhook")
    assert svc["spec"]["ports"] == [
        {"name": "webhook", "port": 9443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    c = container(docs)
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in c["ports"]
    assert c["args"][-6:] == [
        "--webhook-port",
        "9443",
        "--webhook-cert",
        "/certs/tls.crt",
        "--webhook-key",
        "/certs/tls.key",
    ]
    assert {"name": "webhook-certs", "mountPath": "/certs", "readOnly": True} in c["volumeMounts"]


def test_webhook_self_signed_certificate() -> None:
    from cryptography import x509

    docs = template({"webhook.enabled": True})
    secret = find(docs, "Secret", "posttrain-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    hook = find(docs, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert base64.b64decode(hook["clientConfig"]["caBundle"]) == data["ca.crt"]
    ca = x509.load_pem_x509_certificate(data["ca.crt"])
    cert = x509.load_pem_x509_certificate(data["tls.crt"])
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = sans.get_values_for_type(x509.DNSName)
    assert f"posttrain-webhook.{NS}.svc" in dns
    assert cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(
        days=365
    )
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "webhook-certs", "secret": {"secretName": "posttrain-webhook-tls"}} in pod[
        "volumes"
    ]


def test_webhook_with_cert_manager() -> None:
    docs = template({"webhook.enabled": True, "webhook.certManager.enabled": True})
    assert not [d for d in docs if d["kind"] == "Secret"]
    cert = find(docs, "Certificate", "posttrain-webhook")
    issuer = find(docs, "Issuer", "posttrain-selfsigned")
    assert issuer["spec"] == {"selfSigned": {}}
    assert cert["spec"]["secretName"] == "posttrain-webhook-tls"
    assert f"posttrain-webhook.{NS}.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"]["name"] == "posttrain-selfsigned"
    vwc = find(docs, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{NS}/posttrain-webhook"
    }
    assert "caBundle" not in vwc["webhooks"][0]["clientConfig"]


def test_webhook_with_an_existing_issuer() -> None:
    docs = template(
        {
            "webhook.enabled": True,
            "webhook.certManager.enabled": True,
            "webhook.certManager.issuerRef.name": "corp-ca",
            "webhook.certManager.issuerRef.kind": "ClusterIssuer",
        }
    )
    assert not [d for d in docs if d["kind"] == "Issuer"]
    assert find(docs, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }


def test_webhook_off_by_default() -> None:
    docs = template()
    assert not {"ValidatingWebhookConfiguration", "Secret", "Certificate"} & {
        d["kind"] for d in docs
    }
    assert "--webhook-port" not in container(docs)["args"]


# -- Kustomize manifests agree with the chart -------------------------------------------


def test_kustomize_base_is_the_chart_with_defaults() -> None:
    base = {(d["kind"], d["metadata"]["name"]): d for d in kustomize_base()}
    chart = {(d["kind"], d["metadata"]["name"]): strip_helm(d) for d in template()}
    # The chart's crds/ file (the CRD and its immutable-fields policy) is not a template.
    crd_file = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(CRD.read_text())}
    assert ("CustomResourceDefinition", "posttrainjobs.posttrain.dev") in crd_file
    assert set(base) == (set(chart) - {("PodDisruptionBudget", "posttrain")}) | crd_file | {
        ("Namespace", NS)
    }
    for key, obj in chart.items():
        if key in base:
            assert base[key] == obj, f"manifests/base differs from the chart for {key}"


def test_webhook_component_is_the_chart_with_cert_manager() -> None:
    comp = MANIFESTS / "components" / "webhook"
    kust = yaml.safe_load((comp / "kustomization.yaml").read_text())
    assert kust["kind"] == "Component"
    chart_docs = template({"webhook.enabled": True, "webhook.certManager.enabled": True})
    chart = {(d["kind"], d["metadata"]["name"]): strip_helm(d) for d in chart_docs}
    for d in load_yaml_docs(comp / "webhook.yaml"):
        if d["kind"] not in CLUSTER_SCOPED:
            d["metadata"]["namespace"] = NS
        key = (d["kind"], d["metadata"]["name"])
        assert d == chart[key], f"components/webhook differs from the chart for {key}"
    (patch,) = kust["patches"]
    deploy = find(kustomize_base(), "Deployment")
    patched = json_patch_add(deploy, yaml.safe_load(patch["patch"]))
    assert patched == chart[("Deployment", "posttrain")]


def _overlay(name: str) -> dict[str, Any]:
    return yaml.safe_load((MANIFESTS / "overlays" / name / "kustomization.yaml").read_text())


def _deployment_patch(kust: dict[str, Any]) -> dict[str, Any]:
    (patch,) = [p for p in kust["patches"] if p["target"]["kind"] == "Deployment"]
    return yaml.safe_load(patch["patch"])


def test_dev_overlay() -> None:
    kust = _overlay("dev")
    assert kust["resources"] == ["../../base"]
    spec = _deployment_patch(kust)["spec"]
    assert spec["replicas"] == 1
    (c,) = spec["template"]["spec"]["containers"]
    assert c["name"] == "operator"
    assert {"name": "POSTTRAIN_LOG_LEVEL", "value": "DEBUG"} in c["env"]


def test_production_overlay() -> None:
    kust = _overlay("production")
    assert "../../base" in kust["resources"]
    spec = _deployment_patch(kust)["spec"]
    assert spec["replicas"] == 2
    (c,) = spec["template"]["spec"]["containers"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    (pdb,) = load_yaml_docs(MANIFESTS / "overlays" / "production" / "pdb.yaml")
    assert pdb["kind"] == "PodDisruptionBudget"
    assert pdb["spec"] == strip_helm(find(template(), "PodDisruptionBudget"))["spec"]


# -- Kueue examples (manifests/kueue) match what the renderer asks for -------------------


@pytest.mark.parametrize(
    ("path", "accelerator", "example"),
    [
        ("tpu-v6e.yaml", "v6e-256", "sft-qwen3-v6e-256-pathways.yaml"),
        ("gpu-h100.yaml", "nvidia-h100-80gb", None),
    ],
)
def test_kueue_flavors_match_the_renderer(path: str, accelerator: str, example: str | None) -> None:
    from posttrain import catalog

    docs = load_yaml_docs(MANIFESTS / "kueue" / path)
    placement = catalog.resolve(accelerator, None, None)
    flavors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceFlavor"}
    labelled = [f for f in flavors.values() if f.get("spec", {}).get("nodeLabels")]
    (flavor,) = labelled
    assert flavor["spec"]["nodeLabels"] == placement.node_selector
    (cq,) = [d for d in docs if d["kind"] == "ClusterQueue"]
    groups = cq["spec"]["resourceGroups"]
    accel_group = [g for g in groups if placement.resource_name in g["coveredResources"]]
    assert len(accel_group) == 1 and accel_group[0]["coveredResources"] == [placement.resource_name]
    assert [f["name"] for f in accel_group[0]["flavors"]] == [flavor["metadata"]["name"]]
    for g in groups:
        for f in g["flavors"]:
            assert f["name"] in flavors
    (lq,) = [d for d in docs if d["kind"] == "LocalQueue"]
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    if example:
        job = yaml.safe_load((ROOT / "examples" / example).read_text())
        assert job["spec"]["scheduling"]["queue"] == lq["metadata"]["name"]
        assert job["metadata"]["namespace"] == lq["metadata"]["namespace"]
        # The pods' PriorityClass (scheduling.k8s.io), which Kueue also reads.
        pcs = {d["metadata"]["name"] for d in docs if d["kind"] == "PriorityClass"}
        assert job["spec"]["scheduling"]["priorityClass"] in pcs
