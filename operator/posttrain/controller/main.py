"""`posttrain operator`: metrics/health endpoint, admission, kopf's watches on every
replica, and leader election deciding which one acts.

Settings come from flags, with environment defaults for the chart:
POSTTRAIN_TRAINER_IMAGE_CPU / _TPU / _GPU (the trainer image per accelerator kind),
POSTTRAIN_PATHWAYS_SERVER_IMAGE, POSTTRAIN_PATHWAYS_PROXY_IMAGE,
POSTTRAIN_PATHWAYS_HEAD_NODE_POOL, POSTTRAIN_DEFAULT_QUEUE, POSTTRAIN_MLFLOW_TRACKING_URI (the
MLflow tracking server of jobs that name none), POSTTRAIN_LEASE_NAMESPACE, POD_NAME.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes import config as kube_config

from posttrain.controller import (
    handlers,
    kube,
    metrics,
    reconcile,
    watches,
    webhook,
)
from posttrain.controller.leader import LeaseElector
from posttrain.render import RenderConfig
from posttrain.render.preflight import PreflightConfig

LEASE_NAME = "posttrain-operator"


class JsonFormatter(logging.Formatter):
    """One JSON object per line. Secrets never reach a log: the operator only ever
    handles Secret references, never their values."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("k8s_ref",):
            if hasattr(record, key):
                entry["object"] = str(getattr(record, key))
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("POSTTRAIN_LOG_LEVEL", "INFO"))
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if root.level > logging.DEBUG:  # kopf reports every handler call at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def _load_kube_config() -> None:
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()


def preflight_config(env: Mapping[str, str]) -> PreflightConfig:
    """The installation's preflight settings from the operator's environment (the
    chart's `preflight` values): POSTTRAIN_PREFLIGHT_COMPILE (true/false),
    POSTTRAIN_PREFLIGHT_TIMEOUT_SECONDS, POSTTRAIN_PREFLIGHT_CPU,
    POSTTRAIN_PREFLIGHT_MEMORY, POSTTRAIN_PREFLIGHT_NODE_SELECTOR (JSON object).
    ValueError naming the variable for a value it cannot take."""
    defaults = PreflightConfig()
    flag = env.get("POSTTRAIN_PREFLIGHT_COMPILE", "").strip().lower()
    if flag not in ("", "true", "false"):
        raise ValueError(f"POSTTRAIN_PREFLIGHT_COMPILE: expected true or false, not {flag!r}")
    timeout = env.get("POSTTRAIN_PREFLIGHT_TIMEOUT_SECONDS", "").strip()
    if timeout and (not timeout.isdigit() or int(timeout) < 1):
        raise ValueError(
            f"POSTTRAIN_PREFLIGHT_TIMEOUT_SECONDS: expected a whole number of seconds, "
            f"not {timeout!r}"
        )
    selector_text = env.get("POSTTRAIN_PREFLIGHT_NODE_SELECTOR", "").strip()
    try:
        selector = json.loads(selector_text) if selector_text else {}
    except ValueError:
        selector = None
    if not isinstance(selector, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
    ):
        raise ValueError(
            "POSTTRAIN_PREFLIGHT_NODE_SELECTOR: expected a JSON object of label values"
        )
    return PreflightConfig(
        compile=flag == "true" if flag else defaults.compile,
        timeout_seconds=int(timeout) if timeout else defaults.timeout_seconds,
        cpu=env.get("POSTTRAIN_PREFLIGHT_CPU") or defaults.cpu,
        memory=env.get("POSTTRAIN_PREFLIGHT_MEMORY") or defaults.memory,
        node_selector=selector,
    )


