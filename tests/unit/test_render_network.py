"""spec.network.restrictEgress: the NetworkPolicy rendered before the JobSet, and which
endpoints of the job it opens."""

import copy

import pytest

from posttrain.checks import validate
from posttrain.render import RenderConfig, render
from posttrain.render.network import endpoint, network_policy

PARAMS = {"type": "object", "properties": {"q": {"type": "string"}}}
JOB = {
    "apiVersion": "posttrain.dev/v1alpha1",
    "kind": "PostTrainJob",
    "metadata": {"name": "agent", "namespace": "team-a", "uid": "0000-21"},
    "spec": {
        "technique": "grpo",
        "model": {"source": "/models/m", "family": "llama3"},
        "data": {"source": "/data/d.jsonl"},
        "training": {"steps": 2, "batchSize": 2},
        "grpo": {
            "rewards": [{"type": "http", "http": {"url": "http://verifier.scoring.svc:8080/s"}}],
            "agent": {
                "maxTurns": 2,
                "tools": [
                    {"name": "calc", "type": "calculator"},
                    {"name": "near", "type": "http", "description": "Looks q up.", "parameters": PARAMS,
                     "http": {"url": "http://lookup:9000/x"}},
                    {"name": "far", "type": "http", "description": "Looks q up.", "parameters": PARAMS,
                     "http": {"url": "https://tools.example.com:8443/x"}},
                ],
            },
        },
        "tracking": {"mlflow": {"trackingUri": "http://mlflow.mlops.svc.cluster.local:5000"}},
        "network": {"restrictEgress": True},
        "output": {"uri": "/out"},
        "resources": {"accelerator": "cpu"},
    },
}  # fmt: skip


def _job(doc):
    job, errors = validate(doc)
    assert not errors, errors
    return job


@pytest.mark.parametrize(
    "url,expected",
    [
        ("http://verifier.scoring.svc:8080/score", ("scoring", 8080)),
        ("http://verifier.scoring.svc.cluster.local/score", ("scoring", 80)),
        ("https://lookup/x", ("team-a", 443)),  # a bare name: a Service of the job's namespace
        ("https://api.example.com/v1", (None, 443)),
        ("http://10.0.0.7:9000/x", (None, 9000)),
        ("http://[fd00::1]:9000/x", (None, 9000)),
    ],
)
def test_which_urls_are_in_the_cluster(url, expected):
    assert endpoint(url, "team-a") == expected


def test_no_policy_unless_the_job_asks():
    doc = copy.deepcopy(JOB)
    del doc["spec"]["network"]
    assert network_policy(_job(doc), RenderConfig()) is None
    assert [o["kind"] for o in render(_job(doc))] == ["JobSet"]


def test_the_policy_opens_what_the_job_names_and_comes_first():
    objs = render(_job(JOB))
    assert [o["kind"] for o in objs] == ["NetworkPolicy", "JobSet"]
    policy = objs[0]
    pods = policy["spec"]["podSelector"]["matchLabels"]
    template = objs[1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pods.items() <= template["metadata"]["labels"].items()  # it selects the trainers
    rules = policy["spec"]["egress"]
    namespaces = {
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for rule in rules for peer in rule["to"]
        if peer.get("namespaceSelector", {}).get("matchLabels")
    }  # fmt: skip
    assert namespaces == {"scoring", "team-a", "mlops"}
    ports = {(p["protocol"], p["port"]) for r in rules for p in r.get("ports", [])}
    assert {("UDP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", 8443)} <= ports
    assert ("TCP", 8080) not in ports  # in the cluster: the namespace, any port
    outside = next(r for r in rules if ("TCP", 8443) in {(p["protocol"], p["port"])
                                                         for p in r.get("ports", [])})  # fmt: skip
    assert "10.0.0.0/8" in outside["to"][0]["ipBlock"]["except"]
    owner = policy["metadata"]["ownerReferences"]  # deleted with the job
    assert owner == objs[1]["metadata"]["ownerReferences"] and owner[0]["uid"] == "0000-21"
