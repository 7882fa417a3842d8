r"""Regular expressions from users (spec.lora.targetModules, GRPO reward patterns).

A pattern is parsed and refused, not time-boxed: besides compile errors, `regex_error`
refuses the shapes that make Python's backtracking engine take exponential or
high-polynomial time, or huge memory:

- a variable quantifier inside a repeated group (`(a+)+`, `(a?){30}`): exponential;
- alternatives inside a repeated group that can begin with the same character, or be
  empty (`(a|a)*X`, `(a|aa)+$`, `(ab|a|b)*c`, `(a|ab)*c`): the text can be split
  among them in exponentially many ways (`(a|a)*X` took 1.9 s on 24 characters, each
  one more doubling it). Single characters (`(\w|\d)+`) are one class to Python's
  parser, not alternatives, and pass;
- long repeats (unbounded, or above LONG_REPEAT) over characters they share, with only
  optional parts between them (`(.*)(.*)`, `\w+\w+`, `.*\s*`): each split of the text
  between them is tried, `(.*)(.*)(.*)(.*)(.*)X` took 39 s on 80 characters;
- more than MAX_WIDE long repeats over (almost) any character (`.*`, `[^x]+`, `\S*`):
  `.*a.*a.*aX` is cubic in the completion's length even with literals between;
- repeat counts above MAX_REPEAT (`a{4294967296}`) and nesting deeper than MAX_DEPTH.

So `<answer>\s*-?[0-9]+\s*</answer>` and `^<think>.*</think>\s*<answer>.*</answer>$`
pass. The spec's validators call it, so `posttrain validate`, the admission webhook and the trainer
refuse the same patterns; the trainer compiles with `compile_user_regex`.
"""

from __future__ import annotations

import re
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser  # type: ignore[attr-defined]
from typing import Any

