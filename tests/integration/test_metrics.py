"""Every metric the chart's Grafana dashboard and alerting rules use is one the operator
exports: a real `posttrain operator` against the local kube-apiserver, its /metrics read
while it reconciles an active job (tests/chart_monitoring.py lists the names)."""

from __future__ import annotations

import datetime
import re

import pytest
from chart_monitoring import used_metric_names
from invalid_jobs import valid_job
from operator_process import OperatorProcess

from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.integration
GROUP, VERSION, PLURAL = "posttrain.dev", "v1alpha1", "posttrainjobs"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def exported_names(text: str) -> set[str]:
    """Sample names in an exposition, and those of each declared family (a counter no
    handler has raised on yet has its TYPE line but no sample)."""
    names = {m for m in re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", text, re.M)}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        family = family.removesuffix("_total")  # the client may keep it on a counter's TYPE
        names |= {family + s for s in SUFFIXES.get(kind, ("",))}
    return names


def test_dashboard_and_alert_metrics_are_exported(
    apiserver: Cluster, namespace: str, tmp_path
) -> None:
    op = OperatorProcess(apiserver.kubeconfig, tmp_path, namespace, "-n", namespace).start()
    try:
        apiserver.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, valid_job("watched")
        )
        labels = f'job_name="watched",job_namespace="{namespace}"'  # exposition order
        wait_for(
            lambda: op.metric(
                "posttrain_job_phase_entered_timestamp_seconds", labels + ',phase="Pending"'
            ),
            timeout=30,
            describe=lambda: (
                "\n".join(
                    line for line in op.get("/metrics")[1].splitlines() if "posttrain_job" in line
                )
                + "\n"
                + op.logs()[-3000:]
            ),
        )
        # The trainer's progress report reaches the per-job gauges.
        apiserver.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "watched",
            {"status": {"progress": {"step": 5, "totalSteps": 20, "tokensPerSecond": 640.0}}},
        )
        wait_for(lambda: op.metric("posttrain_job_progress_ratio", labels) == 0.25, timeout=30)
        assert op.metric("posttrain_job_tokens_per_second", labels) == 640.0
        assert op.metric("posttrain_job_restarts", labels) == 0

        def written_status() -> dict | None:
            job = apiserver.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, "watched"
            )
            return job["status"] if "conditions" in job.get("status", {}) else None

        # The gauge follows the operator's decision; its status write may land a moment later.
        status = wait_for(written_status, timeout=30, what="the operator's status write")
        newest = max(c["lastTransitionTime"] for c in status["conditions"])
        entered = op.metric(
            "posttrain_job_phase_entered_timestamp_seconds", f'{labels},phase="{status["phase"]}"'
        )
        assert entered == datetime.datetime.fromisoformat(newest).timestamp()

        _, text = op.get("/metrics")
        used = used_metric_names()
        assert {"posttrain_job_phase_entered_timestamp_seconds", "posttrain_leader"} <= used
        missing = used - exported_names(text)
        assert not missing, f"the chart uses metrics the operator does not export: {missing}"

        # A deleted job takes its series with it.
        apiserver.custom.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "watched"
        )
        wait_for(lambda: op.metric("posttrain_job_restarts", labels) is None, timeout=30)
    finally:
        op.stop()
