"""The chart's monitoring objects as a user installs them: the Grafana dashboard and the
PrometheusRule rendered by `helm template`, and the metric names their queries use.

Shared by tests/unit/test_monitoring.py (promtool on the rules) and
tests/integration/test_metrics.py (every name is one the running operator exports).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "posttrain"
HELM = ROOT / ".cache" / "control-plane" / "bin" / "helm"
BUILD_HELM = "python scripts/control_plane.py build helm"
NS = "posttrain-system"
ENABLED = {"metrics.dashboard.enabled": "true", "metrics.prometheusRule.enabled": "true"}

# A PromQL selector `name{...}` or `name[...]`; the chart writes every metric with one.
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*[{\[]")
# Words before a brace that are not metric names: label matchers inside another
# selector never precede `{`, so only these can.
_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def render(values: dict[str, str] | None = None, namespace: str = NS) -> list[dict[str, Any]]:
    """`helm template` of the chart with the dashboard and the rules on, plus `values`
    (fresh objects per call)."""
    if not HELM.is_file():
        pytest.fail(f"helm is missing: run `{BUILD_HELM}` (builds {HELM})", pytrace=False)
    text = _template(tuple({**ENABLED, **(values or {})}.items()), namespace)
    return [d for d in yaml.safe_load_all(text) if d]


@functools.cache
def _template(values: tuple[tuple[str, str], ...], namespace: str) -> str:
    sets = [a for k, v in values for a in ("--set", f"{k}={v}")]
    proc = subprocess.run(
        [str(HELM), "template", "posttrain", str(CHART), "--namespace", namespace, *sets],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (hit,) = [d for d in docs if d["kind"] == kind]
    return hit


def rule_groups(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The PrometheusRule's spec: a Prometheus rule file (`groups:`)."""
    return one(docs, "PrometheusRule")["spec"]


def dashboard(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (text,) = one(docs, "ConfigMap")["data"].values()
    return json.loads(text)


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["query"]["query"]))
    return exprs


def rule_exprs(groups: dict[str, Any]) -> list[str]:
    return [r["expr"] for g in groups["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (every one written as `name{...}`)."""
    return {m for m in _SELECTOR.findall(expr) if m not in _NOT_METRICS}


def used_metric_names() -> set[str]:
    """Every metric name the default dashboard and rules use."""
    docs = render()
    exprs = dashboard_exprs(dashboard(docs)) + rule_exprs(rule_groups(docs))
    return set().union(*map(metric_names, exprs))
