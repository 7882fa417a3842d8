"""`posttrain run` (local) and `posttrain train` (in a pod): the same training, two doors.

Exit codes: 0 done; 65 (USER_ERROR_EXIT_CODE) an error in the job's own input, which the
JobSet does not retry; 143 stopped by SIGTERM after saving a checkpoint (the JobSet
restarts the job, which resumes from it); 75 a server did not answer: the Pathways proxy
(see `posttrain.trainer.pathways`) or an hf:// source's Hub (storage.Unreachable), worth a
restart; anything else is a crash worth a restart.
"""

from __future__ import annotations

import argparse
import logging
import sys

from posttrain.api.spec import USER_ERROR_EXIT_CODE, PostTrainJob
from posttrain.api.validate import InvalidJob, load_job

STOPPED_EXIT_CODE = 143
log = logging.getLogger("posttrain.trainer")


def is_user_error(e: BaseException) -> bool:
    """Errors the job's author must fix: they name a spec field, file or column."""
    from posttrain.trainer.chat_template import ChatTemplateError
    from posttrain.trainer.data import DataError

    if isinstance(e, InvalidJob | DataError | ChatTemplateError):
        return True
    return isinstance(e, ValueError | FileNotFoundError) and "spec." in str(e)


def _run(job: PostTrainJob, show_bar: bool, in_pod: bool = False) -> int:
    from posttrain.trainer import cpu_flags, host_malloc

    cpu_flags.apply()  # before JAX starts its CPU backend
    if job.spec.resources.accelerator == "cpu":  # the arrays live in the process heap
        host_malloc.return_freed_memory()
    from posttrain.trainer import device_check, distributed, pathways, storage

    try:  # JAX_PLATFORMS=proxy: before JAX touches a backend
        pathways.initialize()
    except pathways.ProxyUnreachable as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return pathways.UNREACHABLE_EXIT_CODE
    info = distributed.process_info()
    distributed.initialize(info)
    try:
        if in_pod:  # the devices the operator gave the job (locally: whatever is there)
            device_check.check(job)
    except device_check.DeviceMismatch as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return e.exit_code
    from posttrain.trainer.loop import StopFlag, train
    from posttrain.trainer.models import remat_policy

    stop = StopFlag()
    stop.install()
    try:
        with remat_policy(job.spec.training.remat):  # every model the job loads
            result = train(job, info, show_bar=show_bar, stop=stop)
    except storage.Unreachable as e:  # a server that did not answer: worth a retry
        print(f"posttrain: {e}", file=sys.stderr)
        return pathways.UNREACHABLE_EXIT_CODE
    except Exception as e:
        if is_user_error(e):
            print(f"posttrain: {e}", file=sys.stderr)
            return USER_ERROR_EXIT_CODE
        raise
    if result.stopped_early:
        log.warning("stopped at step %d after saving a checkpoint", result.step)
        return STOPPED_EXIT_CODE
    if result.export_dir and not result.already_finished:
        log.info("exported to %s", result.export_dir)
    return 0


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("absl", "jax._src", "orbax", "urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def train_command(args: argparse.Namespace) -> int:
    """Inside a pod: read the ConfigMap's job.json."""
    _setup_logging()
    try:
        job = load_job(args.config)
    except (InvalidJob, OSError) as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return _run(job, show_bar=False, in_pod=True)


def run_command(args: argparse.Namespace) -> int:
    """On one machine: the same PostTrainJob YAML, with a progress bar."""
    _setup_logging()
    overrides = {"spec.output.uri": args.output, "spec.training.steps": args.steps}
    try:
        job = load_job(args.file, {k: v for k, v in overrides.items() if v is not None})
    except (InvalidJob, OSError) as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    print(f"posttrain: training {job.metadata.name} -> {job.spec.output.uri}", file=sys.stderr)
    return _run(job, show_bar=True)


def export_command(args: argparse.Namespace) -> int:
    """`posttrain export`: a checkpoint of a run as a Hugging Face export, without training."""
    _setup_logging()
    overrides = {"spec.output.uri": args.output} if args.output else {}
    try:
        job = load_job(args.file, overrides)
    except (InvalidJob, OSError) as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    from posttrain.trainer import pathways, storage
    from posttrain.trainer.export import export_checkpoint

    try:
        step, uri = export_checkpoint(job, args.step, args.format, best=args.best, base=args.base)
    except storage.Unreachable as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return pathways.UNREACHABLE_EXIT_CODE
    except Exception as e:
        flag = isinstance(e, ValueError) and str(e).startswith("--")  # names --step/--format
        if flag or is_user_error(e):
            print(f"posttrain: {e}", file=sys.stderr)
            return USER_ERROR_EXIT_CODE
        raise
    print(f"posttrain: exported step {step} of {job.metadata.name} to {uri}", file=sys.stderr)
    return 0
