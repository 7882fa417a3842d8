"""Run a PostTrainJob's training: load, (resume,) train, checkpoint, export.

The same function runs in a JobSet pod (`posttrain train`) and on a laptop
(`posttrain run`). Under `output.uri`:

    checkpoints/<step>/   Orbax: trainable params, optimizer state, data position
    tensorboard/          loss, learning rate, grad norm, tokens/s, goodput/*
    hf/                   PEFT adapter (LoRA) or merged safetensors model
    goodput.json          where the wall time of every attempt went (see `goodput`)
    summary.json          written last: the finished step, final loss, export location
                          and goodput
    tracking.json         spec.tracking's run ids, so that a restart continues its runs

A run whose summary.json says it reached spec.training.steps, and whose export is still
there, is finished: running it again trains and writes nothing (see `finished_run`).
"""

from __future__ import annotations

import datetime
import gc
import importlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from posttrain.api.batching import batch_split_error
from posttrain.api.spec import PostTrainJob
from posttrain.trainer import (
    data,
    evaluate,
    goodput,
    models,
    optim,
    rl_placement,
    run_schedule,
    sft,
    storage,
    tracking,
)
from posttrain.trainer import mesh as mesh_lib
from posttrain.trainer.checkpoint import Checkpoints, background_saves
from posttrain.trainer.data.host_data import build_data, check_row_count
from posttrain.trainer.distributed import ProcessInfo
from posttrain.trainer.export import OutputDir, best_checkpoint, export_model
from posttrain.trainer.in_flight import Window, is_ready
from posttrain.trainer.policy import (
    Policy,
    load_policy,
    restore_into,
    shard_like_params,
    trainable_state,
)
from posttrain.trainer.progress import Progress, StatusWriter
from posttrain.trainer.signals import StopFlag

log = logging.getLogger("posttrain.trainer")
BATCH_KEYS = ("input_ids", "loss_mask", "segment_ids", "positions")


@dataclass
class Result:
    step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss at log steps
    resumed_from: int | None = None
    stopped_early: bool = False
    export_dir: str | None = None
    already_finished: bool = False  # an earlier run had finished; nothing was done
    evals: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> held-out metrics
    goodput: dict[str, Any] | None = None  # goodput.Ledger.summary() over every attempt


def _global_batch(
    batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh, keys: tuple[str, ...] = BATCH_KEYS
) -> dict[str, jax.Array]:
    """Per-host rows -> global arrays, batch dimension sharded over every device (one
    process may replicate a batch that does not divide its devices; several cannot)."""
    devices = mesh.devices.size
    rows = batch[keys[0]].shape[0] * jax.process_count()
    if rows % devices == 0:
        spec = jax.sharding.PartitionSpec(mesh_lib.BATCH_AXES)
    elif jax.process_count() == 1:
        spec = jax.sharding.PartitionSpec()
    else:
        raise ValueError(batch_split_error(rows, 1, jax.process_count(), devices))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return {k: jax.make_array_from_process_local_data(sharding, batch[k]) for k in keys}


# Modules of the other techniques; each has train(run: RunSetup) -> Result, and may have
# check(spec), called before anything loads.
TECHNIQUES = {
    "dpo": "posttrain.trainer.dpo",
    "grpo": "posttrain.trainer.grpo",
    "distill": "posttrain.trainer.distill",
}


def train(
    job: PostTrainJob, process: ProcessInfo, *, show_bar: bool = True, stop: StopFlag | None = None
) -> Result:
    """Train the job to spec.training.steps (or until stopped), resuming if a checkpoint
    exists under output.uri/checkpoints."""
    started = (time.monotonic(), time.time())  # goodput's startup begins here
    spec = job.spec
    check_gcs_locations(spec)
    tracking.check(spec)  # a tracker's client library: one line naming its extra
    if (done := finished_run(spec)) is not None:
        return done
    run_schedule.check_and_record(spec, jax.process_index() == 0)  # not another run's
    technique = train_sft
    if spec.technique != "sft":
        module = importlib.import_module(TECHNIQUES[str(spec.technique)])
        if (check := getattr(module, "check", None)) is not None:
            check(spec)
        technique = module.train
    run = setup_run(job, process, show_bar=show_bar, stop=stop, started=started)
    try:
        return technique(run)
    except BaseException:
        tracking.close_open("Failed")
        raise
    finally:  # a gs:// model's copy, a remote output's local side: nothing left in /tmp
        shutil.rmtree(run.scratch, ignore_errors=True)


