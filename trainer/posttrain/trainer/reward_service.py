"""Rewards from a verifier service (spec.grpo.rewards[].type http).

``HttpReward`` is a reward function as the others in ``rewards`` are (``fn(prompts,
completions, **columns) -> list[float]``). It POSTs the completions in batches of
``batchSize``, ``concurrency`` POSTs at a time:

    POST <url>  {"items": [{"prompt": str, "completion": str, "answer": str | null,
                            "metadata": {"index": int, "completion_tokens": int, ...}}]}
    200         {"rewards": [number | null, ...]}   (one per item, in order)

A POST that fails (no connection, a timeout, HTTP 5xx, 408 or 429, an answer that is not
that JSON) is tried again ``retries`` times after 0.5 s, 1 s, 2 s ... (at most
BACKOFF_MAX_S). Other HTTP errors (401, 404, ...) are not tried again: asking again
changes nothing. An item whose reward is null, or whose POST failed for good, has no
reward: when more than ``maxFailureFraction`` of the call's items have none, those are
asked for again, STEP_ROUNDS - 1 more times. The items still without one get NaN, which
``reward_failures`` turns into a rollout dropped from its group (masked, no advantage),
counted in ``train/reward_failures``, never a reward of 0. Past ``maxFailures`` rollouts
without a reward since the trainer started, ``RewardServiceDown`` stops the job with the
service's URL and its last error (exit 75, worth a restart of the pod).

The auth header's value comes from the environment (``service_urls.reward_auth_env``: the
rendered JobSet sets it from the Secret by reference). It is never logged, and redirects
are not followed, so it goes to the named URL only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from posttrain.api.service_urls import reward_auth_env
from posttrain.api.spec import HttpRewardSpec
from posttrain.trainer.storage import Unreachable

log = logging.getLogger("posttrain.trainer")

BACKOFF_S = 0.5  # the first retry's wait; each further one waits twice as long
BACKOFF_MAX_S = 30.0
STEP_ROUNDS = 3  # asks for a call's missing rewards: the first and up to 2 more
_RETRY_STATUS = frozenset({408, 429})


class RewardServiceDown(Unreachable):
    """Too many rollouts went without a reward from a verifier service."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are errors: the auth header goes to the job's URL and nowhere else."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        return None


OPENER = urllib.request.build_opener(_NoRedirect)  # also the http tools'


class _Failed(Exception):
    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


def auth_headers(
    spec: HttpRewardSpec, env: str, field: str, environ: Mapping[str, str]
) -> dict[str, str]:
    """The auth header of a service (none without authSecret), from variable `env`."""
    if spec.auth_secret is None:
        return {}
    value = environ.get(env, "")
    if not value:
        ref = spec.auth_secret
        raise ValueError(
            f"{field}.authSecret: the trainer has no {env} (Secret {ref.name}, key {ref.key}); "
            f"on a cluster the JobSet sets it, for `posttrain run` export {env}"
        )
    header = str(spec.auth_header)
    value = value.strip()
    return {header: f"Bearer {value}" if header.lower() == "authorization" else value}


