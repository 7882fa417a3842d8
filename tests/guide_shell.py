"""Run the guides' shell blocks as a reader would, verbatim (see tests/doc_blocks.py).

A test gets the blocks whose comment says `run-by: <this test>` through the `guide`
fixture (tests/conftest.py) and runs them with `guide.run(guide.block("helm upgrade"))`:

- each command runs in `bash -o pipefail` in a scratch directory holding copies of the
  repository's charts/, manifests/ and examples/, with the control plane's kubectl and
  helm and this venv's `posttrain` first on PATH, and KUBECONFIG pointing at the test's
  control plane (none for tests without one);
- `NAME=value` lines set a variable for the block's later commands;
- a command must exit 0; one whose trailing comment is `# yes` or `# no` must print
  exactly that (`kubectl auth can-i` exits 1 for "no");
- a command that never ends by itself (`-w`, `--watch`) runs in the background until
  the block's other commands are done, and its output is what it printed until then;
- `substitutions` (exact text -> text) are the only changes made to a command, each must
  be used, and each test documents why it needs them;
- the test fails if it does not run every block that names it.

Tests on a control plane hold a lock for its lifetime: the guides use fixed names
(release `posttrain`, namespaces posttrain-system and team-a) that two pytest sessions
on the same plane must not share at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from doc_blocks import ROOT, Block, Command, checked_blocks, commands

from tests.cluster import Cluster, control_plane

COPIED = ("charts", "manifests", "examples")
_ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=([^\s'\"$`]*)$")
_WATCH = re.compile(r"(^|\s)(-w|--watch)(\s|$)")
LOCK = control_plane.RUN_DIR.parent / f".{control_plane.RUN_DIR.name}.guides.lock"


@dataclass
class Ran:
    command: Command
    ran: str  # the text given to bash, after substitutions
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"$ {self.ran}\n(exit {self.returncode})\n{self.stdout}{self.stderr}"


class GuideShell:
    def __init__(
        self,
        test_id: str,
        workdir: Path,
        kubeconfig: Path | None,
        timeout: float = 300,
    ):
        self.test_id = test_id
        self.blocks = [b for b in checked_blocks() if test_id in b.run_by]
        assert self.blocks, f"no block of the guides says `run-by: {test_id}`"
        self.workdir = workdir
        self.substitutions: dict[str, str] = {}  # the test's own, documented there
        self.timeout = timeout
        self._ran: set[Block] = set()
        self._used: set[str] = set()
        for name in COPIED:
            shutil.copytree(
                ROOT / name, workdir / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        helm_home = workdir / ".helm"
        self.env = {
            **os.environ,
            "PATH": os.pathsep.join(
                [str(control_plane.BIN_DIR), str(Path(sys.executable).parent), os.environ["PATH"]]
            ),
            "HELM_CACHE_HOME": str(helm_home / "cache"),
            "HELM_CONFIG_HOME": str(helm_home / "config"),
            "HELM_DATA_HOME": str(helm_home / "data"),
        }
        self.env.pop("KUBECONFIG", None)
        if kubeconfig is not None:
            self.env["KUBECONFIG"] = str(kubeconfig)

    def block(self, containing: str) -> Block:
        """This test's one block whose text contains `containing`."""
        found = [b for b in self.blocks if containing in b.text]
        assert len(found) == 1, (
            f"{len(found)} blocks with run-by: {self.test_id} contain {containing!r}: "
            + ", ".join(map(str, found))
        )
        return found[0]

    def run(self, block: Block, after: dict[str, Callable[[], object]] | None = None) -> list[Ran]:
        """Run the block's commands in order and return what each printed (variable
        assignments left out). `after` maps a part of a command's text to a function to
        call once that command has run (e.g. start the operator after `helm install`)."""
        assert block in self.blocks, f"{block} does not say run-by: {self.test_id}"
        self._ran.add(block)
        env = dict(self.env)
        results: list[Ran | None] = []
        background: list[tuple[int, Command, str, subprocess.Popen, Path]] = []
        try:
            for command in commands(block):
                text = self._substitute(command.text)
                if m := _ASSIGNMENT.match(text):
                    env[m.group(1)] = m.group(2)
                    continue
                if _WATCH.search(text):
                    background.append((len(results), command, text, *self._start(text, env)))
                    results.append(None)
                    continue
                results.append(self._check(block, self._run(command, text, env)))
                for part, hook in (after or {}).items():
                    if part in text:
                        hook()
        finally:
            if background:
                time.sleep(2)  # let a watch print the last change the block waited for
            for i, command, text, proc, out in background:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)
                results[i] = Ran(command, text, 0, out.read_text(), "")
        return [r for r in results if r is not None]

    def finish(self) -> None:
        missing = [str(b) for b in self.blocks if b not in self._ran]
        assert not missing, f"{self.test_id} did not run its blocks: {', '.join(missing)}"
        unused = set(self.substitutions) - self._used
        assert not unused, f"substitutions no command needed: {sorted(unused)}"

    # -- internals ---------------------------------------------------------------------
    def _substitute(self, text: str) -> str:
        for old, new in self.substitutions.items():
            if old in text:
                text = text.replace(old, new)
                self._used.add(old)
        return text

    def _run(self, command: Command, text: str, env: dict[str, str]) -> Ran:
        try:
            proc = subprocess.run(
                ["bash", "-o", "pipefail", "-c", text],
                cwd=self.workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=self.timeout,
            )
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            raise AssertionError(f"$ {text}\ndid not finish in {self.timeout:.0f}s\n{out}") from e
        return Ran(command, text, proc.returncode, proc.stdout, proc.stderr)

    def _start(self, text: str, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        out = self.workdir / f".background-{time.monotonic_ns()}.out"
        with open(out, "w") as f:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {text}"],
                cwd=self.workdir,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc, out

    @staticmethod
    def _check(block: Block, ran: Ran) -> Ran:
        expected = ran.command.comment
        if expected in ("yes", "no"):
            ok = ran.stdout.strip() == expected and ran.returncode == (
                0 if expected == "yes" else 1
            )
            assert ok, f"{block}: the guide says `{expected}`\n{ran}"
        else:
            assert ran.returncode == 0, f"{block}: a command of the guide failed\n{ran}"
        return ran


@contextlib.contextmanager
def guide_shell(request, tmp_path: Path, plane: Cluster | None) -> Iterator[GuideShell]:
    """The shell for the blocks that say `run-by: <this test>`, on `plane` if any:

        with guide_shell(request, tmp_path, cluster) as guide:
            guide.run(guide.block("helm install"))

    Fails the test, when it otherwise passes, if a block or a substitution went unused.
    """
    test_id = request.node.nodeid.split("[")[0]
    with contextlib.ExitStack() as stack:
        if plane is not None:
            LOCK.parent.mkdir(parents=True, exist_ok=True)
            fcntl.flock(stack.enter_context(open(LOCK, "w")), fcntl.LOCK_EX)
        workdir = tmp_path / "guide"
        workdir.mkdir()
        shell = GuideShell(test_id, workdir, plane.kubeconfig if plane else None)
        yield shell
        shell.finish()