def train_sft(run: RunSetup) -> Result:
    """SFT (sft.make_train_step) for spec.training.steps steps, resuming from the newest
    checkpoint."""
    spec = run.job.spec
    opt = run.optimizer()
    step_fn = sft.make_train_step(run.policy.wrt, spec.training.gradient_accumulation)
    measure, summarize = evaluate.token_loss(run.policy.model, run.to_global)

    def step(host_batch: dict[str, np.ndarray], index: int) -> dict[str, Any]:
        loss, grad_norm, _, seen = step_fn(run.policy.model, opt, run.to_global(host_batch))
        return {"loss": loss, "grad_norm": grad_norm, "tokens": seen}

    return run.train(opt, step, measure, summarize)


@dataclass
class RunSetup:
    """What every technique's run starts from (`setup_run`): the mesh, the policy, its
    tokenizer, this host's data, and the run's scratch directory and stop flag."""

    job: PostTrainJob
    process: ProcessInfo
    show_bar: bool
    stop: StopFlag
    scratch: Path
    mesh: jax.sharding.Mesh
    policy: Policy
    tokenizer: data.Tokenizer
    loader: data.DataLoader
    held_out: Any  # Records, or [(source name, Records)] of a mixture; None: no spec.eval
    started: tuple[float, float]  # (monotonic, wall clock) when setup began: goodput

    def optimizer(self) -> nnx.Optimizer:
        """spec.training's optimizer over the policy's trainable params."""
        return nnx.Optimizer(
            self.policy.model, optim.optimizer(self.job.spec.training), wrt=self.policy.wrt
        )

    def to_global(
        self, host_batch: dict[str, np.ndarray], keys: tuple[str, ...] = BATCH_KEYS
    ) -> dict[str, jax.Array]:
        """This host's rows of `keys` as global arrays over the mesh."""
        if keys is BATCH_KEYS and "images" in host_batch:  # multimodal SFT
            keys = (*keys, "images")
        return _global_batch(host_batch, self.mesh, keys)

    def train(
        self,
        opt: nnx.Optimizer,
        step: Any,
        measure: evaluate.Measure,
        summarize: evaluate.Summarize,
        eval_rows: int | None = None,
        scored: evaluate.Samples | None = None,
    ) -> Result:
        """run_steps with `step`, evaluating spec.eval's held-out data by `measure` and
        `summarize` in batches of `eval_rows` rows where it has that many (see
        evaluate.build)."""
        spec = self.job.spec
        evaluation = evaluate.build(
            spec,
            self.tokenizer,
            self.held_out,
            self.process,
            measure,
            summarize,
            self.policy.model,
            eval_rows,
            scored,
        )
        return run_steps(
            self.job,
            self.policy,
            opt,
            self.loader,
            step,
            mesh=self.mesh,
            scratch=self.scratch,
            show_bar=self.show_bar,
            stop=self.stop,
            evaluation=evaluation,
            started=self.started,
        )


def setup_run(
    job: PostTrainJob,
    process: ProcessInfo,
    *,
    show_bar: bool,
    stop: StopFlag | None,
    started: tuple[float, float] | None = None,
) -> RunSetup:
    """Load what every technique trains from: spec.model (with spec.lora) on the mesh,
    its tokenizer, and this host's training loader and held-out data. `started`
    (monotonic, wall clock) is when the attempt began (default: now)."""
    spec = job.spec
    started = started or (time.monotonic(), time.time())
    stop = stop if stop is not None else StopFlag()
    scratch = Path(tempfile.mkdtemp(prefix="posttrain-"))
    stop.on_exit(lambda: shutil.rmtree(scratch, ignore_errors=True))
    try:  # a signal ends the process from the watcher thread; stop.check() is the fallback
        # GRPO with a disaggregated sampler trains on its share of the devices only.
        mesh = models.make_mesh(devices=rl_placement.split_devices(spec)[0])
        device = mesh.devices.flat[0]
        log.info(
            "training on %s: %d x %s, mesh %s",
            device.platform,
            mesh.devices.size,
            device.device_kind,
            " x ".join(f"{name} {size}" for name, size in mesh.shape.items()),
        )
        check_row_count(spec, process)  # too few rows: said before the model loads
        log.info("loading the model from %s", spec.model.source)
        policy = load_policy(spec, mesh, scratch)
        stop.check()
        tokenizer = data.load_tokenizer(policy.model_dir)
        log.info(
            "reading the data from %s",
            spec.data.source or ", ".join(entry.source for entry in spec.data.sources),
        )
        loader, held_out = build_data(spec, tokenizer, process)
        stop.check()
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return RunSetup(
        job,
        process,
        show_bar,
        stop,
        scratch,
        mesh,
        policy,
        tokenizer,
        loader,
        held_out,
        started,
    )


