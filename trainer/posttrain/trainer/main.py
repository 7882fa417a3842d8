"""`posttrain run` (local) and `posttrain train` (in a pod): the same training, two doors.

Exit codes: 0 done; 65 (USER_ERROR_EXIT_CODE) an error in the job's own input, which the
JobSet does not retry; 143 stopped by SIGTERM after saving a checkpoint (the JobSet
restarts the job, which resumes from it); 75 a server did not answer: the Pathways proxy
(see `posttrain.trainer.pathways`) or an hf:// source's Hub (storage.Unreachable), worth a
restart; 130 Ctrl-C before the first step (nothing to save; SIGTERM then exits 143, the
JobSet restarts it); 70 (watchdog.HUNG_EXIT_CODE) no progress within
spec.scheduling.progressDeadlineSeconds, after every thread's stack, worth a restart;
anything else is a crash worth a restart.
"""

from __future__ import annotations

import argparse
import logging
import sys

from posttrain.api.spec import USER_ERROR_EXIT_CODE, PostTrainJob
from posttrain.api.validate import FieldError, InvalidJob, printable
from posttrain.checks import load_job
from posttrain.trainer.signals import STOPPED_EXIT_CODE

log = logging.getLogger("posttrain.trainer")


def _unreadable(e: Exception) -> str:
    """An InvalidJob's lines, or 'FILE: cannot read: why' for a file that cannot be read."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{printable(str(e.filename))}: cannot read: {e.strerror or e}"
    return str(e)


def is_user_error(e: BaseException) -> bool:
    """Errors the job's author must fix: they name a spec field, file or column."""
    from posttrain.trainer.chat_template import ChatTemplateError
    from posttrain.trainer.data import DataError

    if isinstance(e, InvalidJob | DataError | ChatTemplateError):
        return True
    return isinstance(e, ValueError | FileNotFoundError) and "spec." in str(e)


def _run(job: PostTrainJob, show_bar: bool, in_pod: bool = False) -> int:
    from posttrain.trainer import compile_cache, cpu_flags, host_malloc

    cpu_flags.apply()  # before JAX starts its CPU backend
    if devices := cpu_flags.apply_devices(job.spec):  # a disaggregated sampler's share
        log.info("%d CPU devices for spec.grpo.rollout's placement", devices)
    # Locally: shared with `posttrain generate` and `export` on this machine; in a pod:
    # beside the checkpoints on the job's volume, for the pod a restart makes.
    pod_output = job.spec.output.uri if in_pod else None
    cache = compile_cache.enable(output_uri=pod_output)
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
    if not in_pod and (code := _memory_exit(job)) is not None:  # before anything loads
        return code
    try:
        if in_pod:  # the devices the operator gave the job (locally: whatever is there)
            device_check.check(job)
    except device_check.DeviceMismatch as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return e.exit_code
    # In a pod, once its devices are known good: the volumes' inputs and output (locally,
    # run_command checked them before JAX loaded).
    if in_pod and (code := _preflight_exit(job, None, "spec.output.uri")) is not None:
        return code
    from posttrain.api import heartbeat
    from posttrain.trainer.loop import train
    from posttrain.trainer.progress import report_phase
    from posttrain.trainer.signals import Interrupted, StopFlag, exit_code, stopped_line
    from posttrain.trainer.watchdog import watching

    if info.process_id == 0:  # the operator's progress deadline: the trainer started
        report_phase(heartbeat.LOADING)
    stop = StopFlag()
    stop.install()
    try:
        with watching(job.spec.scheduling.progress_deadline_seconds):  # a hung loop exits
            result = train(job, info, show_bar=show_bar, stop=stop)
        if cache and info.process_id == 0 and (remote := compile_cache.kept_copy(pod_output)):
            log.info("compilation cache: %d programs to %s", compile_cache.push(cache, remote),
                     remote)  # fmt: skip
    except Interrupted as e:  # before the first step (no watcher thread): nothing to save
        print(stopped_line(e.signum), file=sys.stderr)
        return exit_code(e.signum)
    except storage.Unreachable as e:  # a server that did not answer: worth a retry
        print(f"posttrain: {e}", file=sys.stderr)
        return pathways.UNREACHABLE_EXIT_CODE
    except Exception as e:
        if is_user_error(e):
            print(f"posttrain: {e}", file=sys.stderr)
            return USER_ERROR_EXIT_CODE
        raise
    if result.stopped_early:
        if result.step == (result.resumed_from or 0):
            log.warning("stopped before training a step; nothing new saved")
        else:
            log.warning("stopped at step %d after saving a checkpoint", result.step)
        return STOPPED_EXIT_CODE
    if result.export_dir and not result.already_finished:
        log.info("exported to %s", result.export_dir)
    return 0


