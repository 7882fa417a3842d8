"""Orbax checkpoints holding everything a resume needs: trainable params, optimizer state
and the data iterator's position.

- Saves are asynchronous on accelerators (training continues while arrays are written;
  `background_saves`) and atomic: Orbax writes into a temporary directory and renames it when complete, so a crash mid-save
  leaves no half-written step behind.
- `restore_latest` walks the steps newest first; a step that cannot be read (corrupt or
  partial) is skipped with a warning and the one before it is used. The unreadable step
  is renamed to `<step>.unreadable` (kept for inspection, never deleted) so training can
  write that step again.
- Works on local paths and gs://. On gs:// every host writes its own shards straight to
  the bucket (tensorstore) and Orbax marks a finished step with `commit_success.txt`
  (object stores have no atomic rename); a step without it is not a checkpoint.
- A step's meta names the layout of its layers (`layers`: stacked when the job scanned
  them, spec.training.layerLoop); a restore into the other layout converts, so a job
  resumes whichever way the checkpoint was written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import jax
import orbax.checkpoint as ocp

from posttrain.trainer import storage
from posttrain.trainer.models import scan

log = logging.getLogger("posttrain.checkpoint")


def background_saves(checkpoint_spec: Any, platform: str) -> bool:
    """Whether saves run in the background: spec.checkpoint.async where the job sets it;
    otherwise on accelerators only. A background save first copies the trained state out of
    the devices' memory; on a CPU that copy is a second one in the host's memory (0.9 GiB
    more at the distillation example's saves), so a CPU job saves in the foreground."""
    if "async_" in checkpoint_spec.model_fields_set:
        return bool(checkpoint_spec.async_)
    return platform != "cpu"


@dataclass
class Restored:
    step: int
    state: Any  # the pytree given as `target`, filled with saved values
    data_state: dict[str, Any]
    meta: dict[str, Any]


class Checkpoints:
    """A directory of step checkpoints; keeps the newest `keep`."""

    def __init__(self, directory: str, keep: int, asynchronous: bool = True):
        if storage.is_gcs(directory):
            storage.configure_gcs_clients()
        else:
            directory = os.path.abspath(directory)  # Orbax takes absolute paths only
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=asynchronous,
            create=True,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(
            directory, options=options, item_names=("state", "data", "meta")
        )

    def save(self, step: int, state: Any, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start saving `state` (a pytree of arrays) at `step`; returns before it is on disk
        when asynchronous. Call `wait()` to block until it is committed."""
        stacked = scan.layout_of(state)
        if stacked is not None:
            meta = {**meta, "layers": "stacked" if stacked else "per-layer"}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def meta(self, step: int) -> dict[str, Any]:
        return dict(
            self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        )

    def _restore(self, step: int, target: Any) -> Restored:
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
        wanted = scan.layout_of(abstract)
        saved = self.meta(step).get("layers", "per-layer") == "stacked"
        if wanted is not None and saved != wanted:  # written with the other layerLoop
            abstract = scan.to_layout(abstract, saved)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        state = out["state"]
        if wanted is not None and saved != wanted:
            state = scan.to_layout(state, wanted)
        return Restored(step, state, dict(out["data"]), dict(out["meta"]))

    def restore(self, step: int, target: Any, field: str = "--step") -> Restored:
        """Checkpoint `step`, restored into the shapes/shardings of `target`; an error
        naming `field` and the steps there are when it is absent or unreadable."""
        steps = self.steps()
        if step not in steps:
            there = ", ".join(map(str, steps)) or "none"
            raise ValueError(
                f"{field}: no checkpoint {step} under {self.directory} (there: {there})"
            )
        try:
            return self._restore(step, target)
        except Exception as e:  # noqa: BLE001 - Orbax and tensorstore raise many types
            raise ValueError(
                f"{field}: checkpoint {self.directory}/{step} is unreadable ({e})"
            ) from None

    def restore_latest(self, target: Any) -> Restored | None:
        """The newest readable checkpoint, restored into the shapes/shardings of `target`;
        None when there is none."""
        unreadable = []
        for step in reversed(self.steps()):
            try:
                restored = self._restore(step, target)
                self._quarantine(unreadable)
                return restored
            except Exception as e:  # noqa: BLE001 - any unreadable step is skipped
                unreadable.append(step)
                log.warning(
                    "checkpoint %s/%s is unreadable (%s: %s); trying the previous one",
                    self.directory,
                    step,
                    type(e).__name__,
                    str(e).splitlines()[0][:300] if str(e) else "",
                )
        self._quarantine(unreadable)
        return None

    def _quarantine(self, steps: list[int]) -> None:
        if not steps or jax.process_index() != 0:
            return
        for step in steps:
            target = storage.join(self.directory, f"{step}.unreadable")
            copies = 0
            while storage.exists(target):
                copies += 1
                target = storage.join(self.directory, f"{step}.unreadable-{copies}")
            storage.move(storage.join(self.directory, str(step)), target)
            log.warning(
                "moved unreadable checkpoint %s/%s to %s",
                self.directory,
                step,
                storage.basename(target),
            )
        self.manager.reload()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class BestCheckpoint:
    """checkpoint.keepBest: the checkpoint with the best held-out value of one metric,
    kept apart from the newest ones (under checkpoints-best/, one step), with the value in
    its meta. A resumed run compares against the value found there."""

    def __init__(self, directory: str, metric: str, lower_is_better: bool):
        self.metric, self.lower = metric, lower_is_better
        self.checkpoints = Checkpoints(directory, keep=1, asynchronous=False)
        self.step: int | None = None
        self.value: float | None = None
        step = self.checkpoints.latest_step()
        if step is not None:
            meta = self.checkpoints.meta(step)
            self.step, self.value = step, float(meta["value"])

    def better(self, value: float) -> bool:
        if self.value is None:
            return True
        return value < self.value if self.lower else value > self.value

    def offer(self, step: int, scores: dict[str, float], state: Any, data_state: dict) -> bool:
        """Keep `state` as the best when scores[metric] beats the best so far."""
        value = float(scores[self.metric])
        if not self.better(value):
            return False
        self.checkpoints.save(step, state, data_state, {"metric": self.metric, "value": value})
        self.checkpoints.wait()
        self.step, self.value = step, value
        log.info("best %s so far: %.6g at step %d (kept)", self.metric, value, step)
        return True

    def restore(self, target: Any) -> Restored:
        if self.step is None:
            raise ValueError("checkpoint.keepBest: no best checkpoint was kept")
        return self.checkpoints.restore(self.step, target, field="checkpoint.keepBest")

    def close(self) -> None:
        self.checkpoints.close()
