"""Held-out evaluation inside the run (spec.eval).

Every spec.eval.everySteps steps and at the last step, `Evaluation.run` measures the
model on a fixed list of held-out batches, read once at the start: the same rows on
every host and never trained on (`data.open_train_and_eval`). Batches have
spec.training.batchSize rows and are split over hosts like training batches, so each
evaluation reuses one compiled program. Nothing here draws randomness or changes the
model: a run with eval trains exactly as one without.

Each technique gives a `measure` (host batch -> quantities summed over the global batch)
and a `summarize` (sums over all batches -> metrics):

- sft, distill: loss (mean NLL per target token) and perplexity;
- dpo: loss, preference_accuracy, reward_margin, reward_chosen, reward_rejected;
- grpo: mean_reward and pass_rate (every reward but lengthPenalty positive) of greedy
  completions of the held-out prompts.

Metrics go to TensorBoard as eval/<name>, to eval.json under output.uri (the history,
one entry per evaluation) and to status.progress (evalStep, evalLoss, evalMetrics).
With spec.eval.samples, greedy generations for the first held-out prompts go to
TensorBoard as text and eval.json. With several hosts every host decodes the same
prompts together, over the params where they are (`models.greedy_generate`). GRPO's
samples are the greedy completions its evaluation scored (an episode, tool results
included, with spec.grpo.agent), not generated again.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx

from posttrain.trainer import data, models, sft, storage

log = logging.getLogger("posttrain.eval")
EVAL_FILE = "eval.json"

Measure = Callable[[dict[str, np.ndarray]], dict[str, Any]]
Summarize = Callable[[dict[str, float]], dict[str, float]]
Samples = Callable[[], list[tuple[str, str]]]


@dataclass
class Evaluation:
    every_steps: int
    batches: list[dict[str, np.ndarray]]
    measure: Measure
    summarize: Summarize
    sample: Samples | None = None  # spec.eval.samples: (prompt, completion) pairs
    history: History | None = None
    groups: list[tuple[str, int, int]] = field(default_factory=list)  # (source, batches)

    def resume(self, output_uri: str, step: int) -> None:
        """Continue eval.json under output_uri from a run restored at step."""
        self.history = History(output_uri, step)

    def due(self, step: int, total: int) -> bool:
        return step == total or (self.every_steps > 0 and step % self.every_steps == 0)

    def evaluate(self, step: int, progress: Any) -> dict[str, float]:
        """Measure, generate the samples, and report both (eval.json, progress)."""
        scores, samples = self.run(), self.samples()
        if self.history is not None:
            self.history.add(step, scores, samples)
        progress.evaluated(step, scores, samples)
        return scores

    def run(self) -> dict[str, float]:
        """The metrics over every held-out batch, and per source (<source>/<metric>)
        for a mixture's."""
        measured = [self.measure(batch) for batch in self.batches]
        scores = self.summarize(_sums(measured))
        for name, start, end in self.groups:
            for key, value in self.summarize(_sums(measured[start:end])).items():
                scores[f"{name}/{key}"] = value
        return scores

    def samples(self) -> list[tuple[str, str]]:
        """(prompt, greedy completion) for the first held-out prompts."""
        return [] if self.sample is None else self.sample()


def _sums(measured: list[dict[str, Any]]) -> dict[str, float]:
    sums: dict[str, float] = {"batches": float(len(measured))}
    for quantities in measured:
        for key, value in quantities.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


def _batch_rows(spec: Any, available: int, rows_per_batch: int | None) -> int:
    if rows_per_batch and available >= rows_per_batch:
        return rows_per_batch
    return spec.training.batch_size


