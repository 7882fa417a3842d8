"""The posttrain CLI: validate, render, crd."""

import subprocess
import sys
from pathlib import Path

import yaml
from invalid_jobs import CASES

ROOT = Path(__file__).parent.parent.parent


def posttrain(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *args], cwd=cwd, capture_output=True, text=True
    )


def test_validate_examples_ok():
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.yaml"))
    assert examples
    r = posttrain("validate", *examples)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": valid") == len(examples)


def test_validate_reports_every_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    doc = next(c for c in CASES if c.id == "steps-zero").doc()
    doc["spec"]["lora"] = {"rank": 0}
    bad.write_text(yaml.safe_dump(doc))
    r = posttrain("validate", str(bad))
    assert r.returncode == 1
    assert str(bad) in r.stderr
    assert "spec.training.steps" in r.stderr and "spec.lora.rank" in r.stderr


def test_validate_yaml_syntax_error(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("spec: [unclosed\n")
    r = posttrain("validate", str(bad))
    assert r.returncode == 1 and "(yaml)" in r.stderr


def test_render_prints_objects():
    r = posttrain("render", "tests/golden/jobs/v5e-8.yaml", "-n", "other")
    assert r.returncode == 0, r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout)]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "JobSet"]
    assert all(d["metadata"]["namespace"] == "other" for d in yaml.safe_load_all(r.stdout))


def test_crd_matches_file():
    r = posttrain("crd")
    assert r.returncode == 0
    assert r.stdout == (ROOT / "crds" / "posttrain.dev_posttrainjobs.yaml").read_text()
