"""Regular expressions from users (spec.lora.targetModules, GRPO reward patterns).

A pattern is parsed and refused, not time-boxed: besides compile errors, `regex_error`
refuses the shapes that make Python's backtracking engine take exponential time or
huge memory: a variable quantifier inside a repeated group (`(a+)+`, `(a?){30}`), repeat counts
above MAX_REPEAT (`a{4294967296}`), and nesting deeper than MAX_DEPTH groups. The spec's
validators call it, so `posttrain validate`, the admission webhook and the trainer
refuse the same patterns; the trainer compiles with `compile_user_regex`.
"""

from __future__ import annotations

import re
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser  # type: ignore[attr-defined]
from typing import Any

MAX_REPEAT = 1000
MAX_DEPTH = 32
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def _children(op: Any, av: Any) -> list[Any]:
    """The sub-patterns directly under one parsed node."""
    if op in _REPEATS:
        return [av[2]]
    if op is sre.SUBPATTERN:
        return [av[3]]
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return [av[1]]
    if op is sre.BRANCH:
        return list(av[1])
    if op is sre.GROUPREF_EXISTS:
        return [p for p in av[1:] if p is not None]
    if op is sre.ATOMIC_GROUP:
        return [av]
    return []


def _repeats_inside(pattern: Any) -> bool:
    """True when a quantifier of variable count (?, *, +, {m,n}) sits anywhere below."""
    stack = [pattern]
    while stack:
        for op, av in stack.pop():
            if op in _REPEATS and av[0] != av[1]:
                return True
            stack.extend(_children(op, av))
    return False


def _shape_error(pattern: Any) -> str | None:
    stack = [(pattern, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"nests deeper than {MAX_DEPTH} groups"
        for op, av in node:
            if op in _REPEATS:
                low, high, body = av
                bound = low if high is sre.MAXREPEAT else high
                if bound > MAX_REPEAT:
                    return f"repeats more than {MAX_REPEAT} times"
                if high > 1 and _repeats_inside(body):
                    return (
                        "has a quantifier inside a repeated group (like (a+)+), which can "
                        "take exponential time; write it without the nested repeat"
                    )
            stack.extend((child, depth + 1) for child in _children(op, av))
    return None


def regex_error(pattern: str) -> str | None:
    """Why `pattern` may not be used (a compile error or a dangerous shape), or None."""
    try:
        parsed = _parser.parse(pattern)
    except re.error as e:
        return f"not a valid regular expression: {e}"
    except (RecursionError, OverflowError, MemoryError):
        return "not a valid regular expression: too large or nested too deeply"
    if problem := _shape_error(parsed):
        return f"refused regular expression: it {problem}"
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return f"not a valid regular expression: {e}"
    return None


def compile_user_regex(pattern: str, field: str, flags: int = 0) -> re.Pattern[str]:
    """Compile a user's pattern, or raise ValueError naming `field`."""
    if problem := regex_error(pattern):
        raise ValueError(f"{field}: {problem}")
    return re.compile(pattern, flags)
