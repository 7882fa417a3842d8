"""Where progress goes: a progress bar locally, TensorBoard scalars, and (in a cluster)
the PostTrainJob's status.progress, written by process 0 only.

In a pod the trainer knows its job from POSTTRAIN_JOB_NAME / POSTTRAIN_JOB_NAMESPACE and
reaches the API server with the pod's token (the namespace's trainer ServiceAccount): it
may patch the status of this one job, whose pod it runs in, and nothing else (the chart's
trainer ClusterRole and status policy). A failed status write never stops training.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from posttrain.api import heartbeat
from posttrain.trainer import watchdog

if TYPE_CHECKING:
    from posttrain.trainer.goodput import Ledger
    from posttrain.trainer.tracking import Tracker

log = logging.getLogger("posttrain.progress")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _shown(metrics: dict[str, float]) -> dict[str, str]:
    return {k: f"{v:.4g}" for k, v in metrics.items()}


# What the bar shows (few, so that it stays readable at 80 columns); every metric goes to
# the log line of each log step, above the bar.
ON_BAR = {"loss": ("loss", "{:.4g}"), "tokens_per_second": ("tok/s", "{:.0f}")}
# RL (GRPO's family): its loss is near zero by construction (advantages are centred per
# group), so the bar shows whether it learns: the mean reward and completion length.
RL_ON_BAR = {
    "reward": ("reward", "{:.3g}"),
    "completion_length": ("len", "{:.0f}"),
    "tokens_per_second": ("tok/s", "{:.0f}"),
}


def _on_bar(metrics: dict[str, float]) -> dict[str, str]:
    chosen = RL_ON_BAR if "reward" in metrics else ON_BAR
    return {name: fmt.format(metrics[k]) for k, (name, fmt) in chosen.items() if k in metrics}


# GRPO's rollout metrics (the sampler's, rl_placement; episodes' and verifier services')
# in status.progress.rollout.
ROLLOUT_METRICS = {
    "staleness": "staleness",
    "sampler_busy": "samplerBusy",
    "learner_busy": "learnerBusy",
    "weight_sync_seconds": "weightSyncSeconds",
    # spec.grpo.agent and verifier services (agent_rollout, reward_service)
    "turns": "turns",
    "tool_calls": "toolCalls",
    "tool_errors": "toolErrors",
    "reward_failures": "rewardFailures",
    "reward_service_seconds": "rewardServiceSeconds",
}


class StatusWriter:
    """Merge-patches status.progress of one PostTrainJob."""

    def __init__(self, name: str, namespace: str):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.api = client.CustomObjectsApi()
        self.name, self.namespace = name, namespace

    @classmethod
    def from_env(cls) -> StatusWriter | None:
        name, namespace = (
            os.environ.get("POSTTRAIN_JOB_NAME"),
            os.environ.get("POSTTRAIN_JOB_NAMESPACE"),
        )
        if not (name and namespace):
            return None
        try:
            return cls(name, namespace)
        except Exception as e:  # noqa: BLE001 - no cluster access: report locally only
            log.warning("cannot report progress to PostTrainJob %s/%s: %s", namespace, name, e)
            return None

    def patch(self, progress: dict[str, Any]) -> None:
        from posttrain.api.spec import GROUP, PLURAL, VERSION

        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                self.name,
                {"status": {"progress": progress}},
            )
        except Exception as e:  # noqa: BLE001 - progress is best effort
            log.warning("progress update for %s/%s failed: %s", self.namespace, self.name, e)


class Progress:
    """Reports training progress; every method is a no-op on processes other than 0."""

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        is_main: bool,
        tensorboard_dir: str | None,
        status: StatusWriter | None = None,
        show_bar: bool = True,
        status_interval_s: float = 10.0,
        goodput: Ledger | None = None,
        columns: int | None = None,
        tracker: Tracker | None = None,
    ):
        """`columns`: the bar's width (default: the terminal's, following resizes);
        `tracker` (spec.tracking) gets every TensorBoard scalar and is in the status."""
        self.total, self.is_main = total_steps, is_main
        self.status = status if is_main else None
        self.status_interval_s = status_interval_s
        self._last_status = 0.0
        self._start_time, self._start_step = time.monotonic(), start_step
        self.last_checkpoint_step: int | None = None
        self.last_eval: dict[str, Any] = {}
        self.goodput = goodput
        self.tracker = tracker
        self.writer = None
        self.bar = None
        self._redirect: Any = None
        self._bar_metrics: list[str] = []  # the bar's latest metrics, as shown
        # The heartbeat (posttrain.api.heartbeat): the phase, and the one last written.
        self._step, self._phase, self._written_phase = start_step, heartbeat.LOADING, None
        if not is_main:
            return
        if tensorboard_dir:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir, flush_secs=10)
            if tracker is not None:
                self.writer = tracker.tee(self.writer)
        # A bar redraws itself in place, which only a terminal shows as one line; into a
        # file or pipe the trainer logs one line per log step instead.
        self.log_lines = show_bar and not sys.stderr.isatty()
        if show_bar and not self.log_lines:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # mininterval=0: a step is slower than a redraw, and every step shows its own.
            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=columns is None,
                ncols=columns,
                mininterval=0,
                file=sys.stderr,
            )
            # Log records (a warning, the log step's line) go above the bar, not into it.
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def phase(self, doing: str | None) -> None:
        """What the run is doing between steps (compiling, evaluating): the bar's label
        on a terminal, a log line otherwise; None when steps run again."""
        watchdog.beat(heartbeat.phase_of(doing), self._step)
        if not self.is_main:
            return
        self._heartbeat(heartbeat.phase_of(doing))
        if self.bar is not None:  # in the metrics' place: the bar keeps its width
            self.bar.set_postfix_str(doing or ", ".join(self._bar_metrics), refresh=True)
        elif doing:
            log.info("%s", doing)

    def eta_seconds(self, step: int) -> int | None:
        done = step - self._start_step
        if done <= 0:
            return None
        per_step = (time.monotonic() - self._start_time) / done
        return int(per_step * (self.total - step))

    def step(self, step: int, metrics: dict[str, float], log_now: bool) -> None:
        """Called after every optimizer step; metrics are written when log_now."""
        watchdog.beat(heartbeat.TRAINING, step)
        self._step, self._phase = step, heartbeat.TRAINING
        if not self.is_main:
            return
        if self.bar is not None:
            if log_now:
                shown = _on_bar(metrics)
                self._bar_metrics = [f"{k}={v}" for k, v in shown.items()]
            # Before the update, which redraws: the bar shows this step's numbers (in
            # place of a phase such as compiling, which this step ended).
            self.bar.set_postfix_str(", ".join(self._bar_metrics), refresh=False)
            self.bar.update(step - self.bar.n)
        if not log_now:
            self._heartbeat(heartbeat.TRAINING)
            return
        if self.log_lines or self.bar is not None:
            shown = " ".join(f"{k}={v}" for k, v in _shown(metrics).items())
            log.info("step %d/%d %s", step, self.total, shown)
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"train/{key}", value, step)
            self._goodput_scalars(step)
        now = time.monotonic()
        if self.status is not None and (
            now - self._last_status >= self.status_interval_s or step == self.total
        ):
            self._last_status, self._written_phase = now, self._phase
            self.status.patch(self._progress(step, metrics))

    def _heartbeat(self, phase: str) -> None:
        """status.progress.phase with updatedAt: at once when the phase changes, else at
        most every heartbeat.HEARTBEAT_INTERVAL_S (the operator's progress deadline)."""
        self._phase = phase
        now = time.monotonic()
        if self.status is None or (
            phase == self._written_phase
            and now - self._last_status < heartbeat.HEARTBEAT_INTERVAL_S
        ):
            return
        self._last_status, self._written_phase = now, phase
        self.status.patch({"phase": phase, "step": self._step, "updatedAt": _now()})

    def _progress(self, step: int, metrics: dict[str, float]) -> dict[str, Any]:
        out: dict[str, Any] = {"step": step, "totalSteps": self.total, "updatedAt": _now()}
        out["phase"] = self._phase
        names = {
            "loss": "loss",
            "learning_rate": "learningRate",
            "tokens_per_second": "tokensPerSecond",
        }
        out.update({wire: float(metrics[k]) for k, wire in names.items() if k in metrics})
        rollout = {wire: float(metrics[k]) for k, wire in ROLLOUT_METRICS.items() if k in metrics}
        if rollout:
            out["rollout"] = rollout
        if "data/bad_rows" in metrics:
            out["badRows"] = int(metrics["data/bad_rows"])
        if (eta := self.eta_seconds(step)) is not None:
            out["etaSeconds"] = eta
        if self.last_checkpoint_step is not None:
            out["lastCheckpointStep"] = self.last_checkpoint_step
        out.update(self.last_eval)
        if self.tracker is not None and (tracking := self.tracker.status()):
            out["tracking"] = tracking
        if self.goodput is not None and self.goodput.total() > 0:
            out.update(self.goodput.status())
        return out

    def _goodput_scalars(self, step: int) -> None:
        if self.goodput is not None and self.goodput.total() > 0:
            for key, value in self.goodput.scalars().items():
                self.writer.add_scalar(f"goodput/{key}", value, step)

    def evaluated(
        self, step: int, metrics: dict[str, float], samples: list[tuple[str, str]]
    ) -> None:
        """Held-out metrics (spec.eval) and sample generations at step."""
        if not self.is_main:
            return
        self.last_eval = {"evalStep": step, "evalMetrics": dict(metrics)}
        if "loss" in metrics:
            self.last_eval["evalLoss"] = metrics["loss"]
        shown = " ".join(f"{k}={v}" for k, v in _shown(metrics).items())
        if self.bar is not None:
            self.bar.write(f"eval at step {step}: {shown}")
        else:
            log.info("eval at step %d: %s", step, shown)
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"eval/{key}", value, step)
            for i, (prompt, completion) in enumerate(samples):
                text = f"**prompt**\n```\n{prompt}\n```\n**completion**\n```\n{completion}\n```"
                self.writer.add_text(f"eval/sample_{i}", text, step)
        if self.status is not None:
            self.status.patch(self._progress(step, {}))

    def checkpointed(self, step: int) -> None:
        self.last_checkpoint_step = step

    def close(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        if self.status is not None:
            self.status.patch(self._progress(step, metrics))
        if self.writer is not None:
            self._goodput_scalars(step)
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)


def report_phase(phase: str) -> None:
    """The heartbeat's first word, from process 0 before a Progress exists (loading): in
    a pod, status.progress.phase with updatedAt; nothing locally."""
    if (status := StatusWriter.from_env()) is not None:
        status.patch({"phase": phase, "updatedAt": _now()})
