"""The fenced code blocks of the guides, and which test covers each.

Every ```sh and ```python block of GUIDES carries an HTML comment on the line above it:

    <!-- run-by: tests/e2e/test_guides_on_cluster.py::test_operator_guide_helm -->
        that test runs the block's commands verbatim (through tests/guide_shell.py, which
        fails the test if it leaves one of its blocks out);
    <!-- tested-by: tests/unit/test_chart.py::test_webhook_with_cert_manager -->
        the block cannot run here (no container engine, no kubelet, no cert-manager or
        Argo CD, no internet, too slow); the named tests check the same thing another way.

Both take one or more `path::function` names, separated by spaces.
tests/unit/test_guides.py fails for a block with neither, or one naming a missing test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDES = ("docs/user-guide.md", "docs/operator-guide.md")
CHECKED = {"sh", "bash", "shell", "console", "python", "py"}  # blocks that need a test

_FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
_ANNOTATION = re.compile(r"^\s*<!--\s*(run-by|tested-by):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    guide: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str  # the body, with the fence's indentation removed
    heading: str  # the nearest heading above
    run_by: tuple[str, ...] = ()
    tested_by: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.guide}:{self.line} (under '{self.heading}')"


@dataclass(frozen=True)
class Command:
    text: str  # as written, continuation lines joined, trailing comment included
    comment: str  # the trailing `# ...` comment without the '#', or ""


def blocks(guide: str, text: str | None = None) -> list[Block]:
    """Every fenced block of a guide (or of `text`, named `guide`), in order."""
    lines = (text if text is not None else (ROOT / guide).read_text()).splitlines()
    found: list[Block] = []
    heading, i = "", 0
    while i < len(lines):
        if m := _HEADING.match(lines[i]):
            heading = m.group(1)
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2)
        end = i + 1
        while not re.match(rf"^{indent}```\s*$", lines[end]):
            end += 1
        body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
        above = i - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        kind, names = "", ()
        if above >= 0 and (a := _ANNOTATION.match(lines[above])):
            kind, names = a.group(1), tuple(a.group(2).split())
        found.append(
            Block(
                guide,
                i + 1,
                lang,
                "\n".join(body) + "\n",
                heading,
                run_by=names if kind == "run-by" else (),
                tested_by=names if kind == "tested-by" else (),
            )
        )
        i = end + 1
    return found


def checked_blocks() -> list[Block]:
    """The sh and python blocks of both guides: the ones a test must cover."""
    return [b for guide in GUIDES for b in blocks(guide) if b.lang in CHECKED]


def commands(block: Block) -> list[Command]:
    """A shell block's commands: lines ending in `\\` joined, comment lines dropped."""
    found: list[Command] = []
    pending = ""
    for line in block.text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].rstrip() + " "
            continue
        text = pending + line.strip()
        pending = ""
        found.append(Command(text, _trailing_comment(text)))
    assert not pending, f"{block}: the last line continues with a backslash"
    return found


def _trailing_comment(command: str) -> str:
    """What follows the first unquoted ` #`, as the shell sees it."""
    quote = ""
    for i, ch in enumerate(command):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i > 0 and command[i - 1].isspace():
            return command[i + 1 :].strip()
    return ""


def names_a_test(name: str) -> bool:
    """Whether `path::function` names a test function that exists."""
    path, sep, function = name.partition("::")
    file = ROOT / path
    if not sep or not file.is_file():
        return False
    return re.search(rf"^(async )?def {re.escape(function)}\(", file.read_text(), re.M) is not None