def run_steps(
    job: PostTrainJob,
    policy: Policy,
    opt: nnx.Optimizer,
    loader: data.DataLoader,
    step: Any,
    *,
    mesh: jax.sharding.Mesh,
    scratch: Path,
    show_bar: bool,
    stop: StopFlag,
    evaluation: evaluate.Evaluation | None = None,
    started: tuple[float, float] | None = None,
) -> Result:
    """The loop every technique shares: resume from the newest checkpoint (params,
    optimizer state, data position), call `step(host_batch, index)` for each optimizer
    step (index counts from 0) until spec.training.steps or a stop, report and
    checkpoint, then export.

    `step` returns a dict of metrics: 'loss' (required), 'tokens' (tokens processed, for
    tokens/s; optional) and any other scalars, which go to TensorBoard as train/<name>.
    Values may be device arrays; they are read back only on log steps. `evaluation`
    (spec.eval) runs when due, before that step's checkpoint. Wall time is accounted
    by `goodput` from `started` (monotonic, wall clock; default: now) over every attempt.
    """
    spec = job.spec
    started = started or (time.monotonic(), time.time())
    ledger = _read_goodput(spec)
    clock = goodput.Clock(ledger, time.monotonic, compile_seconds, started=started[0])
    model, wrt = policy.model, policy.wrt
    is_main = jax.process_index() == 0
    learning_rates = optim.learning_rates(spec.training)
    checkpoints = Checkpoints(
        storage.join(spec.output.uri, "checkpoints"),
        spec.checkpoint.keep,
        background_saves(spec.checkpoint, mesh.devices.flat[0].platform),
    )
    result = Result(step=0)
    # The restore target must carry the final layouts: every host then reads only its own
    # shards (a fresh optimizer state sits on one device, which another host cannot reach).
    with jax.set_mesh(mesh):
        shard_like_params(opt, mesh)
    restored = checkpoints.restore_latest(trainable_state(model, wrt, opt))
    if restored is not None:
        restore_into(model, wrt, opt, restored.state)
        loader.set_state(restored.data_state)
        result.step = result.resumed_from = restored.step
        log.info("resumed from checkpoint step %d", restored.step)
    ledger.resume(result.step, started[1])

    tensorboard = OutputDir(spec.output.uri, "tensorboard", scratch)
    tracker = tracking.start(job, is_main, scratch)
    total = spec.training.steps
    progress = Progress(
        total,
        result.step,
        is_main,
        str(tensorboard.local),
        StatusWriter.from_env() if is_main else None,
        show_bar,
        goodput=ledger,
        tracker=tracker,
    )
    best = None
    if evaluation is not None:
        evaluation.resume(spec.output.uri, result.step)
        best = best_checkpoint(spec)
    metrics: dict[str, float] = {}
    # Steps are dispatched without waiting for the device (in_flight.py); a log step's
    # outputs are read once the next step is queued behind it (`pending`), so the device
    # computes while the host logs (read at once, the device idled until the next
    # dispatch: 5% of a 250 ms step logged every 5 on the chip). Saves wait anyway.
    window = Window()
    pending: tuple[int, Any, dict[str, Any]] | None = None

    def report(step_number: int, loss: Any, out: dict[str, Any]):
        nonlocal metrics
        loss_value, tokens_per_second = window.close(step_number, loss)
        metrics = {
            "loss": loss_value,
            "learning_rate": float(learning_rates[step_number - 1]),
            **{k: float(v) for k, v in out.items()},
            "tokens_per_second": tokens_per_second,
            **{f"data/{k}": v for k, v in loader.metrics().items()},
        }
        result.losses[step_number] = loss_value
        progress.step(step_number, metrics, True)

    recorded = time.monotonic()
    clock.charge("startup")
    with jax.set_mesh(mesh):
        if evaluation is not None and result.step == 0 and evaluation.every_steps:
            progress.phase("evaluating step 0")
            result.evals[0] = evaluation.evaluate(0, progress)  # where the curve starts
            clock.charge("eval")
        loss: Any = None
        if result.step < total:
            progress.phase(f"compiling and running step {result.step + 1}")
        while result.step < total and not stop:
            host_batch = next(loader)
            clock.data(device_busy=loss is not None and not is_ready(loss))
            out = dict(step(host_batch, result.step))
            loss = out.pop("loss")
            result.step += 1
            if isinstance(stop, StopFlag) and not stop.stepping:
                # The first step is compiled and dispatched: from here a signal checkpoints
                # after it (before, it stops saving nothing). What exists now is frozen: no
                # full collection walks it again (0.4-0.6 s every ~8 steps on the chip).
                stop.training()
                gc.freeze()
            window.queue(result.step, loss, out.pop("tokens", 0))
            if pending is not None:
                report(*pending)
                pending = None
            log_now = result.step % spec.training.log_every_steps == 0 or result.step == total
            eval_now = evaluation is not None and evaluation.due(result.step, total)
            save_now = (
                result.step % spec.checkpoint.every_steps == 0 or result.step == total or stop
            )
            if eval_now or save_now:  # the step's own time is the step's, not theirs
                jax.block_until_ready(loss)
            clock.step(result.step)
            if log_now and not (eval_now or save_now):
                pending = (result.step, loss, out)
            elif log_now:
                report(result.step, loss, out)
            else:
                progress.step(result.step, metrics, False)
            if log_now and time.monotonic() - recorded >= goodput.RECORD_INTERVAL_S:
                clock.charge("other")
                _write_goodput(spec, ledger, is_main)
                recorded = time.monotonic()
            clock.charge("other")
            if eval_now:
                progress.phase(f"evaluating step {result.step}")
                scores = result.evals[result.step] = evaluation.evaluate(result.step, progress)
                if best is not None:
                    best.offer(
                        result.step, scores, trainable_state(model, wrt, opt), loader.get_state()
                    )
                clock.charge("eval")
            if save_now:
                progress.phase(f"checkpointing step {result.step}")
                checkpoints.save(result.step, trainable_state(model, wrt, opt),
                                 loader.get_state(), {"loss": float(loss)})  # fmt: skip
                progress.checkpointed(result.step)
                tensorboard.sync()
                ledger.checkpointed(result.step)
                clock.charge("checkpoint")
                _write_goodput(spec, ledger, is_main)
                recorded = time.monotonic()
                clock.charge("checkpoint")
    gc.unfreeze()  # what the run held may go with it (several runs in one process: tests)
    if pending is not None:  # a stop between a log step and the next
        report(*pending)
    checkpoints.close()
    clock.charge("checkpoint")
    result.stopped_early = result.step < total
    if not result.stopped_early:
        if str(spec.output.export_from) == "best" and best is not None:
            restored = best.restore(trainable_state(model, wrt, opt))
            restore_into(model, wrt, opt, restored.state)
            log.info("exporting the best %s, step %d", best.metric, restored.step)
        progress.phase("exporting")
        result.export_dir = export_model(job, model, policy.info, scratch)
    if best is not None:
        best.close()
    clock.charge("other")
    _write_goodput(spec, ledger, is_main)
    result.goodput = ledger.summary()
    progress.close(result.step, metrics)
    tensorboard.sync()
    if not result.stopped_early and is_main:
        _write_summary(spec, result, metrics)
    phase = "Stopped" if result.stopped_early else "Succeeded"
    kept = {"goodput": result.goodput, "export_dir": result.export_dir, "scratch": scratch}
    tracking.finish(tracker, phase, result.step, **kept)
    return result


