"""The generated CRD and the rendered manifests against a real kube-apiserver.

- every golden JobSet passes a server-side dry-run create, so the renderer's output is
  valid against the real JobSet CRD and core schemas;
- every invalid job that the CRD schema or its CEL rules should catch is refused, and the
  API server's message names the field;
- kubectl shows the printer columns and `kubectl explain` the descriptions;
- immutable fields are refused on update (by the admission policy that comes in the
  CRD's file) while suspend may change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from invalid_jobs import CASES, valid_job

from tests.cluster import Cluster

pytestmark = pytest.mark.integration
GOLDEN = Path(__file__).parent.parent / "golden" / "rendered"


def _create(
    apiserver: Cluster, obj: dict, namespace: str, dry_run: bool = False, check: bool = True
):
    args = ["create", "-f", "-", "-n", namespace, "--validate=strict"]
    if dry_run:
        args.append("--dry-run=server")
    return apiserver.kubectl(*args, input=json.dumps(obj), check=check)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.yaml")), ids=lambda p: p.stem)
def test_golden_objects_pass_server_dry_run(apiserver: Cluster, namespace: str, path: Path):
    for obj in yaml.safe_load_all(path.read_text()):
        obj["metadata"]["namespace"] = namespace
        obj["metadata"].pop("ownerReferences", None)  # the owner does not exist here
        for subject in obj.get("subjects", []):
            subject["namespace"] = namespace
        out = _create(apiserver, obj, namespace, dry_run=True).stdout
        assert "(server dry run)" in out, out


@pytest.mark.parametrize("case", [c for c in CASES if c.server], ids=lambda c: c.id)
def test_crd_refuses_invalid_job(apiserver: Cluster, namespace: str, case):
    proc = _create(apiserver, case.doc(), namespace, check=False)
    assert proc.returncode != 0, f"{case.id} was accepted: {proc.stdout}"
    err = proc.stderr
    field = case.field.replace("[0]", "[0]")
    assert field in err or field.split("[")[0] in err, err
    if "needs" in case.message or "only allowed" in case.message or "must" in case.message:
        assert case.message in err, err


def test_valid_job_gets_defaults(apiserver: Cluster, namespace: str):
    _create(apiserver, valid_job("defaults"), namespace)
    job = apiserver.get("ptj", "defaults", namespace)
    spec = job["spec"]
    assert spec["technique"] == "sft"
    assert spec["training"]["steps"] == 1000 and spec["training"]["schedule"] == "cosine"
    assert spec["checkpoint"] == {"everySteps": 500, "keep": 3, "async": True}
    assert spec["resources"]["accelerator"] == "cpu"
    assert "lora" not in spec


def test_printer_columns(apiserver: Cluster, namespace: str):
    _create(apiserver, valid_job("columns"), namespace)
    progress = {"step": 120, "totalSteps": 1000, "loss": 1.25, "goodput": 0.875}
    status = {"phase": "Running", "progress": progress}
    apiserver.custom.patch_namespaced_custom_object_status(
        "posttrain.dev", "v1alpha1", namespace, "posttrainjobs", "columns", {"status": status}
    )
    out = apiserver.kubectl("get", "ptj", "-n", namespace).stdout.splitlines()
    header = out[0].split()
    assert header == [
        "NAME",
        "TECHNIQUE",
        "MODEL",
        "ACCELERATOR",
        "PHASE",
        "STEP",
        "TOTAL",
        "LOSS",
        "AGE",
        "MESSAGE",
    ]
    row = out[1].split()
    assert row[:8] == ["columns", "sft", "/models/tiny", "cpu", "Running", "120", "1000", "1.25"]
    wide = apiserver.kubectl("get", "posttrainjobs", "-n", namespace, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    assert {"ETA", "EVAL", "GOODPUT", "JOBSET"} <= set(header.split())
    # Empty cells are blank: read the column where it is.
    assert row[header.index("GOODPUT") : header.index("JOBSET")].strip() == "0.875"


def test_explain_reads_descriptions(apiserver: Cluster):
    out = apiserver.kubectl("explain", "posttrainjob.spec.lora").stdout
    assert "absent means a full fine-tune" in out and "rank" in out and "targetModules" in out
    out = apiserver.kubectl("explain", "ptj.spec.resources.accelerator").stdout
    assert "v6e-256" in out


def test_immutable_fields_refused_mutable_ones_allowed(apiserver: Cluster, namespace: str):
    job = valid_job("immutable")
    job["spec"]["image"] = "registry.example.com/posttrain-trainer:1.0"
    _create(apiserver, job, namespace)

    def patch(spec: dict, check: bool):
        return apiserver.kubectl(
            "patch",
            "ptj",
            "immutable",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": spec}),
            check=check,
        )

    bad = patch({"model": {"source": "/models/other"}}, check=False)
    assert bad.returncode != 0
    assert "spec.model cannot change after the job is created" in bad.stderr
    # The pods' PriorityClass is part of the JobSet's pod templates, which cannot change.
    bad = patch({"scheduling": {"priorityClass": "other"}}, check=False)
    assert bad.returncode != 0
    assert "spec.scheduling.priorityClass cannot change" in bad.stderr
    # Setting a field the job was created without is a change too (a full fine-tune
    # would silently become LoRA), and so is removing one.
    bad = patch({"lora": {"rank": 8}}, check=False)
    assert "spec.lora cannot change" in bad.stderr
    bad = patch({"image": None}, check=False)
    assert "spec.image cannot change" in bad.stderr
    # The policy matches the job, not its status: status writes do not pay for it.
    status = apiserver.kubectl(
        "patch",
        "ptj",
        "immutable",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"phase": "Pending", "message": "waiting"}}),
    )
    assert "patched" in status.stdout
    ok = patch(
        {
            "scheduling": {
                "suspend": True,
                "workloadPriorityClass": "low",
                "ttlSecondsAfterFinished": 60,
            }
        },
        check=True,
    )
    assert "patched" in ok.stdout
