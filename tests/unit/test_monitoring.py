"""The chart's Grafana dashboard and PrometheusRule, and the alerts under promtool.

`promtool check rules` and `promtool test rules` run on the rules `helm template`
renders, with input series that cross each threshold: an alert fires after it and not
before. promtool is built by `make tools` (.cache/bin/promtool); the tests FAIL with the
build command when it is missing. That every metric used here is one the operator
exports is tests/integration/test_metrics.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_monitoring import (
    NS,
    dashboard,
    dashboard_exprs,
    metric_names,
    render,
    rule_exprs,
    rule_groups,
)

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = ROOT / ".cache" / "bin" / "promtool"
BUILD_PROMTOOL = "make tools"
JOB = 'job_namespace="team-a",job_name="sft"'
OPERATOR = f'namespace="{NS}",pod="posttrain-0"'


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if not PROMTOOL.is_file():
        pytest.fail(
            f"promtool is missing: run `{BUILD_PROMTOOL}` (builds {PROMTOOL})", pytrace=False
        )
    return subprocess.run(
        [str(PROMTOOL), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def promtool_test(tmp_path: Path, groups: dict[str, Any], tests: list[dict[str, Any]]) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    proc = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def alerts_at(minute: int, name: str, *expected: dict[str, Any]) -> dict[str, Any]:
    return {"eval_time": f"{minute}m", "alertname": name, "exp_alerts": list(expected)}


# -- the objects -----------------------------------------------------------------------


def test_off_by_default() -> None:
    docs = render({"metrics.dashboard.enabled": "false", "metrics.prometheusRule.enabled": "false"})
    assert not {d["kind"] for d in docs} & {"PrometheusRule"}
    assert not [d for d in docs if d["kind"] == "ConfigMap"]


def test_dashboard_config_map_follows_the_sidecar_convention() -> None:
    cm = next(d for d in render() if d["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NS
    assert list(cm["data"]) == ["posttrain.json"]
    moved = render(
        {
            "metrics.dashboard.label": "dashboards",
            "metrics.dashboard.labelValue": "posttrain",
            "metrics.dashboard.namespace": "monitoring",
            "metrics.dashboard.annotations.grafana_folder": "ML",
        }
    )
    cm = next(d for d in moved if d["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["dashboards"] == "posttrain"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "ML"}


def test_dashboard_panels() -> None:
    dash = dashboard(render())
    assert dash["uid"] == "posttrain-operator"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    titles = {p["title"] for p in dash["panels"]}
    assert {
        "Leader",
        "Jobs by phase",
        "Reconciles by handler",
        "Reconcile errors by handler",
        "Reconcile latency",
        "Time in phase",
        "Progress",
    } <= titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            # Every query is scoped to one operator install.
            assert 'namespace="$namespace"' in t["expr"] and 'job="$job"' in t["expr"], t["expr"]


def test_every_metric_is_written_as_a_selector() -> None:
    """metric_names() finds a name only as `name{...}`/`name[...]`: no bare name slips by."""
    docs = render()
    for expr in dashboard_exprs(dashboard(docs)) + rule_exprs(rule_groups(docs)):
        bare = set(re.findall(r"\b(?:posttrain|process)_\w+", expr))
        assert bare == metric_names(expr), expr


def test_the_metrics_are_the_operators() -> None:
    """In-process check of the names (the running operator's /metrics is the integration
    test's): each is a sample name of a metric posttrain.controller.metrics declares."""
    from prometheus_client import REGISTRY

    import posttrain.controller.metrics  # noqa: F401 (registers the operator's metrics)

    declared = set()
    for family in REGISTRY.collect():
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_sum", "_count"],
        }.get(family.type, [""])
        declared |= {family.name + s for s in suffixes}
    docs = render()
    for expr in dashboard_exprs(dashboard(docs)) + rule_exprs(rule_groups(docs)):
        assert metric_names(expr) <= declared, expr


def test_rule_values_reach_the_rules() -> None:
    groups = rule_groups(
        render(
            {
                "metrics.prometheusRule.pendingAfterSeconds": "1800",
                "metrics.prometheusRule.queuedAfterSeconds": "7200",
                "metrics.prometheusRule.selector": 'job="posttrain"',
                "metrics.prometheusRule.severity": "page",
                "metrics.prometheusRule.labels.release": "kube-prometheus-stack",
            }
        )
    )
    rules = {r["alert"]: r for g in groups["groups"] for r in g["rules"]}
    assert rules["PostTrainJobPendingTooLong"]["expr"].endswith("> 1800")
    assert rules["PostTrainJobQueuedTooLong"]["expr"].endswith("> 7200")
    for rule in rules.values():
        assert 'job="posttrain"' in rule["expr"] and "namespace=" not in rule["expr"]
        assert rule["labels"] == {"severity": "page"}
    rule = one_rule(render({"metrics.prometheusRule.labels.release": "kps"}))
    assert rule["metadata"]["labels"]["release"] == "kps"