MAX_REPEAT = 1000
MAX_DEPTH = 32
LONG_REPEAT = 100  # a repeat allowing more than this counts as long
MAX_WIDE = 2
# A set of characters: (False, chars) is those, (True, chars) all but those (WIDE: any).
Chars = tuple[bool, frozenset[str]]
WIDE: Chars = (True, frozenset())
NOTHING: Chars = (False, frozenset())
_CATEGORIES = {
    sre.CATEGORY_DIGIT: frozenset("0123456789"),
    sre.CATEGORY_SPACE: frozenset(" \t\n\r\f\v"),
    sre.CATEGORY_WORD: frozenset("0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
}
_NOT_CATEGORIES = {
    sre.CATEGORY_NOT_DIGIT: sre.CATEGORY_DIGIT,
    sre.CATEGORY_NOT_SPACE: sre.CATEGORY_SPACE,
    sre.CATEGORY_NOT_WORD: sre.CATEGORY_WORD,
}
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


def _first(node: Any) -> tuple[Chars, bool]:
    """The characters a match of the sub-pattern `node` can begin with, and whether it
    can match the empty text."""
    out: Chars = NOTHING
    for op, av in node:
        if op in (sre.AT, sre.ASSERT, sre.ASSERT_NOT):
            continue  # consumes nothing
        if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
            return _union(out, _chars([(op, av)])), False
        if op in _REPEATS:
            first, empty = _first(av[2])
            out = _union(out, first)
            if av[0] > 0 and not empty:
                return out, False
        elif op is sre.BRANCH:
            alternatives = [_first(a) for a in av[1]]
            for first, _ in alternatives:
                out = _union(out, first)
            if not any(empty for _, empty in alternatives):
                return out, False
        elif op is sre.SUBPATTERN or op is sre.ATOMIC_GROUP:
            first, empty = _first(_children(op, av)[0])
            out = _union(out, first)
            if not empty:
                return out, False
        else:  # a back-reference, a conditional: anything
            return WIDE, True
    return out, True


def _ambiguous_branch(pattern: Any) -> bool:
    """True when some alternation below can match the same text start in two of its
    alternatives, or can match nothing."""
    stack = [pattern]
    while stack:
        for op, av in stack.pop():
            if op is sre.BRANCH:
                firsts = [_first(a) for a in av[1]]
                if any(empty for _, empty in firsts):
                    return True
                for i, (a, _) in enumerate(firsts):
                    if any(_overlap(a, b) for b, _ in firsts[i + 1 :]):
                        return True
            stack.extend(_children(op, av))
    return False


def _union(a: Chars, b: Chars) -> Chars:
    if a[0] and b[0]:
        return True, a[1] & b[1]
    if a[0] or b[0]:
        negated, positive = (a, b) if a[0] else (b, a)
        return True, negated[1] - positive[1]
    return False, a[1] | b[1]


def _class(items: Any) -> Chars:
    """The characters of a class `[...]` (IN)."""
    out: Chars = NOTHING
    negate = False
    for op, item in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            out = _union(out, (False, frozenset(chr(item))))
        elif op is sre.RANGE:
            low, high = item
            chars = (False, frozenset(map(chr, range(low, high + 1))))
            out = _union(out, chars if high - low <= 256 else WIDE)
        elif op is sre.CATEGORY and item in _CATEGORIES:
            out = _union(out, (False, _CATEGORIES[item]))
        elif op is sre.CATEGORY and item in _NOT_CATEGORIES:
            out = _union(out, (True, _CATEGORIES[_NOT_CATEGORIES[item]]))
        else:
            out = _union(out, WIDE)
    if negate:  # [^...]: all but those (approximately, for a class that was negated)
        return (not out[0], out[1]) if out != WIDE else NOTHING
    return out


def _chars(node: Any) -> Chars:
    """The characters the parsed `node` (a sub-pattern) can consume."""
    out: Chars = NOTHING
    for op, av in node:
        if op is sre.ANY:
            found: Chars = (True, frozenset("\n"))
        elif op is sre.NOT_LITERAL:
            found = (True, frozenset(chr(av)))
        elif op is sre.LITERAL:
            found = (False, frozenset(chr(av)))
        elif op is sre.IN:
            found = _class(av)
        else:
            found = NOTHING
            for child in _children(op, av):
                found = _union(found, _chars(child))
        out = _union(out, found)
    return out


def _overlap(a: Chars, b: Chars) -> bool:
    if a[0] and b[0]:
        return True
    if a[0] or b[0]:
        negated, positive = (a, b) if a[0] else (b, a)
        return bool(positive[1] - negated[1])
    return bool(a[1] & b[1])


def _long(op: Any, av: Any) -> bool:
    return op in _REPEATS and (av[1] is sre.MAXREPEAT or av[1] > LONG_REPEAT)


def _sequence_error(node: Any) -> str | None:
    """Long repeats over shared characters with only optional parts between them, in a
    sequence (groups read inline)."""
    previous: Chars | None = None
    items = list(node)
    while items:
        op, av = items.pop(0)
        if op is sre.SUBPATTERN:
            items[:0] = list(av[3])
            continue
        if _long(op, av):
            chars = _chars(av[2])
            if previous is not None and _overlap(previous, chars):
                return (
                    "has long repeats over the same characters one after another (like "
                    "(.*)(.*) or \\w+\\w+), which can take polynomial time in the text's "
                    "length; merge them into one"
                )
            previous = chars
        elif not (op in _REPEATS and av[0] == 0) and op not in (sre.AT,):
            previous = None  # a part that must match keeps the repeats apart
    return None


def _wide_repeats(pattern: Any) -> int:
    count, stack = 0, [pattern]
    while stack:
        for op, av in stack.pop():
            if _long(op, av) and _chars(av[2])[0]:
                count += 1
            stack.extend(_children(op, av))
    return count


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
                if high > 1 and _ambiguous_branch(body):
                    return (
                        "has alternatives inside a repeated group that can start alike or "
                        "match nothing (like (a|ab)* or (a|)*), which can take exponential "
                        "time; make each alternative start with a different character"
                    )
            stack.extend((child, depth + 1) for child in _children(op, av))
        if problem := _sequence_error(node):
            return problem
    if (wide := _wide_repeats(pattern)) > MAX_WIDE:
        return (
            f"has {wide} long repeats over (almost) any character (like .* or [^x]+), more "
            f"than {MAX_WIDE}: matching can take time growing as the text's length to the "
            f"power {wide}"
        )
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
