"""GRPO rewards from spec.grpo.rewards: built-ins and users' Python functions.

Every reward is a function ``fn(prompts, completions, **columns) -> list[float]`` (the
signature Tunix's reward manager calls); ``columns`` holds the dataset columns of the
batch (``answer``), repeated once per completion. The total reward of a completion is
the weighted sum of all rewards.

- exactAnswer: 1 when the last number in the completion equals the answer column
  (compared as numbers when both parse, else as stripped text), else 0. In an episode
  with tools, the last number of the model's last turn (``final_turn``): a number a tool
  answered is not the model's answer.
- regexFormat: 1 when ``re.search(pattern, completion)`` finds a match (``.`` matches
  newlines) within MATCH_TIMEOUT_S (the ``regex`` module, re's syntax), else 0.
- lengthPenalty: ``-(tokens - targetLength) / targetLength`` when the completion has more
  than targetLength tokens, else 0 (tokens: the sampled completion's, EOS excluded).
- python: ``module:callable`` imported from the trainer's Python path.
- http: a verifier service (``reward_service.HttpReward``); a completion it gives no
  reward gets NaN, and ``reward_failures`` drops it from its group.

Nothing here imports JAX.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import regex

from posttrain.api import functions
from posttrain.api.patterns import compile_user_regex
from posttrain.api.spec import GrpoSpec, RewardSpec

log = logging.getLogger("posttrain.trainer")
RewardFn = Callable[..., list[float]]

# Arguments Tunix passes to reward functions that are not dataset columns.
_NOT_COLUMNS = frozenset({"mode", "trajectory_ids", "row_index", "completion_tokens"})

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def last_number(text: str) -> str | None:
    """The last number written in text ('1,234' -> '1234'), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _same_number(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b.replace(",", "").strip())
    except ValueError:
        return a.strip() == b.strip()
    return math.isclose(x, y, rel_tol=0.0, abs_tol=1e-9)


def exact_answer(completions: Sequence[str], answers: Sequence[Any]) -> list[float]:
    out = []
    for text, answer in zip(completions, answers, strict=True):
        got = last_number(text)
        out.append(1.0 if got is not None and _same_number(got, str(answer)) else 0.0)
    return out


# Each regexFormat match is bounded: a pattern that passed validate's shape checks may
# still be polynomial in the completion's length (`.*a.*aX`), and a step must not wait on
# one. A match that runs out of time scores 0, as no match (and is said once a run).
MATCH_TIMEOUT_S = 0.1