def one_rule(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return rule


@pytest.mark.parametrize(
    "values",
    [
        {"metrics.prometheusRule.pendingAfterSeconds": "10"},
        {"metrics.prometheusRule.reconcileErrorRatio": "0"},
        {"metrics.prometheusRule.noLeaderFor": "five minutes"},
        {"metrics.dashboard.namespace": "Not_A_Namespace"},
    ],
    ids=lambda v: next(iter(v)),
)
def test_schema_rejects_bad_monitoring_values(values: dict[str, str]) -> None:
    with pytest.raises(AssertionError, match="schema"):
        render(values)


# -- promtool --------------------------------------------------------------------------


def test_promtool_check_rules(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups(render())))
    proc = promtool("check", "rules", "--lint=all", "--lint-fatal", "rules.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 5 rules found" in proc.stdout, proc.stdout


def test_promtool_job_waiting_alerts(tmp_path: Path) -> None:
    """A job Pending since t=0 alerts after 15 minutes (900 s) and not before; it stops
    once it leaves Pending. So does a job Restarting (its pods not back) since t=40m. A job Queued since t=10m alerts after an hour in the queue. A
    series of another install (namespace) never alerts here."""
    entered = "posttrain_job_phase_entered_timestamp_seconds"
    pending = {
        "severity": "warning",
        "job_namespace": "team-a",
        "job_name": "sft",
        "phase": "Pending",
    }
    tests = [
        {
            "interval": "1m",
            "input_series": [
                # Pending from t=0 to 30m, then Running (the Pending series goes stale).
                {
                    "series": f'{entered}{{{JOB},phase="Pending",{OPERATOR}}}',
                    "values": "0x30 stale",
                },
                {
                    "series": f'{entered}{{{JOB},phase="Running",{OPERATOR}}}',
                    "values": "_x31 1860x60",
                },
                # Restarting since t=40m (2400 s), for 20 minutes.
                {
                    "series": f'{entered}{{job_namespace="team-a",job_name="grpo",phase="Restarting",{OPERATOR}}}',
                    "values": "_x40 2400x20 stale",
                },
                # Queued since t=10m (600 s).
                {
                    "series": f'{entered}{{job_namespace="team-b",job_name="dpo",phase="Queued",{OPERATOR}}}',
                    "values": "600x90",
                },
                # Another install's operator: not this rule's.
                {
                    "series": f'{entered}{{job_namespace="x",job_name="y",phase="Pending",namespace="other"}}',
                    "values": "0x90",
                },
            ],
            "alert_rule_test": [
                alerts_at(14, "PostTrainJobPendingTooLong"),
                alerts_at(15, "PostTrainJobPendingTooLong"),  # 900 s is not > 900 s
                alerts_at(
                    16,
                    "PostTrainJobPendingTooLong",
                    {
                        "exp_labels": pending,
                        "exp_annotations": {
                            "summary": "PostTrainJob admitted but not running longer than 900s",
                            "description": "PostTrainJob team-a/sft has been Pending for 16m 0s;"
                            " kubectl describe ptj -n team-a sft says why (scheduling, image"
                            " pull, container state).",
                        },
                    },
                ),
                # Running since 31m; a restart at 40m has its pods back at 50m.
                alerts_at(50, "PostTrainJobPendingTooLong"),
                alerts_at(
                    56,
                    "PostTrainJobPendingTooLong",
                    {
                        "exp_labels": {**pending, "job_name": "grpo", "phase": "Restarting"},
                        "exp_annotations": {
                            "summary": "PostTrainJob admitted but not running longer than 900s",
                            "description": "PostTrainJob team-a/grpo has been Restarting for"
                            " 16m 0s; kubectl describe ptj -n team-a grpo says why (scheduling,"
                            " image pull, container state).",
                        },
                    },
                ),
                alerts_at(69, "PostTrainJobQueuedTooLong"),
                alerts_at(
                    71,
                    "PostTrainJobQueuedTooLong",
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "job_namespace": "team-b",
                            "job_name": "dpo",
                        },
                        "exp_annotations": {
                            "summary": "PostTrainJob queued by Kueue longer than 3600s",
                            "description": "PostTrainJob team-b/dpo has waited for Kueue"
                            " admission for 1h 1m 0s; kubectl describe ptj -n team-b dpo"
                            " gives Kueue's reason.",
                        },
                    },
                ),
            ],
        }
    ]
    promtool_test(tmp_path, rule_groups(render()), tests)
    # The threshold is the chart value's: 30 minutes, 16 minutes in is quiet.
    slow = rule_groups(render({"metrics.prometheusRule.pendingAfterSeconds": "1800"}))
    tests[0]["alert_rule_test"] = [
        alerts_at(16, "PostTrainJobPendingTooLong"),
        alerts_at(30, "PostTrainJobPendingTooLong"),
    ]
    promtool_test(tmp_path, slow, tests)


