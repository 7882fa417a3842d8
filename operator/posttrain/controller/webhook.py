"""The validating admission webhook server, on every replica.

It serves AdmissionReview v1 at WEBHOOK_PATH over TLS and answers with
`admission.admission_errors`. It runs from process start, independent of leader
election, so a standby replica behind the webhook Service answers too.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.controller.admission import (
    Exists,
    admission_errors,
    admission_warnings,
    reference_checks,
)
from posttrain.render.preflight import PreflightConfig

log = logging.getLogger("posttrain.webhook")
WEBHOOK_NAME = "validate-posttrainjob.posttrain.dev"
WEBHOOK_PATH = f"/{WEBHOOK_NAME}"
CONFIGURATION_NAME = "posttrain.dev"
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
# The installation's preflight settings (`posttrain operator` sets them before serving).
PREFLIGHT: PreflightConfig | None = None


def review_response(
    review: dict[str, Any],
    exists: Exists | None = None,
    preflight: PreflightConfig | None = None,
) -> dict[str, Any]:
    """The AdmissionReview answer for one request; pure given `exists`, which looks up
    the PriorityClass, WorkloadPriorityClass and LocalQueue a job names, and the
    installation's preflight settings (a TPU job compiled first is not refused for the
    fast estimate's memory figure)."""
    request = review.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    if request.get("operation") in ("CREATE", "UPDATE") and request.get("object"):
        errors = admission_errors(request["object"], request.get("oldObject"), preflight)
        warnings = [] if errors else admission_warnings(request["object"], preflight)
        if exists is not None and not errors:
            errors, missing = reference_checks(request["object"], exists, request.get("oldObject"))
            warnings += missing
        if warnings and not errors:
            response["warnings"] = warnings
        if errors:
            response = {
                **response,
                "allowed": False,
                "status": {
                    "code": 422,
                    "reason": "Invalid",
                    "message": "; ".join(str(e) for e in errors),
                },
            }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def webhook_entry(client_config: dict[str, Any]) -> dict[str, Any]:
    """The ValidatingWebhookConfiguration entry for this webhook."""
    return {
        "name": WEBHOOK_NAME,
        "clientConfig": client_config,
        "rules": [
            {
                "apiGroups": [GROUP],
                "apiVersions": [VERSION],
                "resources": [PLURAL],
                "operations": ["CREATE", "UPDATE"],
                "scope": "Namespaced",
            }
        ],
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 10,
    }


def kube_exists(kind: str, name: str, namespace: str | None) -> bool | None:
    """Whether a PriorityClass, Kueue WorkloadPriorityClass or LocalQueue exists, read
    with the operator's credentials (get only); None when the read failed otherwise."""
    from kubernetes.client.exceptions import ApiException

    from posttrain.controller import kube

    kueue = f"/apis/{KUEUE_GROUP}/{KUEUE_VERSION}"
    path = {
        "PriorityClass": f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}",
        "WorkloadPriorityClass": f"{kueue}/workloadpriorityclasses/{name}",
    }.get(kind) or f"{kueue}/namespaces/{namespace}/localqueues/{name}"
    try:
        kube.request("GET", path)
    except ApiException as e:
        if e.status == 404:
            return False
        log.warning("admission: cannot read %s %s: %s", kind, name, e.reason)
        return None
    return True


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server API)
        if self.path.split("?")[0] != WEBHOOK_PATH:
            self.send_error(404)
            return
        try:
            review = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            body = json.dumps(review_response(review, kube_exists, PREFLIGHT)).encode()
        except Exception as e:  # noqa: BLE001 - a bad request must not stop the server
            log.warning("bad admission request: %s", e)
            self.send_error(400)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve(address: str, port: int, certfile: str, keyfile: str) -> ThreadingHTTPServer:
    """Serve the webhook over TLS in a background thread."""
    server = ThreadingHTTPServer((address, port), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="webhook", daemon=True).start()
    log.info("admission webhook on https://%s:%d%s", address, port, WEBHOOK_PATH)
    return server


def register(host: str, port: int, ca_file: str) -> None:
    """Create or update the ValidatingWebhookConfiguration pointing at host:port (for
    clusters where the operator runs outside, e.g. the local control plane): sent by
    every replica that serves admission, the leader or not."""
    from kubernetes.client.exceptions import ApiException

    from posttrain.controller import kube

    ca = base64.b64encode(Path(ca_file).read_bytes()).decode()
    entry = webhook_entry({"url": f"https://{host}:{port}{WEBHOOK_PATH}", "caBundle": ca})
    body = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": CONFIGURATION_NAME, "labels": {"app.kubernetes.io/name": "posttrain"}},
        "webhooks": [entry],
    }
    collection = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
    try:
        kube.request("POST", collection, body, standby=True)
    except ApiException as e:
        if e.status != 409:
            raise
        path = f"{collection}/{CONFIGURATION_NAME}"
        kube.request("PATCH", path, body, content_type=kube.MERGE_PATCH, standby=True)
