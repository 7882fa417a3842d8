"""Rollouts without a reward (a verifier service gave none: NaN) leave their groups.

A batch keeps its shape (the train step is compiled for it), so a dropped rollout stays
in the batch with its completion masked (no token of it carries loss) and no advantage.
Its group's advantages are those of the rollouts that were scored: (r - mean) / std over
them (or r - mean, Dr. GRPO), as Tunix's estimators compute over a whole group; a group
with one scored rollout has nothing to compare it with and carries no advantage, as a
group whose rewards all agree. In the reward metrics a dropped rollout counts as its
group's mean (0 when none of its group was scored), so it moves no mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

EPS = 1e-6  # as Tunix's grpo estimator


def unscored(parts: np.ndarray) -> np.ndarray:
    """Which rows of the per-reward matrix [rollouts, rewards] lack a reward."""
    return np.isnan(parts).any(axis=-1)


def group_advantages(total: np.ndarray, num_generations: int, std_normalise: bool) -> np.ndarray:
    """GRPO's group-relative advantages over each group's scored rollouts (NaN: not
    scored, advantage 0)."""
    grouped = np.asarray(total, np.float64).reshape(-1, num_generations)
    scored = ~np.isnan(grouped)
    count = scored.sum(axis=-1, keepdims=True)
    values = np.where(scored, grouped, 0.0)
    mean = values.sum(axis=-1, keepdims=True) / np.maximum(count, 1)
    out = np.where(scored, grouped - mean, 0.0)
    if std_normalise:
        var = np.where(scored, out**2, 0.0).sum(axis=-1, keepdims=True) / np.maximum(count - 1, 1)
        out = out / (np.sqrt(var) + EPS)
    out = np.where(count > 1, out, 0.0)
    return out.reshape(-1).astype(np.float32)


def scored_total(sample: dict[str, Any]) -> np.ndarray:
    """The sample's total reward per rollout, NaN where any of its rewards is missing."""
    total = np.asarray(sample["total"], np.float64)
    return np.where(unscored(np.asarray(sample["rewards"], np.float32)), np.nan, total)


def drop_unscored(
    sample: dict[str, Any],
    num_generations: int,
    std_normalise: bool,
    advantages: Callable[..., Any],
) -> dict[str, Any]:
    """`sample` (from GrpoRun._sample: rewards [rollouts, rewards], total, completion_mask)
    with its advantages; rollouts without a reward masked, counted (reward_failures)."""
    parts = np.asarray(sample["rewards"], np.float32)
    failed = unscored(parts)
    out = dict(sample)
    total = out.pop("total")
    out["reward_failures"] = np.int32(failed.sum())
    if not failed.any():
        out["advantages"] = np.asarray(
            advantages(rewards=total, num_generations=num_generations), np.float32
        )
        return out
    out["advantages"] = group_advantages(scored_total(sample), num_generations, std_normalise)
    out["completion_mask"] = np.where(failed[:, None], 0, out["completion_mask"]).astype(
        np.asarray(sample["completion_mask"]).dtype
    )
    out["rewards"] = _filled(parts, num_generations)
    return out


def _filled(parts: np.ndarray, num_generations: int) -> np.ndarray:
    """NaN rewards replaced by their group's mean of that reward (0 when none scored)."""
    grouped = parts.reshape(-1, num_generations, parts.shape[-1])
    with np.errstate(invalid="ignore"):
        scored = ~np.isnan(grouped)
        count = scored.sum(axis=1, keepdims=True)
        mean = np.where(scored, grouped, 0.0).sum(axis=1, keepdims=True) / np.maximum(count, 1)
    return np.where(scored, grouped, mean).reshape(parts.shape).astype(np.float32)


def service_seconds(reward_fns: Sequence[Any]) -> dict[str, float]:
    """Seconds spent waiting on verifier services since the last call, when any."""
    timed = [fn for fn in reward_fns if hasattr(fn, "take_seconds")]
    if not timed:
        return {}
    return {"reward_service_seconds": float(sum(fn.take_seconds() for fn in timed))}
