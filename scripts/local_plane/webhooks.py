"""CRDs and webhook configurations of controllers run on loopback (clientConfig.url)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from local_plane.build import module_dir
from local_plane.processes import State, apply_objects, kubectl
from local_plane.settings import JOBSET_VERSION, KUEUE_VERSION, ROOT

# --------------------------------------------------------------------------------------
# CRDs and webhooks
# --------------------------------------------------------------------------------------


def crd_files() -> list[Path]:
    """CRD YAMLs: JobSet and Kueue from the pinned modules, then the repo's crds/."""
    files = sorted(
        (module_dir("sigs.k8s.io/jobset", JOBSET_VERSION) / "config/components/crd/bases").glob(
            "*.yaml"
        )
    )
    files += sorted(
        (module_dir("sigs.k8s.io/kueue", KUEUE_VERSION) / "config/components/crd/bases").glob(
            "*.yaml"
        )
    )
    repo_crds = ROOT / "crds"
    if repo_crds.is_dir():
        files += sorted(p for p in repo_crds.rglob("*") if p.suffix in (".yaml", ".yml"))
    return files


def install_crds(
    extra: Iterable[Path] = (), *, force: bool = False, state: State | None = None
) -> list[Path]:
    """Apply the CRDs (server-side) and wait until they are Established.

    Skipped when the same files (by content hash) were applied to this control plane
    already, unless `force`. Returns the files.
    """
    import hashlib

    files = [f for f in [*crd_files(), *extra] if f.read_text().strip()]
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f).encode() + b"\0" + f.read_bytes())
    state = state or State.load()
    if not force and state.crd_hash == digest.hexdigest():
        return files
    if files:
        out = kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=posttrain-control-plane",
            "-o",
            "name",
            *[a for f in files for a in ("-f", str(f))],
        ).stdout
        crds = [n for n in out.split() if n.startswith("customresourcedefinition")]
        if crds:
            kubectl("wait", "--for=condition=Established", "--timeout=120s", *crds)
    state.crd_hash = digest.hexdigest()
    state.save()
    return files


def _json_pointer_set(doc: Any, pointer: str, value: Any, op: str) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    target = doc
    for p in parts[:-1]:
        target = target[int(p)] if isinstance(target, list) else target.setdefault(p, {})
    last = parts[-1]
    if isinstance(target, list):
        idx = len(target) if last == "-" else int(last)
        if op == "add":
            target.insert(idx, value)
        else:
            target[idx] = value
    else:
        target[last] = value


def register_url_webhooks(
    docs: Iterable[dict[str, Any]],
    *,
    url_base: str,
    ca_bundle: bytes,
    name_prefix: str,
    keep: Callable[[dict[str, Any]], bool] = lambda _w: True,
    namespace_selector: dict[str, Any] | None = None,
    failure_policy: str | None = None,
    apply: bool = True,
) -> list[dict[str, Any]]:
    """Point (Mutating|Validating)WebhookConfigurations at a webhook server on loopback.

    `docs` are the configurations as a controller ships them (clientConfig.service with a
    path); each becomes `clientConfig.url: {url_base}{path}` with `caBundle`, renamed
    `{name_prefix}{name}`. `keep(webhook)` filters webhooks; `namespace_selector` and
    `failure_policy` override those fields. Returns the objects (applied unless
    apply=False). Remove them with `delete_webhooks(name_prefix)`.
    """
    import base64

    out = []
    for doc in docs:
        if not doc or doc.get("kind") not in (
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ):
            continue
        obj = copy.deepcopy(doc)
        obj["metadata"] = {
            "name": name_prefix + doc["metadata"]["name"],
            "labels": {"app.kubernetes.io/managed-by": "posttrain-control-plane"},
        }
        hooks = []
        for wh in obj.get("webhooks", []):
            if not keep(wh):
                continue
            path = wh["clientConfig"].get("service", {}).get("path", "/")
            wh["clientConfig"] = {
                "url": url_base.rstrip("/") + path,
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
            if namespace_selector is not None:
                wh["namespaceSelector"] = namespace_selector
            if failure_policy is not None:
                wh["failurePolicy"] = failure_policy
            hooks.append(wh)
        obj["webhooks"] = hooks
        if hooks:
            out.append(obj)
    if apply:
        apply_objects(out)
    return out


def delete_webhooks(name_prefix: str) -> None:
    """Delete the (Mutating|Validating)WebhookConfigurations named `{name_prefix}...`."""
    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        out = kubectl("get", kind, "-o", "name", check=False, timeout=20).stdout or ""
        names = [n for n in out.split() if n.split("/", 1)[-1].startswith(name_prefix)]
        if names:
            kubectl("delete", *names, "--ignore-not-found", "--wait=false", check=False, timeout=20)


def _jobset_webhook_docs() -> list[dict[str, Any]]:
    """JobSet's webhooks with its kustomize JSON patches (pod objectSelector) applied."""
    import yaml

    webhook_dir = module_dir("sigs.k8s.io/jobset", JOBSET_VERSION) / "config/components/webhook"
    docs = [d for d in yaml.safe_load_all((webhook_dir / "manifests.yaml").read_text()) if d]
    kustomization = yaml.safe_load((webhook_dir / "kustomization.yaml").read_text()) or {}
    for patch in kustomization.get("patches", []):
        target = patch.get("target", {})
        ops = yaml.safe_load((webhook_dir / patch["path"]).read_text()) if "path" in patch else []
        for doc in docs:
            if doc["kind"] == target.get("kind") and doc["metadata"]["name"] == target.get("name"):
                for op in ops:
                    if op["op"] in ("add", "replace"):
                        _json_pointer_set(doc, op["path"], op["value"], op["op"])
    return docs
