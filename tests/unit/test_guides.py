"""Every sh and python block of docs/user-guide.md and docs/operator-guide.md is run as
written by a test, or names the tests that check it another way (tests/doc_blocks.py)."""

from __future__ import annotations

from doc_blocks import GUIDES, ROOT, blocks, checked_blocks, commands, names_a_test

from tests.cluster import control_plane


def test_every_block_names_an_existing_test() -> None:
    problems = []
    for block in checked_blocks():
        if not block.run_by and not block.tested_by:
            problems.append(
                f"{block}: add `<!-- run-by: tests/...py::test_x -->` (a test that runs it"
                " with tests/guide_shell.py) or `<!-- tested-by: ... -->` above it"
            )
        for name in block.run_by + block.tested_by:
            if not names_a_test(name):
                problems.append(f"{block}: {name} is not a test function")
        for name in block.run_by:
            path = ROOT / name.partition("::")[0]
            if path.is_file() and "guide_shell" not in path.read_text():
                problems.append(f"{block}: {name} does not run blocks (tests/guide_shell.py)")
    assert not problems, "\n".join(problems)


def test_both_guides_have_their_blocks_found() -> None:
    found = {guide: [b.lang for b in blocks(guide)] for guide in GUIDES}
    assert found["docs/user-guide.md"].count("sh") >= 3, found
    assert "python" in found["docs/user-guide.md"] and "yaml" in found["docs/user-guide.md"]
    assert found["docs/operator-guide.md"].count("sh") >= 15, found
    (rbac,) = [b for b in checked_blocks() if "auth can-i" in b.text]
    answers = [c.comment for c in commands(rbac)]
    assert answers[0] == "" and set(answers[1:]) == {"yes", "no"}, answers


def test_block_parsing() -> None:
    text = """# Guide

<!-- run-by: tests/a.py::test_a tests/b.py::test_b -->

```sh
# a comment line
kubectl get ptj -o jsonpath='{"#"}'   # yes
helm install x \\
  --set a=b   # the end
```

## Indented

- item:

  <!-- tested-by: tests/c.py::test_c -->
  ```python
  print("# not a comment")
  ```

```
## not a heading
```
"""
    first, second, bare = blocks("guide.md", text)
    assert (first.line, first.lang, first.heading) == (5, "sh", "Guide")
    assert first.run_by == ("tests/a.py::test_a", "tests/b.py::test_b") and not first.tested_by
    assert [(c.text, c.comment) for c in commands(first)] == [
        ("kubectl get ptj -o jsonpath='{\"#\"}'   # yes", "yes"),
        ("helm install x --set a=b   # the end", "the end"),
    ]
    assert (second.lang, second.heading, second.tested_by) == (
        "python",
        "Indented",
        ("tests/c.py::test_c",),
    )
    assert second.text == 'print("# not a comment")\n'
    assert bare.lang == "" and bare.heading == "Indented"


def test_names_a_test() -> None:
    assert names_a_test("tests/unit/test_guides.py::test_names_a_test")
    assert not names_a_test("tests/unit/test_guides.py::test_no_such_test")
    assert not names_a_test("tests/unit/no_such_file.py::test_names_a_test")
    assert not names_a_test("tests/unit/test_guides.py")


def test_prerequisites_are_the_tested_releases() -> None:
    """The JobSet and Kueue release manifests the operator's guide installs are the
    versions the local control plane builds and the integration and e2e tiers run."""
    (block,) = [b for b in checked_blocks() if "releases/download" in b.text]
    urls = [c.text.split()[-1] for c in commands(block)]
    assert urls == [
        "https://github.com/kubernetes-sigs/jobset/releases/download/"
        f"{control_plane.JOBSET_VERSION}/manifests.yaml",
        "https://github.com/kubernetes-sigs/kueue/releases/download/"
        f"{control_plane.KUEUE_VERSION}/manifests.yaml",
    ]