def _render_config() -> RenderConfig:
    defaults = RenderConfig()
    env = {
        "trainer_image_cpu": "POSTTRAIN_TRAINER_IMAGE_CPU",
        "trainer_image_tpu": "POSTTRAIN_TRAINER_IMAGE_TPU",
        "trainer_image_gpu": "POSTTRAIN_TRAINER_IMAGE_GPU",
        "pathways_server_image": "POSTTRAIN_PATHWAYS_SERVER_IMAGE",
        "pathways_proxy_image": "POSTTRAIN_PATHWAYS_PROXY_IMAGE",
        "pathways_head_node_pool": "POSTTRAIN_PATHWAYS_HEAD_NODE_POOL",
        "default_queue": "POSTTRAIN_DEFAULT_QUEUE",
        "trainer_cluster_role": "POSTTRAIN_TRAINER_CLUSTER_ROLE",
        "allowed_function_modules": "POSTTRAIN_ALLOWED_FUNCTION_MODULES",
        "mlflow_tracking_uri": "POSTTRAIN_MLFLOW_TRACKING_URI",
    }
    return dataclasses.replace(
        defaults, **{k: os.environ[v] for k, v in env.items() if os.environ.get(v)}
    )


def _settings(args: argparse.Namespace) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.level = logging.INFO
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 5
    settings.watching.server_timeout = 120
    settings.watching.reconnect_backoff = 1.0
    # Lists come in pages (limit/continue): a replica starting with every job, JobSet and
    # pod to list never holds a whole kind's list at once.
    settings.watching.chunk_size = 100
    settings.persistence.diffbase_storage = NoDiffBase()
    watches.selectors(settings)
    return settings


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's copy of "what was handled last", for diffs of on.create/on.update handlers.
    This operator registers none (only event and index handlers), yet kopf's default
    storage deep-copies every object on every event to build it (a tenth of the
    operator's CPU in a burst of new jobs): keep nothing, store nothing."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


def operator_command(args: argparse.Namespace) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps stacks
    _configure_logging()
    try:
        _load_kube_config()
    except (kube_config.ConfigException, OSError) as e:
        print(
            f"posttrain operator: no Kubernetes cluster configured ({' '.join(str(e).split())}):"
            " run it in a pod, or set KUBECONFIG",
            file=sys.stderr,
        )
        return 1
    reconcile.State.render_config = _render_config()
    try:
        reconcile.State.preflight = webhook.PREFLIGHT = preflight_config(os.environ)
    except ValueError as e:
        print(f"posttrain operator: {e}", file=sys.stderr)
        return 1
    metrics.serve(args.metrics_port)
    log = logging.getLogger("posttrain.operator")
    if args.webhook_port:
        # Every replica answers admission, leader or not.
        webhook.serve(args.webhook_address, args.webhook_port, args.webhook_cert, args.webhook_key)
        if args.webhook_register:
            webhook.register(
                args.webhook_host or args.webhook_address,
                args.webhook_port,
                args.webhook_ca or args.webhook_cert,
            )

    # Every replica watches and keeps its indexes warm; only the Lease's holder acts
    # (reconciles, writes, posts Events). The Lease thread switches that at once.
    settings = _settings(args)
    settings.posting.enabled = False  # kopf posts no Event for a standby

    def lead() -> None:
        kube.LEADING.set()
        settings.posting.enabled = True
        metrics.LEADER.set(1)
        log.info("leading: reconciling every job the watches hold")
        handlers.Queue.changed()

    def follow() -> None:
        kube.LEADING.clear()
        settings.posting.enabled = False
        metrics.LEADER.set(0)
        log.info("standby: watching, not acting")
        handlers.Queue.changed()

    halt = threading.Event()  # stops the Lease loop
    elector = LeaseElector(args.lease_namespace, LEASE_NAME, args.identity)
    log.info("waiting for lease %s/%s as %s", args.lease_namespace, LEASE_NAME, args.identity)
    lease = threading.Thread(
        target=elector.run, args=(halt, lead, follow, metrics.Heartbeat.beat), daemon=True
    )
    lease.start()
    try:
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace or (),
            settings=settings,
        )
    finally:
        halt.set()
        lease.join(timeout=10)
        elector.release()
    return 0
