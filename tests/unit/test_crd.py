"""The CRD in crds/ is exactly what the pydantic models generate."""

import json
from pathlib import Path

import yaml

from posttrain.api import crd, rules

CRDS = Path(__file__).parent.parent.parent / "crds"


def test_crd_file_is_fresh():
    path = CRDS / crd.CRD_FILE
    assert path.read_text() == crd.crd_yaml(), (
        "crds/ is stale: run `posttrain crd > crds/posttrain.dev_posttrainjobs.yaml`"
    )


def _walk(node, path="spec"):
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{key}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural():
    version = crd.crd()["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(root["properties"]["spec"]):
        assert "type" in node, f"{path} has no type"
        for banned in ("$ref", "anyOf", "allOf", "oneOf", "additionalProperties", "title"):
            assert banned not in node, f"{path} has {banned}"


def test_every_spec_field_is_described():
    root = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing = [
        p
        for p, n in _walk(root["properties"]["spec"])
        if "description" not in n and not p.endswith("[]")
    ]
    assert missing == []


def test_nested_blocks_default_to_empty_objects():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for block in ("training", "checkpoint", "resources", "scheduling"):
        assert spec["properties"][block]["default"] == {}
    assert "default" not in spec["properties"]["lora"]  # absent lora = full fine-tune


def test_printer_columns_and_names():
    version = crd.crd()["spec"]["versions"][0]
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols["Step"] == ".status.progress.step"
    assert cols["Loss"] == ".status.progress.loss"
    assert cols["Goodput"] == ".status.progress.goodput"
    wide = {c["name"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1}
    assert {"ETA", "Eval", "Goodput", "JobSet"} <= wide  # kubectl get -o wide only
    assert list(cols)[:4] == ["Technique", "Model", "Accelerator", "Phase"]
    assert list(cols)[-1] == "Message" and cols["Message"] == ".status.message"
    assert version["subresources"] == {"status": {}}
    assert crd.crd()["spec"]["names"]["shortNames"] == ["ptj"]


def test_cel_rules_carried_into_crd():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    cel = {v["rule"] for v in spec["x-kubernetes-validations"]}
    assert {r.cel for r in rules.RULES} <= cel


def test_no_transition_rules_in_the_crd():
    """The API server runs a CRD's rules on status writes too: rules that compare with
    oldSelf would make every status patch pay for them (the admission policy holds them)."""
    assert "oldSelf" not in json.dumps(crd.crd())


def test_immutable_fields_policy_matches_updates_of_the_job_only():
    policy, binding = crd.immutable_fields_policy()
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["posttrainjobs"] and rule["operations"] == ["UPDATE"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert [v["expression"] for v in policy["spec"]["validations"]] == [
        rules.immutable_cel(p) for p in rules.IMMUTABLE
    ]
    assert binding["spec"] == {"policyName": crd.POLICY_NAME, "validationActions": ["Deny"]}
    docs = list(yaml.safe_load_all(crd.crd_yaml()))
    assert [d["kind"] for d in docs] == [
        "CustomResourceDefinition",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]


def test_immutable_cel_guards_nested_fields():
    assert rules.immutable_cel("model") == (
        "has(object.spec.model) == has(oldObject.spec.model) && "
        "(!has(object.spec.model) || object.spec.model == oldObject.spec.model)"
    )
    nested = rules.immutable_cel("scheduling.queue")
    assert nested.startswith(
        "(has(object.spec.scheduling) && has(object.spec.scheduling.queue)) == "
        "(has(oldObject.spec.scheduling) && has(oldObject.spec.scheduling.queue))"
    )
