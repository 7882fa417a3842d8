"""docs/operator-guide.md's blocks that need only an API server, run as written
(tests/guide_shell.py): rendering the chart, Kustomize, Kueue queues, the Argo CD health
check. They use the guide's fixed names (posttrain-system, ml, argocd, release objects
named `posttrain`) and remove what they create, except namespaces: without the controller
manager a deleted namespace never goes away, and test_install.py keeps them too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from guide_shell import guide_shell

from tests.cluster import Cluster

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_render_without_a_cluster(apiserver: Cluster, tmp_path: Path, request) -> None:
    apiserver.ensure_namespace("posttrain-system")  # the guide: a dry run creates none
    with guide_shell(request, tmp_path, apiserver) as guide:
        _, dry_run = guide.run(guide.block("helm template"))
        rendered = yaml.safe_load_all((guide.workdir / "posttrain.yaml").read_text())
        kinds = {d["kind"] for d in rendered if d}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "Service"} <= kinds
    assert "deployment.apps/posttrain created (server dry run)" in dry_run.stdout
    proc = apiserver.kubectl(
        "get", "deployment", "posttrain", "-n", "posttrain-system", check=False
    )
    assert "NotFound" in proc.stderr, "a server dry run changes nothing"


def test_install_with_kustomize(apiserver: Cluster, tmp_path: Path, request) -> None:
    """Validate, apply production, then dev, then delete by name as the guide says."""
    apiserver.ensure_namespace("posttrain-system")

    def deployment() -> dict:
        return apiserver.get("deployment", "posttrain", "posttrain-system")

    def production_applied() -> None:
        assert deployment()["spec"]["replicas"] == 2
        apiserver.get("poddisruptionbudget", "posttrain", "posttrain-system")
        crd = apiserver.get("crd", "posttrainjobs.posttrain.dev")
        assert "Prune=false" in crd["metadata"]["annotations"]["argocd.argoproj.io/sync-options"]

    with guide_shell(request, tmp_path, apiserver) as guide:
        try:
            validate, production, dev = guide.run(
                guide.block("kubectl apply --server-side -k"),
                after={"-k manifests/overlays/production": production_applied},
            )
            assert "deployment.apps/posttrain created (server dry run)" in validate.stdout
            assert "clusterrole.rbac.authorization.k8s.io/posttrain serverside-applied" in (
                production.stdout
            )
            assert deployment()["spec"]["replicas"] == 1
            env = deployment()["spec"]["template"]["spec"]["containers"][0]["env"]
            assert {"name": "POSTTRAIN_LOG_LEVEL", "value": "DEBUG"} in env
        finally:
            namespaced, cluster_scoped = guide.run(guide.block("delete --ignore-not-found"))
    assert 'deployment.apps "posttrain" deleted' in namespaced.stdout
    assert 'clusterrole.rbac.authorization.k8s.io "posttrain" deleted' in cluster_scoped.stdout
    kinds = "deployments,services,poddisruptionbudgets,serviceaccounts,roles,rolebindings"
    left = apiserver.kubectl("get", kinds, "-n", "posttrain-system", "-o", "name").stdout
    assert "posttrain" not in left, left
    apiserver.get("crd", "posttrainjobs.posttrain.dev")  # kept, and with it every job


def test_kueue_queues(apiserver: Cluster, tmp_path: Path, request) -> None:
    apiserver.ensure_namespace("ml")  # the LocalQueue's namespace in the file
    manifest = ROOT / "manifests" / "kueue" / "tpu-v6e.yaml"
    with guide_shell(request, tmp_path, apiserver) as guide:
        try:
            (applied,) = guide.run(guide.block("manifests/kueue/tpu-v6e.yaml"))
            cq = apiserver.get("clusterqueue", "tpu-v6e")
            local = apiserver.get("localqueue", "tpu-v6e", "ml")
        finally:
            apiserver.kubectl("delete", "-f", str(manifest), "--ignore-not-found", check=False)
    assert applied.stdout.count("serverside-applied") == 5, applied.stdout
    tpu = cq["spec"]["resourceGroups"][0]["flavors"][0]
    assert tpu["name"] == "tpu-v6e-16x16" and str(tpu["resources"][0]["nominalQuota"]) == "512"
    assert local["spec"]["clusterQueue"] == "tpu-v6e"


def test_argocd_health_check(apiserver: Cluster, tmp_path: Path, request) -> None:
    """The patch merges the health check into the argocd-cm Argo CD installs."""
    apiserver.ensure_namespace("argocd")
    existing = apiserver.kubectl("get", "configmap", "argocd-cm", "-n", "argocd", check=False)
    created = existing.returncode != 0
    if created:
        apiserver.kubectl(
            "create", "configmap", "argocd-cm", "-n", "argocd", "--from-literal=url=https://cd"
        )
    try:
        with guide_shell(request, tmp_path, apiserver) as guide:
            (patched,) = guide.run(guide.block("argocd-cm"))
        data = apiserver.get("configmap", "argocd-cm", "argocd")["data"]
    finally:
        if created:
            apiserver.kubectl("delete", "configmap", "argocd-cm", "-n", "argocd", check=False)
    assert patched.stdout.startswith("configmap/argocd-cm patched")
    lua = (ROOT / "manifests" / "argocd" / "health-posttrainjob.lua").read_text()
    assert data["resource.customizations.health.posttrain.dev_PostTrainJob"] == lua
    assert not created or data["url"] == "https://cd"  # merged, not replaced
