"""docs/architecture.md names only modules and files that exist.

Every `path/with/a/slash` in backticks is a path from the repository root; every
``something.py`` or ``folder/`` in the flow picture (the fenced block) is a module or a
package of the operator side (operator/posttrain), of the trainer
(trainer/posttrain/trainer) or a folder at the root.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PICTURE_ROOTS = (ROOT, ROOT / "operator" / "posttrain", ROOT / "trainer" / "posttrain" / "trainer")


def backticked_paths(text: str) -> set[str]:
    """Backticked tokens that are paths: a slash, no spaces, no <placeholders>."""
    return {t for t in re.findall(r"`([^`\n]+)`", text) if "/" in t and not re.search(r"[\s<>]", t)}


def picture_names(text: str) -> set[str]:
    """Module and folder names in the fenced blocks: a.py, a/b.py, a/."""
    blocks = re.findall(r"^```\n(.*?)^```", text, flags=re.S | re.M)
    return {n for b in blocks for n in re.findall(r"(?<![\w./-])[\w/]*\w(?:\.py|/)(?!\w)", b)}


def test_every_backticked_path_exists() -> None:
    paths = backticked_paths(DOC.read_text())
    assert "trainer/posttrain/trainer/loop.py" in paths and len(paths) > 40
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_of_the_picture_exists() -> None:
    names = picture_names(DOC.read_text())
    assert {"api/spec.py", "models/", "controller/phase/"} <= names
    missing = sorted(
        n for n in names if not any((r / n.rstrip("/")).exists() for r in PICTURE_ROOTS)
    )
    assert not missing, f"the flow in docs/architecture.md names what does not exist: {missing}"


def test_the_checks_see_a_missing_path() -> None:
    text = "`trainer/posttrain/trainer/nope.py`\n```\n x  render/nope.py, data/\n```\n"
    assert backticked_paths(text) == {"trainer/posttrain/trainer/nope.py"}
    assert picture_names(text) == {"render/nope.py", "data/"}
