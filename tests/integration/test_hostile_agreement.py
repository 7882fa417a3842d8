"""One contract: the hostile corpus through `posttrain validate`, the real API server with
the CRD and the admission webhook registered, and the operator.

For every case the API server (CRD schema, CEL, then the webhook) must refuse exactly
what validate refuses, naming the same field; every job it admits must get a JobSet and
a phase from the operator.
"""

from __future__ import annotations

import base64
import json

import pytest
from hostile_jobs import CASES, Hostile
from operator_process import OperatorProcess, free_port

from posttrain.checks import printable, validate
from posttrain.controller.webhook import CONFIGURATION_NAME
from tests.cluster import Cluster, self_signed, unique_name, wait_for

pytestmark = pytest.mark.integration
GROUP, VERSION, PLURAL = "posttrain.dev", "v1alpha1", "posttrainjobs"


@pytest.fixture(scope="module")
def hooked(apiserver: Cluster, tmp_path_factory: pytest.TempPathFactory):
    """A namespace whose PostTrainJobs go through the webhook of a running operator (the
    webhook configuration is narrowed to that namespace, so other tests are untouched)."""
    namespace = apiserver.create_namespace("hostile")
    tmp = tmp_path_factory.mktemp("hostile")
    cert, key = self_signed(tmp / "certs")
    port = free_port()
    op = OperatorProcess(
        apiserver.kubeconfig, tmp, namespace, "-n", namespace,
        "--webhook-port", str(port), "--webhook-address", "127.0.0.1",
        "--webhook-host", "127.0.0.1", "--webhook-cert", str(cert), "--webhook-key", str(key),
        "--webhook-ca", str(cert), "--webhook-register", identity="hostile",
    ).start()  # fmt: skip
    try:

        def registered() -> bool:
            vwc = apiserver.get("validatingwebhookconfiguration", CONFIGURATION_NAME)
            return any(base64.b64decode(w["clientConfig"].get("caBundle", "")) for w in vwc["webhooks"])  # fmt: skip

        wait_for(registered, timeout=30, describe=op.logs)
        selector = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        patch = [{"op": "add", "path": "/webhooks/0/namespaceSelector", "value": selector}]
        apiserver.kubectl(
            "patch", "validatingwebhookconfiguration", CONFIGURATION_NAME,
            "--type=json", "-p", json.dumps(patch),
        )  # fmt: skip
        probe = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PostTrainJob",
                 "metadata": {"name": "probe"}, "spec": {"model": {"source": "/m"},
                 "data": {"source": "/d"}, "output": {"uri": "/o"},
                 "resources": {"accelerator": "v6e-300"}}}  # fmt: skip

        def webhook_answers() -> bool:
            proc = create(apiserver, namespace, json.dumps(probe))
            return proc.returncode != 0 and "admission webhook" in proc.stderr

        wait_for(webhook_answers, timeout=30, describe=op.logs)
        yield apiserver, namespace, op
    finally:
        op.stop()
        apiserver.kubectl(
            "delete", "validatingwebhookconfiguration", CONFIGURATION_NAME, check=False
        )
        apiserver.delete_namespace(namespace)


def create(apiserver: Cluster, namespace: str, text: str):
    return apiserver.kubectl(
        "create", "-n", namespace, "--validate=strict", "-f", "-", input=text, check=False
    )


# kubectl itself refuses YAML whose values JSON cannot carry (NaN, infinities) before
# anything reaches the API server; its message names no field.
KUBECTL_REFUSES = "error converting YAML to JSON"


def names_field(message: str, field: str) -> bool:
    """The server's message names `field` (as written, JSON-quoted or escaped); a label's
    type error names metadata.labels."""
    forms = {field, json.dumps(field)[1:-1], printable(field), field.split("[")[0]}
    if field.startswith("metadata.labels."):
        forms.add("metadata.labels")
    return any(f in message for f in forms) or KUBECTL_REFUSES in message


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_api_server_agrees_with_validate(hooked, case: Hostile):
    apiserver, namespace, _ = hooked
    name = unique_name(case.id, 22)
    _, errors = validate(case.doc(name))
    refused = bool(errors)
    assert refused == (case.field is not None), [str(e) for e in errors]
    text = case.yaml(name) if case.text is not None else json.dumps(case.doc(name))
    proc = create(apiserver, namespace, text)
    if not refused:
        assert proc.returncode == 0, f"validate accepts, the API server refuses: {proc.stderr}"
        return
    assert proc.returncode != 0, f"validate refuses {[str(e) for e in errors]}, the server admits"
    assert case.field is not None and names_field(proc.stderr, case.field), proc.stderr


def test_admitted_jobs_get_a_jobset_and_a_phase(hooked):
    apiserver, namespace, op = hooked
    admitted = [c for c in CASES if c.field is None]
    assert len(admitted) >= 10
    for case in admitted:
        doc = case.doc(unique_name(f"ok-{case.id}", 22))
        name = doc["metadata"]["name"]  # some cases set the name themselves
        text = case.yaml(name) if case.text is not None else json.dumps(doc)
        proc = create(apiserver, namespace, text)
        assert proc.returncode == 0, proc.stderr

        def answered(name: str = name) -> str | None:
            job = apiserver.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name
            )
            return (job.get("status") or {}).get("phase")

        phase = wait_for(answered, timeout=60, describe=op.logs, what=f"a phase for {case.id}")
        assert phase in ("Pending", "Queued", "Suspended"), (case.id, phase)
        apiserver.get_jobset(name, namespace)