_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compiled = [0.0]  # seconds JAX spent compiling in this process (compile_seconds)


def _count_compile(event: str, duration: float, **kwargs: Any) -> None:
    if event in _COMPILE_EVENTS:
        _compiled[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_seconds() -> float:
    """Seconds JAX spent tracing, lowering and compiling in this process so far."""
    return _compiled[0]


def _read_goodput(spec: Any) -> goodput.Ledger:
    """The goodput record of earlier attempts of this run under output.uri (a fresh
    ledger when there is none, or it is unreadable: accounting never stops a run)."""
    path = storage.join(spec.output.uri, goodput.RECORD)
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        return goodput.Ledger()
    except Exception as e:  # noqa: BLE001 - accounting is best effort, like status
        log.warning("cannot read %s (%s); goodput restarts from this attempt", path, e)
        return goodput.Ledger()
    try:
        return goodput.Ledger.from_json(text)
    except ValueError as e:
        log.warning("%s: %s; goodput restarts from this attempt", path, e)
        return goodput.Ledger()


def _write_goodput(spec: Any, ledger: goodput.Ledger, is_main: bool) -> None:
    """Record the ledger beside the checkpoints (process 0; atomic replace)."""
    if not is_main:
        return
    ledger.last_seen = time.time()
    try:
        storage.write_text(storage.join(spec.output.uri, goodput.RECORD), ledger.to_json())
    except Exception as e:  # noqa: BLE001 - accounting is best effort, like status
        log.warning("cannot record goodput: %s", e)


def gcs_locations(spec: Any) -> list[tuple[str, str]]:
    """(field, URI) of every gs:// location a run reads or writes."""
    teacher = spec.distill.teacher if spec.distill else None
    candidates = [
        ("spec.model.source", spec.model.source),
        ("spec.data.source", spec.data.source),
        *(
            (f"spec.data.sources[{k}].source", entry.source)
            for k, entry in enumerate(spec.data.sources or [])
        ),
        ("spec.eval.source", spec.eval.source if spec.eval else None),
        ("spec.distill.teacher.source", teacher.source if teacher else None),
        ("spec.lora.restoreFrom", spec.lora.restore_from if spec.lora else None),
        ("spec.output.uri", spec.output.uri),
    ]
    return [(f, u) for f, u in candidates if u and storage.is_gcs(u)]


def check_gcs_locations(spec: Any) -> None:
    """Before anything loads: every gs:// bucket answers (storage.check_reachable), and
    every gs:// input is there (an object or a prefix with objects); a ValueError names
    the field of one that is not."""
    for field_name, uri in gcs_locations(spec):
        storage.check_reachable(uri, field_name)
        if field_name != "spec.output.uri" and not storage.exists(uri):
            raise ValueError(f"{field_name}: {uri}: no such object or prefix in the bucket")


SUMMARY = "summary.json"


def _write_summary(spec: Any, result: Result, metrics: dict[str, float]) -> None:
    summary = {
        "step": result.step,
        "totalSteps": spec.training.steps,
        "loss": metrics.get("loss"),
        "export": result.export_dir,
        "goodput": result.goodput,
        "schedule": run_schedule.schedule_of(spec),
        "finishedAt": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    storage.write_text(storage.join(spec.output.uri, SUMMARY), json.dumps(summary, indent=2) + "\n")


def finished_run(spec: Any) -> Result | None:
    """The Result of an earlier run of this job that already reached spec.training.steps
    and whose export is still in place, or None when there is training (or an export) to
    do. Nothing is written either way."""
    path = storage.join(spec.output.uri, SUMMARY)
    try:
        summary = json.loads(storage.read_text(path))
        step, export = int(summary["step"]), summary.get("export")
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: train (resuming from the checkpoints)
    if step < spec.training.steps or (export and not storage.exists(export)):
        return None
    log.warning(
        "%s already finished at step %d; its outputs are under %s. To train again, "
        "give it a new output (posttrain run --output DIR) or remove that directory.",
        spec.output.uri,
        step,
        spec.output.uri,
    )
    return Result(step=step, resumed_from=step, export_dir=export, already_finished=True)