def regex_format(
    completions: Sequence[str], pattern: regex.Pattern[str], field: str = "pattern"
) -> list[float]:
    out = []
    for text in completions:
        try:
            found = pattern.search(text, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            found = None
            if field not in _timed_out:
                _timed_out.add(field)
                log.warning(
                    "%s: a match took over %.1f s on a %d-character completion and scores 0; "
                    "a simpler pattern (fewer .* or \\s* next to each other) matches in time",
                    field, MATCH_TIMEOUT_S, len(text),
                )  # fmt: skip
        out.append(1.0 if found else 0.0)
    return out


_timed_out: set[str] = set()  # fields whose pattern ran out of time (said once)


def length_penalty(lengths: Sequence[int], target: int) -> list[float]:
    return [-(n - target) / target if n > target else 0.0 for n in lengths]


def _columns(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _NOT_COLUMNS}


def _named(fn: RewardFn, name: str) -> RewardFn:
    fn.__name__ = fn.__qualname__ = name
    return fn


def import_function(path: str, field: str) -> Callable[..., Any]:
    """The callable at 'module:callable', or ValueError naming the spec field. Python's
    own modules, and modules outside the installation's allowed prefixes, are refused
    (posttrain.api.functions), also for a callable that is only re-exported by another
    module (`from subprocess import run`)."""
    module_name, _, attr = path.partition(":")
    allowed = functions.allowed_modules()
    if why := functions.function_error(path, allowed):
        raise ValueError(f"{field}: {why}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
        raise ValueError(
            f"{field}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            "install it in the trainer image or put it on PYTHONPATH"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{field}: module {module_name!r} has no callable {attr!r}")
    defined_in = getattr(fn, "__module__", None) or module_name
    if why := functions.function_error(f"{defined_in}:{attr}", allowed):
        raise ValueError(f"{field}: {path!r} is {defined_in}.{attr}: {why}")
    return fn


def build_reward(
    spec: RewardSpec,
    index: int,
    *,
    count_tokens: Callable[[str], int] | None = None,
) -> RewardFn:
    """One weighted reward function for spec.grpo.rewards[index]."""
    field = f"spec.grpo.rewards[{index}]"
    weight = float(spec.weight)
    kind = str(spec.type)
    name = f"{kind}_{index}"

    if kind == "exactAnswer":

        def reward(prompts, completions, **kwargs):
            answers = kwargs.get("answer")
            if answers is None:
                raise ValueError(
                    f"{field}: exactAnswer needs the answer column (spec.data.columns.answer)"
                )
            final = kwargs.get("final_turn")  # an episode's answer is its last model turn
            texts = completions if final is None else final
            return [weight * r for r in exact_answer(texts, list(answers))]

    elif kind == "regexFormat":
        if not spec.pattern:
            raise ValueError(f"{field}.pattern: a regexFormat reward needs pattern")
        compile_user_regex(spec.pattern, f"{field}.pattern")  # refused shapes, named
        pattern = regex.compile(spec.pattern, regex.DOTALL | regex.VERSION0)  # re's syntax

        def reward(prompts, completions, **kwargs):
            return [weight * r for r in regex_format(completions, pattern, f"{field}.pattern")]

    elif kind == "lengthPenalty":
        if spec.target_length is None:
            raise ValueError(
                f"{field}.targetLength: a lengthPenalty reward needs targetLength (tokens)"
            )
        target = int(spec.target_length)
        count = count_tokens or (lambda text: len(text.split()))

        def reward(prompts, completions, **kwargs):
            lengths = kwargs.get("completion_tokens")  # the sampled token counts, when known
            if lengths is None:
                lengths = [count(c) for c in completions]
            return [weight * r for r in length_penalty(lengths, target)]

    elif kind == "python":
        if not spec.function:
            raise ValueError(f"{field}.function: a python reward needs function (module:callable)")
        user_fn = import_function(spec.function, f"{field}.function")

        def reward(prompts, completions, **kwargs):
            got = user_fn(prompts=list(prompts), completions=list(completions), **_columns(kwargs))
            values = [float(v) for v in got]
            if len(values) != len(completions):
                raise ValueError(
                    f"{field}.function: {spec.function} returned {len(values)} rewards for "
                    f"{len(completions)} completions"
                )
            return [weight * v for v in values]

    elif kind == "http":
        if spec.http is None:
            raise ValueError(f"{field}.http: an http reward needs http.url (the verifier service)")
        from posttrain.trainer.reward_service import HttpReward

        return HttpReward(spec.http, index, weight)

    else:  # pragma: no cover - the API enum has no other values
        raise ValueError(f"{field}.type: unknown reward type {kind!r}")
    return _named(reward, name)


def build_rewards(
    grpo: GrpoSpec, *, count_tokens: Callable[[str], int] | None = None
) -> list[RewardFn]:
    """The weighted reward functions of spec.grpo, in order."""
    return [build_reward(r, i, count_tokens=count_tokens) for i, r in enumerate(grpo.rewards)]


def total_rewards(
    fns: Sequence[RewardFn], prompts: Sequence[str], completions: Sequence[str], **columns: Any
) -> list[float]:
    """The summed reward of each completion (for evaluation outside Tunix)."""
    totals = [0.0] * len(completions)
    for fn in fns:
        for j, v in enumerate(fn(prompts=prompts, completions=completions, **columns)):
            totals[j] += v
    return totals