def held_out_batches(
    spec: Any,
    rows: data.Rows,
    process_index: int,
    process_count: int,
    rows_per_batch: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """This host's share of the held-out batches, in the files' order (unpacked: each
    held-out example once). A batch holds spec.training.batchSize rows, or
    `rows_per_batch` where the held-out data has that many."""
    batch_size = _batch_rows(spec, len(rows), rows_per_batch)
    if len(rows) < batch_size:
        raise data.DataError(
            f"spec.eval: the held-out data has {len(rows)} rows, fewer than "
            f"spec.training.batchSize ({batch_size}); hold out more (spec.eval.fraction) or "
            "give more data (spec.eval.source)"
        )
    loader = data.DataLoader(
        rows,
        batch_size=batch_size,
        process_index=process_index,
        process_count=process_count,
        shuffle=False,
        threads=0,
    )
    count = min(spec.eval.max_batches, loader.steps_per_epoch)
    return list(loader.take(count))


def build(
    spec: Any,
    tokenizer: data.Tokenizer,
    held_out: data.Records | data.RecordsView | None,
    process: Any,
    measure: Measure,
    summarize: Summarize,
    model: nnx.Module,
    rows_per_batch: int | None = None,
    scored: Samples | None = None,
) -> Evaluation | None:
    """The job's Evaluation (None without spec.eval). `held_out` is the held-out rows, or
    a mixture's [(source, rows)]: each source is measured alone too. `rows_per_batch`:
    see held_out_batches. `scored`: the samples as `measure` generated and scored them
    (GRPO's greedy completions), instead of generating them again."""
    if held_out is None:
        return None
    settings = spec.eval
    named = held_out if isinstance(held_out, list) else [("", held_out)]
    batches: list[dict[str, np.ndarray]] = []
    groups: list[tuple[str, int, int]] = []
    for name, records in named:
        rows = data.build_rows(spec, tokenizer, records)
        start = len(batches)
        batches += held_out_batches(
            spec, rows, process.process_id, process.num_processes, rows_per_batch
        )
        if name and len(named) > 1:
            groups.append((name, start, len(batches)))
    log.info(
        "held-out evaluation: %d rows, %d batches of %d every %s",
        sum(len(r) for _, r in named),
        len(batches),
        _batch_rows(spec, len(named[0][1]), rows_per_batch),
        f"{settings.every_steps} steps" if settings.every_steps else "run (at the end)",
    )
    sample = scored if settings.samples else None
    if settings.samples and sample is None:
        prompts = data.generation_prompts(spec, tokenizer, named[0][1], settings.samples)
        sample = _greedy(model, tokenizer, prompts, settings.max_new_tokens)
    return Evaluation(settings.every_steps, batches, measure, summarize, sample, groups=groups)


def _greedy(
    model: nnx.Module, tokenizer: data.Tokenizer, prompts: list[str], max_new_tokens: int
) -> Samples:
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []

    def generate(prompt: str) -> str:
        ids = tokenizer.encode(prompt)
        out = models.greedy_generate(model, tokenizer, ids, max_new_tokens, eos_token_ids=eos)
        return out.text or ""

    return lambda: [(prompt, generate(prompt)) for prompt in prompts]


# ------------------------------------------------------------------- per technique


def token_loss(model: nnx.Module, to_global: Callable[[Any], Any]) -> tuple[Measure, Summarize]:
    """Held-out NLL per target token and perplexity (sft, distill: the policy's own
    likelihood of the held-out answers). to_global: host batch -> global arrays."""
    nll = nnx.jit(sft.token_nll)

    def measure(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        total, count = nll(model, to_global(batch))
        return {"nll": total, "tokens": count}

    def summarize(sums: dict[str, float]) -> dict[str, float]:
        loss = sums["nll"] / max(sums["tokens"], 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0))}

    return measure, summarize


def batch_means(
    fn: Callable[[dict[str, Any]], dict[str, Any]], to_global: Callable[[Any], Any]
) -> tuple[Measure, Summarize]:
    """For metrics that are means over a batch's rows (dpo): every held-out batch has
    the same number of rows, so the mean over batches is the mean over rows."""

    def measure(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return fn(to_global(batch))

    def summarize(sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["batches"], 1.0)
        return {k: v / n for k, v in sums.items() if k != "batches"}

    return measure, summarize


def across_hosts(sums: dict[str, float]) -> dict[str, float]:
    """Host-local sums (computed outside a global jit, e.g. rewards of host-local
    generations) added up over every host."""
    if jax.process_count() == 1:
        return sums
    from jax.experimental import multihost_utils

    keys = sorted(sums)
    local = np.asarray([sums[k] for k in keys], np.float32)
    total = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(keys)).sum(0)
    return dict(zip(keys, (float(v) for v in total), strict=True))


# ------------------------------------------------------------------------ history


class History:
    """eval.json under output.uri: [{"step": N, "metrics": {...}}, ...]. On resume the
    entries after the restored step are dropped (they are measured again)."""

    def __init__(self, output_uri: str, resumed_step: int):
        self.uri = storage.join(output_uri, EVAL_FILE)
        self.entries: list[dict[str, Any]] = []
        try:
            previous = json.loads(storage.read_text(self.uri))
        except (OSError, ValueError):
            previous = []
        if isinstance(previous, list):
            self.entries = [
                e for e in previous if isinstance(e, dict) and e.get("step", 0) <= resumed_step
            ]

    def add(self, step: int, metrics: dict[str, float], samples: list[tuple[str, str]]) -> None:
        entry: dict[str, Any] = {"step": step, "metrics": metrics}
        if samples:
            entry["samples"] = [{"prompt": p, "completion": c} for p, c in samples]
        # A step measured again replaces its entry (step 0 of a run stopped before its
        # first checkpoint, measured again when the run starts over).
        self.entries = [e for e in self.entries if e.get("step") != step] + [entry]
        if jax.process_index() == 0:
            storage.write_text(self.uri, json.dumps(self.entries, indent=2) + "\n")