def test_promtool_operator_alerts(tmp_path: Path) -> None:
    """Reconcile errors: the create handler fails 20% of its calls (over 10%) for 15
    minutes and alerts; the pod handler fails 5% and does not. No leader: once no replica
    holds the Lease for 5 minutes, and when no replica is scraped at all."""
    counters = [
        {
            "series": f'posttrain_reconciles_total{{handler="create",{OPERATOR}}}',
            "values": "0+60x60",
        },
        {
            "series": f'posttrain_reconcile_errors_total{{handler="create",{OPERATOR}}}',
            "values": "0+12x60",
        },
        {"series": f'posttrain_reconciles_total{{handler="pod",{OPERATOR}}}', "values": "0+60x60"},
        {
            "series": f'posttrain_reconcile_errors_total{{handler="pod",{OPERATOR}}}',
            "values": "0+3x60",
        },
        # The leader (posttrain-0) loses the Lease at 10m; the standby never gets it.
        {"series": f"posttrain_leader{{{OPERATOR}}}", "values": "1x9 0x50"},
        {"series": f'posttrain_leader{{namespace="{NS}",pod="posttrain-1"}}', "values": "0x60"},
    ]
    no_leader = {
        "exp_labels": {"severity": "warning"},
        "exp_annotations": {
            "summary": "no posttrain operator replica holds the leader Lease",
            "description": f'No replica of the posttrain operator (namespace="{NS}") has held'
            " the leader Lease for 5m, or none is scraped: PostTrainJobs are not reconciled.",
        },
    }
    tests = [
        {
            "interval": "1m",
            "input_series": counters,
            "alert_rule_test": [
                alerts_at(12, "PostTrainReconcileErrors"),  # erring, not yet for 15m
                alerts_at(
                    20,
                    "PostTrainReconcileErrors",
                    {
                        "exp_labels": {"severity": "warning", "handler": "create"},
                        "exp_annotations": {
                            "summary": "posttrain operator handler failing",
                            "description": "20% of the posttrain operator's create handler"
                            " calls raise; the operator's log has the tracebacks.",
                        },
                    },
                ),
                alerts_at(9, "PostTrainNoLeader"),
                alerts_at(14, "PostTrainNoLeader"),  # leaderless for 4m
                alerts_at(16, "PostTrainNoLeader", no_leader),
            ],
        },
        {
            # Nothing of this install is scraped.
            "interval": "1m",
            "input_series": [
                {"series": 'posttrain_leader{namespace="other"}', "values": "1x20"},
            ],
            "alert_rule_test": [
                alerts_at(4, "PostTrainNoLeader"),
                alerts_at(
                    6,
                    "PostTrainNoLeader",
                    {
                        "exp_labels": {"severity": "warning", "namespace": NS},
                        "exp_annotations": no_leader["exp_annotations"],
                    },
                ),
            ],
        },
    ]
    promtool_test(tmp_path, rule_groups(render()), tests)


def test_promtool_no_progress_alert(tmp_path: Path) -> None:
    """A trainer that stops reporting: the operator's restart of its JobSet at 10m alerts
    at once, for the hour after, and then no more; a fail alerts on its own. Another
    install's (namespace) never alerts here."""
    exceeded = "posttrain_progress_deadline_exceeded_total"
    series = [
        {"series": f'{exceeded}{{action="restart",{OPERATOR}}}', "values": "0x9 1x100"},
        {"series": f'{exceeded}{{action="fail",{OPERATOR}}}', "values": "0x100"},
        {"series": f'{exceeded}{{action="fail",namespace="other"}}', "values": "0x9 1x100"},
    ]
    restarted = {
        "exp_labels": {"severity": "warning", "action": "restart"},
        "exp_annotations": {
            "summary": "a PostTrainJob's trainer stopped making progress",
            "description": "A PostTrainJob's trainer reported no progress within its"
            " spec.scheduling.progressDeadlineSeconds in the last hour (a hung collective or"
            " host), and the operator did: restart. kubectl get events -A --field-selector"
            " reason=ProgressDeadlineExceeded names the job, since when and its last step.",
        },
    }
    tests = [
        {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                alerts_at(9, "PostTrainJobNoProgress"),
                alerts_at(10, "PostTrainJobNoProgress", restarted),
                alerts_at(60, "PostTrainJobNoProgress", restarted),
                alerts_at(75, "PostTrainJobNoProgress"),
            ],
        }
    ]
    promtool_test(tmp_path, rule_groups(render()), tests)