def _memory_exit(job: PostTrainJob) -> int | None:
    """On this machine's CPU, the job's host memory estimate against what the machine
    has, as admission checks a cluster job (posttrain.host_memory.on_this_machine): the
    exit code of a job it refuses, after one line saying why; None to go on."""
    import os

    import jax

    from posttrain import host_memory

    if jax.devices()[0].platform != "cpu" or os.environ.get(host_memory.SKIP_ENV) == "1":
        return None
    verdict, why = host_memory.on_this_machine(job.spec)
    if verdict == "refuse":
        print(f"posttrain: {why}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    if why:
        log.warning("%s", why)
    return None


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("absl", "jax._src", "orbax", "urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("absl").addFilter(_not_a_missing_tpu)


def _not_a_missing_tpu(record: logging.LogRecord) -> bool:
    """Tunix's memory report warns 'Skipping non-TPU device: cpu. You might be missing
    jax[tpu]' at every GRPO step of a CPU run, where no TPU is missing."""
    return not str(record.msg).startswith("Skipping non-TPU device")


def train_command(args: argparse.Namespace) -> int:
    """Inside a pod: read the ConfigMap's job.json."""
    _setup_logging()
    try:
        job = load_job(args.config)
    except (InvalidJob, OSError) as e:
        print(f"posttrain: {_unreadable(e)}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return _run(job, show_bar=False, in_pod=True)


WARMUP = "spec.training.warmupSteps"


def _load_run(args: argparse.Namespace) -> PostTrainJob:
    """The job of `posttrain run FILE [--output] [--steps]`. A --steps at or below the
    file's spec.training.warmupSteps caps the warmup to the shortened run (steps - 1). A
    --steps other than the file's, without --output, writes beside the job's output
    (<uri>-steps-<N>), so that a quick try is never resumed as the job's own run."""
    job = _load_overridden(args)
    if args.steps is None or args.output is not None:
        return job
    try:
        written = load_job(args.file).spec.training.steps
    except InvalidJob:
        written = None
    if written == args.steps:
        return job
    uri = f"{job.spec.output.uri.rstrip('/')}-steps-{args.steps}"
    print(
        f"posttrain: --steps {args.steps}: writing to {uri}, not the job's own output "
        "(--output DIR to choose)",
        file=sys.stderr,
    )
    return _load_overridden(argparse.Namespace(**{**vars(args), "output": uri}), quiet=True)


def _load_overridden(args: argparse.Namespace, quiet: bool = False) -> PostTrainJob:
    overrides = {"spec.output.uri": args.output, "spec.training.steps": args.steps}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        return load_job(args.file, overrides)
    except InvalidJob as e:
        warmup_only = [err.field for err in e.errors] == [WARMUP]
        if args.steps is None:  # the file's own warmup: --steps is the other way out
            raise InvalidJob([_with_steps_hint(err) for err in e.errors], e.source) from None
        if not (warmup_only and isinstance(args.steps, int) and args.steps > 0):
            raise
    job = load_job(args.file, {**overrides, "spec.training.warmupSteps": args.steps - 1})
    if quiet:
        return job
    try:
        written = f" {load_job(args.file).spec.training.warmup_steps}"
    except InvalidJob:
        written = ""
    print(
        f"posttrain: --steps {args.steps}: spec.training.warmupSteps{written} capped to "
        f"{args.steps - 1} for this run",
        file=sys.stderr,
    )
    return job


def _with_steps_hint(err: FieldError) -> FieldError:
    """The warmup rule's error (api.rules), saying that --steps caps the warmup."""
    if err.field != WARMUP or "less than training.steps" not in err.message:
        return err
    hint = "; or run N steps with --steps N, which caps the warmup at N - 1"
    return FieldError(err.field, err.message + hint)


def _preflight(job: PostTrainJob, job_file: str | None, output_field: str) -> list[str]:
    """What stops the run before anything loads: a local input that is not there, an
    output that cannot be written (posttrain.local_paths; a gs:// one by writing and
    deleting a probe object). A server that does not answer raises storage.Unreachable."""
    from posttrain.local_paths import missing_inputs

    if problems := missing_inputs(job.spec, job_file):
        return problems  # before the output directory is made
    why = _unwritable(job.spec.output.uri, output_field)
    return [why] if why else []


def _preflight_exit(job: PostTrainJob, job_file: str | None, output_field: str) -> int | None:
    """_preflight's problems printed one a line (after the job file, when there is one),
    and the exit code they call for; None when the run may go on."""
    from posttrain.trainer import pathways, storage

    try:
        problems = _preflight(job, job_file, output_field)
    except storage.Unreachable as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return pathways.UNREACHABLE_EXIT_CODE
    prefix = f"posttrain: {job_file}: " if job_file else "posttrain: "
    for line in problems:
        print(f"{prefix}{line}", file=sys.stderr)
    return USER_ERROR_EXIT_CODE if problems else None


def _unwritable(uri: str, field: str, create: bool = True) -> str | None:
    """Why the output `uri` cannot be written, in one line naming `field`, or None."""
    from posttrain.local_paths import unwritable_output
    from posttrain.trainer import storage

    if not storage.is_gcs(uri):
        return unwritable_output(uri, field, create=create)
    try:
        storage.check_writable(uri, field)
    except ValueError as e:
        return str(e)
    return None


def run_command(args: argparse.Namespace) -> int:
    """On one machine: the same PostTrainJob YAML, with a progress bar."""
    _setup_logging()
    try:
        job = _load_run(args)
    except (InvalidJob, OSError) as e:
        print(f"posttrain: {_unreadable(e)}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE

    output_field = "--output (spec.output.uri)" if args.output else "spec.output.uri"
    if (code := _preflight_exit(job, args.file, output_field)) is not None:
        return code
    print(f"posttrain: training {job.metadata.name} -> {job.spec.output.uri}", file=sys.stderr)
    return _run(job, show_bar=True)


def _export_problem(job: PostTrainJob, args: argparse.Namespace) -> str | None:
    """Why `posttrain export` cannot export what it was asked to, found without loading
    the model (one line naming the flag or field), or None: no checkpoint to export, or
    an export directory that cannot be written. A gs:// output's bucket is asked (a server
    that does not answer raises storage.Unreachable)."""
    from posttrain.trainer import storage

    spec = job.spec
    if args.format == "adapter" and not spec.lora:
        return "--format adapter: the job has no spec.lora (a full fine-tune)"
    if args.best and spec.checkpoint.keep_best is None:
        return "--best: the job has no spec.checkpoint.keepBest"
    uri = spec.output.uri
    field = "--output (spec.output.uri)" if args.output else "spec.output.uri"
    try:
        storage.check_reachable(uri, field)
    except ValueError as e:
        return str(e)
    where = "checkpoints-best" if args.best else "checkpoints"
    steps = sorted(int(d) for d in storage.list_dirs(storage.join(uri, where)) if d.isdigit())
    if not steps:
        return (
            f"{field}: {uri} has no {where}/ to export: train first "
            f"(posttrain run {args.file}{' --output ' + uri if args.output else ''})"
        )
    if args.step is not None and args.step not in steps:
        shown = ", ".join(map(str, steps))
        return f"--step: no checkpoint {args.step} under {uri}/{where} (there: {shown})"
    # Where export_checkpoint writes: hf/, or hf-step-<step>/ for a chosen checkpoint,
    # with -merged for a merged export of a LoRA job.
    chosen = args.step if args.step is not None else steps[-1] if args.best else None
    name = "hf" if chosen is None else f"hf-step-{chosen}"
    if spec.lora and (args.format or str(spec.output.export_hf)) == "merged":
        name += "-merged"
    return _unwritable(storage.join(uri, name), field, create=False)


def export_command(args: argparse.Namespace) -> int:
    """`posttrain export`: a checkpoint of a run as a Hugging Face export, without training."""
    _setup_logging()
    overrides = {"spec.output.uri": args.output} if args.output else {}
    try:
        job = load_job(args.file, overrides)
    except (InvalidJob, OSError) as e:
        print(f"posttrain: {_unreadable(e)}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    from posttrain.trainer import pathways, storage

    try:
        why = _export_problem(job, args)  # before loading anything
    except storage.Unreachable as e:
        print(f"posttrain: {e}", file=sys.stderr)
        return pathways.UNREACHABLE_EXIT_CODE
    if why is not None:
        print(f"posttrain: {args.file}: {why}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    from posttrain.trainer import compile_cache
    from posttrain.trainer.export import export_checkpoint

    compile_cache.enable()
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
