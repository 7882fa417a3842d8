"""The guides' cluster commands, run as written (tests/guide_shell.py) on the full local
cluster, with the operator running as a process here (kwok has no kubelet, so the
chart's Deployment runs as fake pods that do nothing).

The trainer image the operator puts in jobs without `spec.image` (the chart's
`defaults.trainerImages`, for every accelerator kind) is `posttrain-trainer:slow`, which kwok completes after a few
seconds (scripts/control-plane/kwok-stages.yaml).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from doc_blocks import blocks
from guide_shell import guide_shell
from invalid_jobs import valid_job
from operator_process import (
    OperatorProcess,
    chart_env,
    chart_identity,
    drop_chart_identity,
    token_kubeconfig,
    trainer_images,
)

from tests.cluster import Cluster, unique_name, wait_for

pytestmark = pytest.mark.e2e
TRAINER = "posttrain-trainer:slow"
COLUMNS = {"PHASE", "STEP", "TOTAL", "LOSS", "AGE"}


def owned_objects(cluster: Cluster, namespace: str, job: str) -> str:
    return cluster.kubectl(
        "get", "jobsets", "-n", namespace,
        "-l", f"posttrain.dev/job-name={job}", "-o", "name",
    ).stdout.strip()  # fmt: skip


def test_user_guide_on_a_cluster(cluster: Cluster, namespace: str, tmp_path: Path, request) -> None:
    """docs/user-guide.md "On a cluster" with the guide's own job ("A job, field by
    field") as job.yaml, unchanged. The cluster gets what that job asks for: a v6e-16
    slice (4 fake hosts, topology 4x4), a Kueue LocalQueue `team-a` and the Secret
    `hf-token`. kubectl's default namespace is the test's."""
    (job,) = [
        b
        for b in blocks("docs/user-guide.md")
        if b.lang == "yaml" and b.heading == "A job, field by field"
    ]
    nodes = cluster.create_tpu_slice(unique_name("v6e-4x4", 20), topology="4x4", hosts=4)
    queue = cluster.tpu_queue(namespace, "team-a", topology="4x4", chips=16)
    cluster.kubectl(
        "create", "secret", "generic", "hf-token", "--from-literal=token=x", "-n", namespace
    )
    release = cluster.create_namespace("posttrain-system")
    identity = chart_identity(cluster, release, tmp_path / "operator.kubeconfig")
    operator = OperatorProcess(identity, tmp_path, release, "-n", namespace)
    operator.env.update(trainer_images(TRAINER) | chart_env(release))
    try:
        operator.start()
        with guide_shell(request, tmp_path, cluster) as guide:
            guide.env["KUBECONFIG"] = str(cluster.kubeconfig_in(namespace, tmp_path / "kc"))
            (guide.workdir / "job.yaml").write_text(job.text)
            apply, watch, describe, wait, suspend, delete = guide.run(
                guide.block("kubectl apply -f job.yaml")
            )
            wait_for(
                lambda: not owned_objects(cluster, namespace, "qwen3-lora"),
                timeout=90,
                what="the job's JobSet to be removed with it",
            )
    finally:
        operator.stop()
        cluster.delete_nodes(nodes)
        cluster.delete_all(queue)
        drop_chart_identity(cluster, release)
        cluster.delete_namespace(release)
    assert apply.stdout.strip() == "posttrainjob.posttrain.dev/qwen3-lora created"
    header, *rows = watch.stdout.splitlines()
    assert set(header.split()) >= COLUMNS, watch.stdout
    assert rows and all(r.startswith("qwen3-lora ") for r in rows), watch.stdout
    assert "Succeeded" in rows[-1], watch.stdout
    assert "Name:         qwen3-lora" in describe.stdout and "Events:" in describe.stdout
    assert wait.stdout.strip() == "posttrainjob.posttrain.dev/qwen3-lora condition met"
    assert suspend.stdout.strip() == "posttrainjob.posttrain.dev/qwen3-lora patched"
    assert delete.stdout.startswith('posttrainjob.posttrain.dev "qwen3-lora" deleted')
    assert "Forbidden" not in operator.logs(), operator.logs()


def test_operator_guide_helm(cluster: Cluster, tmp_path: Path, request) -> None:
    """docs/operator-guide.md with Helm, in the order a cluster admin meets it: install
    (release `posttrain` in posttrain-system, as written), the Lease holder, the RBAC
    checks, troubleshooting a job `my-job` in team-a, metrics, upgrade, uninstall.

    The operator that acts is a process here with the release's ServiceAccount token,
    started after `helm install` (and stopped before `helm uninstall`, as the
    Deployment's pods would be). One substitution: `kubectl delete crd` runs with
    `--dry-run=server`, since deleting the CRD would delete every other test's jobs."""
    cluster.ensure_namespace("team-a")
    operators: list[OperatorProcess] = []

    def start_operator() -> None:
        token = token_kubeconfig(cluster, "posttrain-system", "posttrain", tmp_path / "sa")
        op = OperatorProcess(token, tmp_path, "posttrain-system", "-n", "team-a", identity="op-1")
        op.env.update(trainer_images(TRAINER))
        operators.append(op.start())

    with guide_shell(request, tmp_path, cluster) as guide:
        crd_delete = "kubectl delete crd posttrainjobs.posttrain.dev"
        guide.substitutions[crd_delete] = f"{crd_delete} --dry-run=server"
        try:
            install, rollout, lease = guide.run(
                guide.block("helm install posttrain"), after={"helm install": start_operator}
            )
            assert "STATUS: deployed" in install.stdout
            assert 'deployment "posttrain" successfully rolled out' in rollout.stdout
            assert lease.stdout == "op-1\n"

            guide.run(guide.block("kubectl auth can-i"))  # answers = the `# yes`/`# no`

            doc = valid_job("my-job")
            doc["spec"]["resources"] = {"accelerator": "v6e-8"}  # the cluster's 2x4 slices
            cluster.apply(doc, namespace="team-a")
            wait_for(
                lambda: cluster.get("ptj", "my-job", "team-a").get("status", {}).get("conditions"),
                timeout=90,
                what="my-job to have a status to troubleshoot",
            )
            table, wide, describe, conditions, wait = guide.run(
                guide.block("kubectl get ptj -n team-a")
            )
            assert set(table.stdout.split("\n")[0].split()) >= COLUMNS, table.stdout
            assert {"ETA", "JOBSET"} <= set(wide.stdout.split("\n")[0].split()), wide.stdout
            assert "Name:         my-job" in describe.stdout and "Events:" in describe.stdout
            assert conditions.stdout.strip(), "one line per condition"
            for line in conditions.stdout.splitlines():
                assert line.split(" ")[0].split("=")[1] in ("True", "False"), conditions.stdout
            assert "condition met" in wait.stdout
            # What the guide's `curl .../metrics | grep ^posttrain_` shows (no port-forward
            # without a kubelet): the documented series, from the operator that acted.
            (op,) = operators
            assert op.metric("posttrain_leader") == 1.0
            assert op.metric("posttrain_jobs", 'phase="Succeeded"') >= 1.0
            assert "# TYPE posttrain_reconcile_errors_total counter" in op.get("/metrics")[1]

            crd, upgrade = guide.run(guide.block("helm upgrade"))
            assert "REVISION: 2" in upgrade.stdout
            op.stop()
            assert "Forbidden" not in op.logs(), op.logs()
            (uninstall,) = guide.run(guide.block("helm uninstall"))
            assert uninstall.stdout.strip() == 'release "posttrain" uninstalled'
            gone = cluster.kubectl("get", "deployment/posttrain", "-n", "posttrain-system",
                                   check=False)  # fmt: skip
            assert "NotFound" in gone.stderr
            # "This keeps the CRD and therefore every PostTrainJob"
            assert cluster.get("ptj", "my-job", "team-a")["status"]["phase"] == "Succeeded"
            (dry_run,) = guide.run(guide.block(crd_delete))
            assert "deleted (server dry run)" in dry_run.stdout
            cluster.get("crd", "posttrainjobs.posttrain.dev")
        finally:
            for op in operators:
                op.stop()
            subprocess.run(
                ["helm", "uninstall", "posttrain", "-n", "posttrain-system", "--ignore-not-found"],
                env=guide.env,
                capture_output=True,
                timeout=120,
            )
            # No operator removes kopf's finalizer any more.
            cluster.kubectl("patch", "ptj", "my-job", "-n", "team-a", "--type=merge",
                            "-p", '{"metadata":{"finalizers":null}}', check=False)  # fmt: skip
            cluster.kubectl("delete", "ptj", "my-job", "-n", "team-a", "--ignore-not-found",
                            check=False)  # fmt: skip
