"""Generate the PostTrainJob CustomResourceDefinition from the pydantic models.

The output is a structural OpenAPI v3 schema as Kubernetes expects it: $refs inlined,
optional fields plain (no null unions), descriptions from field docstrings, enums,
defaults (including `{}` for nested blocks so their defaults apply), and the CEL rules
of `posttrain.api.rules`; after it in the same file, the admission policy that keeps the
immutable fields of a created job as they were. `crds/` holds the result; a test fails
when it is stale.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from posttrain.api import rules, spec
from posttrain.yaml_out import dump_yaml

CRD_FILE = "posttrain.dev_posttrainjobs.yaml"
POLICY_NAME = f"{spec.PLURAL}-immutable-fields.{spec.GROUP}"

PRINTER_COLUMNS = [
    {"name": "Technique", "type": "string", "jsonPath": ".spec.technique"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
    {"name": "Accelerator", "type": "string", "jsonPath": ".spec.resources.accelerator"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Total", "type": "integer", "jsonPath": ".status.progress.totalSteps"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {
        "name": "ETA",
        "type": "integer",
        "jsonPath": ".status.progress.etaSeconds",
        "description": "Estimated seconds to finish",
        "priority": 1,
    },
    {"name": "Eval", "type": "number", "jsonPath": ".status.progress.evalLoss", "priority": 1},
    {
        "name": "Goodput",
        "type": "number",
        "jsonPath": ".status.progress.goodput",
        "description": "Fraction of the wall time spent on kept optimizer steps",
        "priority": 1,
    },
    {"name": "JobSet", "type": "string", "jsonPath": ".status.jobSetName", "priority": 1},
    {
        "name": "Preflight",
        "type": "string",
        "jsonPath": ".status.preflight.result",
        "description": "The TPU compiler's answer before the job took TPUs (spec.preflight)",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # Last: kubectl prints it whole (no truncation), so the operator keeps it to one line
    # of at most 200 characters (posttrain.controller.phase.MESSAGE_MAX).
    {
        "name": "Message",
        "type": "string",
        "jsonPath": ".status.message",
        "description": "Why the job is in its phase",
    },
]

_DROP = {"title", "additionalProperties"}


def _model_classes() -> dict[str, type[BaseModel]]:
    return {
        name: obj
        for name, obj in vars(spec).items()
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel
    }


def _object_defaults(cls: type[BaseModel]) -> set[str]:
    """Wire names of fields whose default is an empty nested object."""
    out = set()
    for name, field in cls.model_fields.items():
        factory = field.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            out.add(field.alias or name)
    return out


def _structural(node: Any, defs: dict[str, Any], classes: dict[str, type[BaseModel]]) -> Any:
    """Inline $refs and turn a pydantic JSON schema node into a structural one."""
    if isinstance(node, list):
        return [_structural(n, defs, classes) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        name = node.pop("$ref").rsplit("/", 1)[-1]
        target = copy.deepcopy(defs[name])
        target.update(node)  # the field's description wins over the class docstring
        target["x-posttrain-class"] = name
        node = target
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"unsupported union in schema: {options}")
        if node.get("default", ...) is None:
            node.pop("default")
        merged = {**options[0], **node}
        return _structural(merged, defs, classes)
    if "exclusiveMinimum" in node:
        node["minimum"] = node.pop("exclusiveMinimum")
        node["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node:
        node["maximum"] = node.pop("exclusiveMaximum")
        node["exclusiveMaximum"] = True
    cls = classes.get(node.pop("x-posttrain-class", ""))
    out = {k: _structural(v, defs, classes) for k, v in node.items() if k not in _DROP}
    if isinstance(node.get("additionalProperties"), dict) and "properties" not in node:
        # A map (dict[str, X]): its values' schema, or the API server prunes every key.
        out["additionalProperties"] = _structural(node["additionalProperties"], defs, classes)
    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {
            k: _structural(v, defs, classes) for k, v in node["properties"].items()
        }
        if cls is not None:
            for key in _object_defaults(cls):
                out["properties"][key].setdefault("default", {})
    if "enum" in out:
        out.setdefault("type", "string")
    if isinstance(out.get("description"), str):  # not a property named description
        out["description"] = " ".join(out["description"].split())
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    classes = _model_classes()
    raw["x-posttrain-class"] = model.__name__
    return _structural(raw, defs, classes)


def _cel(rule_list: list[rules.Rule]) -> list[dict[str, str]]:
    out = []
    for r in rule_list:
        rule = {"rule": r.cel, "message": r.message, "fieldPath": "." + r.field}
        if r.message_cel:
            rule["messageExpression"] = r.message_cel
        out.append(rule)
    return out


def spec_schema() -> dict[str, Any]:
    schema = openapi_schema(spec.PostTrainJobSpec)
    reward = schema["properties"]["grpo"]["properties"]["rewards"]["items"]
    reward["x-kubernetes-validations"] = _cel(rules.REWARD_RULES)
    agent = schema["properties"]["grpo"]["properties"]["agent"]
    agent["x-kubernetes-validations"] = _cel(rules.AGENT_RULES)
    agent["properties"]["tools"]["items"]["x-kubernetes-validations"] = _cel(rules.TOOL_RULES)
    schema["x-kubernetes-validations"] = _cel(rules.RULES)
    return schema


def status_schema() -> dict[str, Any]:
    schema = openapi_schema(spec.PostTrainJobStatus)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions.pop("default", None)
    return schema


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{spec.PLURAL}.{spec.GROUP}",
            "labels": {"app.kubernetes.io/name": "posttrain"},
        },
        "spec": {
            "group": spec.GROUP,
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.SINGULAR,
                "shortNames": spec.SHORT_NAMES,
                "categories": ["posttrain"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": spec.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": spec.PostTrainJob.__doc__,
                            "required": ["spec"],
                            "x-kubernetes-validations": [
                                {"rule": rules.NAME_CEL, "message": rules.NAME_MESSAGE}
                            ],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def immutable_fields_policy() -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy and its binding that refuse an update setting,
    removing or changing a `rules.IMMUTABLE` field of a job.

    Not transition rules in the CRD: the API server runs a CRD's rules on every write of
    the status too, and these 16 made each status patch cost 12.7-14.3 ms of its CPU
    instead of 10.5-11.6 (`bench/operator.py --write-costs`). The policy matches the job itself only,
    never `posttrainjobs/status`, so the operator's and the trainers' status writes skip
    it. It travels in the same file as the CRD, so whatever installs the CRD installs it."""
    labels = {"app.kubernetes.io/name": "posttrain"}
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME, "labels": labels},
        "spec": {
            "failurePolicy": "Fail",
            # With the API server's defaults written out: matchConstraints is atomic, so
            # an apply by a second field manager (the CRD file by one tool, the
            # kustomize base by another) would conflict with the defaulted value.
            "matchConstraints": {
                "matchPolicy": "Equivalent",
                "namespaceSelector": {},
                "objectSelector": {},
                "resourceRules": [
                    {
                        "apiGroups": [spec.GROUP],
                        "apiVersions": ["*"],
                        "operations": ["UPDATE"],
                        "resources": [spec.PLURAL],
                        "scope": "*",
                    }
                ],
            },
            "validations": [
                {
                    "expression": rules.immutable_cel(path),
                    "message": rules.immutable_message(path),
                    "reason": "Invalid",
                }
                for path in rules.IMMUTABLE
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME, "labels": labels},
        "spec": {"policyName": POLICY_NAME, "validationActions": ["Deny"]},
    }
    return [policy, binding]


def crd_yaml() -> str:
    """The CRD and the admission policy of its immutable fields, as one YAML file."""
    header = "# Generated by `posttrain crd` from posttrain.api.spec; do not edit.\n"
    return header + dump_yaml([crd(), *immutable_fields_policy()])
