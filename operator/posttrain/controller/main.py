"""`posttrain operator`: leader election, metrics/health endpoint, then kopf.

Settings come from flags, with environment defaults for the chart:
POSTTRAIN_TRAINER_IMAGE_CPU / _TPU / _GPU (the trainer image per accelerator kind),
POSTTRAIN_PATHWAYS_SERVER_IMAGE, POSTTRAIN_PATHWAYS_PROXY_IMAGE,
POSTTRAIN_PATHWAYS_HEAD_NODE_POOL, POSTTRAIN_DEFAULT_QUEUE, POSTTRAIN_LEASE_NAMESPACE, POD_NAME.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import threading

import kopf
from kubernetes import config as kube_config

from posttrain.controller import (
    handlers,  # noqa: F401 (registers the kopf handlers)
    metrics,
    reconcile,
    watches,
    webhook,
)
from posttrain.controller.leader import LeaseElector
from posttrain.render import RenderConfig

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
    watches.selectors(settings)
    return settings


def operator_command(args: argparse.Namespace) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps stacks
    _configure_logging()
    _load_kube_config()
    reconcile.State.render_config = _render_config()
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

    halt = threading.Event()  # stops the Lease loops
    elector = LeaseElector(args.lease_namespace, LEASE_NAME, args.identity)
    log.info("waiting for lease %s/%s as %s", args.lease_namespace, LEASE_NAME, args.identity)
    if not elector.wait_until_leader(halt, metrics.Heartbeat.beat):
        return 0
    metrics.LEADER.set(1)
    lost: concurrent.futures.Future[str] = concurrent.futures.Future()

    def on_lost() -> None:
        if not lost.done():
            lost.set_result("lost the leader Lease")

    @kopf.on.cleanup()
    def release_stop_flag(**_: object) -> None:
        # kopf waits for this flag in a worker thread; resolve it on any shutdown (e.g.
        # SIGTERM) so that thread ends and the process exits at once.
        if not lost.done():
            lost.set_result("")

    threading.Thread(
        target=elector.hold, args=(halt, on_lost, metrics.Heartbeat.beat), daemon=True
    ).start()
    try:
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace or (),
            settings=_settings(args),
            stop_flag=lost,
        )
    finally:
        halt.set()
        metrics.LEADER.set(0)
        reason = lost.result() if lost.done() else ""
        if not reason:
            elector.release()
    return 1 if reason else 0
