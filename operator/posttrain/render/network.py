"""spec.network.restrictEgress: a NetworkPolicy that lets the job's pods reach only what
the job declares and what a trainer needs.

Egress from the job's pods (every pod labelled with the job's name) is allowed to:

- the cluster's DNS (kube-dns pods, port 53);
- the job's own pods (the JAX coordinator, Pathways, the other hosts);
- the namespaces of the in-cluster services the job names (spec.grpo's verifier and tool
  URLs, the MLflow tracking URI): a URL host ``name.namespace.svc[.cluster.local]``, or a
  bare ``name`` in the job's namespace. Every port there: a policy sees the pod's port,
  which a Service may map from the one in the URL;
- any address on TCP 443 and 6443: the API server the trainer reports to, object stores
  and model hubs (HTTPS, by name outside the cluster: a policy cannot name hosts);
- services outside the cluster the job names on other ports: any address outside the
  private and link-local ranges, on those ports;
- the node's metadata server on the ports GKE's Workload Identity answers on (80, 988),
  which the trainer's Google credentials come from.

Everything else in the cluster (other namespaces' pods, services on ports other than 443)
is refused, where the cluster's network plugin enforces NetworkPolicies.
"""

from __future__ import annotations

from typing import Any

from posttrain.api.spec import PostTrainJob
from posttrain.render.jobset import JOB_NAME_LABEL, RenderConfig, object_meta

PRIVATE = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"]
HTTPS_PORTS = (443, 6443)
METADATA = [("169.254.169.254/32", 80), ("169.254.169.252/32", 988)]


def declared_urls(job: PostTrainJob, default_mlflow_uri: str = "") -> list[str]:
    """The http(s) URLs the job's trainer calls: verifier rewards, tools, MLflow (the
    job's tracking URI, or the installation's default)."""
    spec, urls = job.spec, []
    if spec.grpo is not None:
        urls += [r.http.url for r in spec.grpo.rewards if r.http is not None]
        tools = spec.grpo.agent.tools if spec.grpo.agent else []
        urls += [t.http.url for t in tools if t.http is not None]
    mlflow = spec.tracking.mlflow if spec.tracking else None
    uri = (mlflow.tracking_uri or default_mlflow_uri) if mlflow is not None else ""
    if uri and uri.startswith(("http://", "https://")):
        urls.append(uri)
    return urls


def endpoint(url: str, namespace: str) -> tuple[str | None, int]:
    """(the namespace of an in-cluster service, None for a host outside the cluster; the
    URL's port)."""
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0]
    name, _, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
    if not name:
        name, port = host, ""
    number = int(port) if port else (443 if scheme == "https" else 80)
    labels = name.lower().rstrip(".").split(".")
    if len(labels) == 1 and not name.startswith("["):
        return namespace, number
    if len(labels) >= 3 and labels[2] == "svc":
        return labels[1], number
    return None, number


def network_policy(job: PostTrainJob, config: RenderConfig) -> dict[str, Any] | None:
    """The job's NetworkPolicy, or None when spec.network does not ask for one."""
    network = job.spec.network
    if network is None or not network.restrict_egress:
        return None
    name, namespace = job.metadata.name, job.metadata.namespace or "default"

    def own() -> dict[str, Any]:  # the job's pods (a new dict each time: no YAML anchors)
        return {"matchLabels": {JOB_NAME_LABEL: name}}

    rules: list[dict[str, Any]] = [
        {
            "to": [
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
            ],
            "ports": [{"protocol": p, "port": 53} for p in ("UDP", "TCP")],
        },
        {"to": [{"podSelector": own()}]},
    ]
    inside, outside = set(), set()
    for url in declared_urls(job, config.mlflow_tracking_uri):
        where, port = endpoint(url, namespace)
        if where is not None:
            inside.add(where)
        elif port not in HTTPS_PORTS:
            outside.add(port)
    for ns in sorted(inside):
        selector = {"matchLabels": {"kubernetes.io/metadata.name": ns}}
        rules.append({"to": [{"namespaceSelector": selector}]})
    rules.append({
        "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}],
        "ports": [{"protocol": "TCP", "port": p} for p in HTTPS_PORTS],
    })  # fmt: skip
    if outside:
        rules.append({
            "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": PRIVATE}}],
            "ports": [{"protocol": "TCP", "port": p} for p in sorted(outside)],
        })  # fmt: skip
    rules += [{"to": [{"ipBlock": {"cidr": cidr}}], "ports": [{"protocol": "TCP", "port": port}]}
              for cidr, port in METADATA]  # fmt: skip
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, f"{name}-egress"),
        "spec": {"podSelector": own(), "policyTypes": ["Egress"], "egress": rules},
    }