class HttpReward:
    """spec.grpo.rewards[index] of type http: a weighted reward function whose missing
    rewards are NaN (see the module docstring)."""

    def __init__(
        self,
        spec: HttpRewardSpec,
        index: int,
        weight: float,
        *,
        environ: Mapping[str, str] = os.environ,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.spec, self.weight, self.sleep = spec, weight, sleep
        self.field = f"spec.grpo.rewards[{index}]"
        self.url = str(spec.url)
        self.headers = {
            "Content-Type": "application/json",
            **auth_headers(spec, reward_auth_env(index), f"{self.field}.http", environ),
        }
        self.failures = 0  # rollouts without a reward since the trainer started
        self.last_error: str | None = None
        self.seconds = 0.0  # time spent waiting on the service, since last taken
        self._lock = threading.Lock()
        self.__name__ = self.__qualname__ = f"http_{index}"

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **kwargs: Any):
        start = time.monotonic()
        items = _items(prompts, completions, kwargs)
        scores: list[float | None] = [None] * len(items)
        pending = list(range(len(items)))
        for round_ in range(STEP_ROUNDS):
            if round_:
                log.warning(
                    "%s: %d of %d completions got no reward from %s (%s); asking again",
                    self.field, len(pending), len(items), self.url, self.last_error,
                )  # fmt: skip
                self.sleep(backoff(self.spec.retries + round_ - 1))
            self._score(items, pending, scores)
            pending = [i for i in pending if scores[i] is None]
            if len(pending) <= self.spec.max_failure_fraction * len(items):
                break
        self.seconds += time.monotonic() - start
        if pending:
            self.failures += len(pending)
            log.warning(
                "%s: %d of %d completions got no reward from %s (%s); dropped from their "
                "groups (%d since the start, maxFailures %d)",
                self.field, len(pending), len(items), self.url, self.last_error,
                self.failures, self.spec.max_failures,
            )  # fmt: skip
            if self.failures > self.spec.max_failures:
                raise RewardServiceDown(
                    f"{self.field}.http: the reward service {self.url} gave no reward for "
                    f"{self.failures} completions (maxFailures {self.spec.max_failures}); "
                    f"last error: {self.last_error}"
                )
        return [self.weight * s if s is not None else math.nan for s in scores]

    def take_seconds(self) -> float:
        """The time spent on the service since the last call of this (for the metrics)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _score(self, items: list[dict], which: list[int], scores: list[float | None]) -> None:
        size = int(self.spec.batch_size)
        batches = [which[i : i + size] for i in range(0, len(which), size)]

        def one(batch: list[int]) -> None:
            got = self._post([items[i] for i in batch])
            for i, value in zip(batch, got, strict=True):
                scores[i] = value

        workers = min(int(self.spec.concurrency), len(batches)) or 1
        with ThreadPoolExecutor(workers, thread_name_prefix="reward-http") as pool:
            list(pool.map(one, batches))

    def _post(self, items: list[dict]) -> list[float | None]:
        """The rewards of one batch (None for each item without one), after retries."""
        body = json.dumps({"items": items}).encode()
        for attempt in range(int(self.spec.retries) + 1):
            if attempt:
                self.sleep(backoff(attempt - 1))
            try:
                return self._post_once(body, len(items))
            except _Failed as e:
                with self._lock:
                    self.last_error = str(e)
                if not e.retry:
                    break
        return [None] * len(items)

    def _post_once(self, body: bytes, count: int) -> list[float | None]:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with OPENER.open(request, timeout=float(self.spec.timeout_seconds)) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            retry = e.code >= 500 or e.code in _RETRY_STATUS
            raise _Failed(f"HTTP {e.code} {e.reason}", retry) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise _Failed(f"{type(reason).__name__}: {reason}", True) from None
        return _rewards(raw, count)


def _rewards(raw: bytes, count: int) -> list[float | None]:
    """The rewards of a service's answer, or _Failed saying what is wrong with it."""
    try:
        rewards = json.loads(raw)["rewards"]
    except (ValueError, KeyError, TypeError):
        raise _Failed('the answer is not JSON {"rewards": [...]}', True) from None
    if not isinstance(rewards, list) or len(rewards) != count:
        got = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
        raise _Failed(f"the answer has {got} rewards for {count} items", True)
    out: list[float | None] = []
    for value in rewards:
        if value is None:
            out.append(None)
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise _Failed(f"a reward is {type(value).__name__}, not a number or null", True)
        else:
            out.append(float(value) if math.isfinite(value) else None)
    return out


def backoff(attempt: int) -> float:
    """The wait before try `attempt` + 1 of a request (also the http tools')."""
    return min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt)


# Arguments Tunix passes to reward functions that are not the rollout's own.
_NOT_METADATA = frozenset({"mode", "trajectory_ids", "answer", "completion_tokens"})


def _items(prompts: Sequence[str], completions: Sequence[str], kwargs: dict) -> list[dict]:
    answers = kwargs.get("answer")
    tokens = kwargs.get("completion_tokens")
    extra = {k: v for k, v in kwargs.items() if k not in _NOT_METADATA}
    items = []
    for j, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        metadata: dict[str, Any] = {"index": j}
        if tokens is not None:
            metadata["completion_tokens"] = int(tokens[j])
        for key, values in extra.items():
            metadata[key] = _plain(values[j])
        answer = None if answers is None else _plain(answers[j])
        items.append(
            {
                "prompt": str(prompt),
                "completion": str(completion),
                "answer": None if answer is None else str(answer),
                "metadata": metadata,
            }
        )
    return items


def _plain(value: Any) -> Any:
    """A dataset value as JSON can hold it (numpy scalars and arrays included)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)
