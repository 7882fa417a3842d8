"""Dockerfile.operator and Dockerfile.trainer, checked without a container engine.

No machine here runs Docker, so this parses each Dockerfile and checks it statically:
files its COPY and `pip install -c/-r` lines name exist, the extras exist in
pyproject.toml, versions are pinned by docker/constraints-*.txt, the operator image never
pulls JAX, the final stage runs as a numeric non-root user under the tini entrypoint.
tests/integration/test_install.py replays the operator build stage's pip commands in a
fresh venv (`import posttrain.controller.main` works, `import jax` fails).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
IMAGES = {
    "operator": ROOT / "Dockerfile.operator",
    "trainer": ROOT / "Dockerfile.trainer",
}
# Packages that must never be in the operator image (the posttrain package keeps JAX out).
JAX_FAMILY = {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "google-tunix", "libtpu"}
# Dockerfile.trainer's ACCELERATOR values besides cpu, each with its extra pins in
# docker/constraints-trainer-<accelerator>.txt, and the package that gives JAX the backend.
TRAINER_ACCELERATORS = {"tpu": "libtpu", "cuda12": "jax-cuda12-plugin"}


# -- a small Dockerfile parser ---------------------------------------------------------


@dataclass
class Instruction:
    cmd: str  # upper-case: FROM, RUN, COPY, ...
    value: str  # the rest, continuation lines joined
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]
    header: list[str]  # leading comment lines

    def stage(self, name: str) -> Stage:
        (hit,) = [s for s in self.stages if s.name == name]
        return hit

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse_dockerfile(path: Path) -> Dockerfile:
    lines = path.read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    instructions: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comments (also inside continuations) and blank lines
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].strip())
            continue
        buf.append(stripped)
        text = " ".join(b for b in buf if b)
        buf = []
        cmd, _, value = text.partition(" ")
        instructions.append(Instruction(cmd.upper(), value.strip(), start))
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.cmd == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", ins.value, flags=re.IGNORECASE)
            assert m, f"{path.name}:{ins.line}: cannot parse FROM {ins.value}"
            stages.append(Stage(m.group(1), m.group(2)))
        elif not stages:
            assert ins.cmd == "ARG", f"{path.name}:{ins.line}: {ins.cmd} before FROM"
            key, _, default = ins.value.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(ins)
    return Dockerfile(path, global_args, stages, header)


@dataclass
class PipInstall:
    """One `pip install` command of a RUN instruction."""

    pip: str  # the pip executable as written
    requirements: list[str]  # positional requirement specs
    constraints: list[str]  # -c files
    requirement_files: list[str]  # -r files
    argv: list[str]  # the whole command, pip first


PIP_RE = re.compile(r"(\S*pip3?|\S*python3?\s+-m\s+pip)\s+install\s+([^;&|]*)")


def pip_installs(stage: Stage) -> list[PipInstall]:
    out = []
    for ins in stage.instructions:
        if ins.cmd != "RUN":
            continue
        for m in PIP_RE.finditer(ins.value):
            words = shlex.split(m.group(2))
            reqs, cons, rfiles = [], [], []
            it = iter(words)
            for w in it:
                if w in ("-c", "--constraint"):
                    cons.append(next(it))
                elif w in ("-r", "--requirement"):
                    rfiles.append(next(it))
                elif w.startswith("-"):
                    continue
                else:
                    reqs.append(w)
            out.append(
                PipInstall(m.group(1), reqs, cons, rfiles, [*m.group(1).split(), "install", *words])
            )
    return out


def copy_sources_of(ins: Instruction) -> tuple[list[str], str]:
    """(sources, destination) of a COPY/ADD; no sources for `--from=<stage>` copies."""
    words = shlex.split(ins.value)
    if any(w.startswith("--from") for w in words):
        return [], words[-1]
    words = [w for w in words if not w.startswith("--")]
    return words[:-1], words[-1]


def copy_sources(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY/ADD from the build context."""
    return [copy_sources_of(i) for i in stage.instructions if i.cmd in ("COPY", "ADD")]


def read_constraints(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+!\-]+)", line)
        assert m, f"{path.name}: not an exact pin: {raw!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"{path.name}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def extra_requirements(extra: str, seen: set[str] | None = None) -> list[Requirement]:
    """The requirements `.[extra]` brings, with posttrain[...] self-references expanded."""
    seen = seen if seen is not None else set()
    seen.add(extra)
    project = PYPROJECT["project"]
    out = [Requirement(r) for r in project["dependencies"]]
    for spec in project["optional-dependencies"][extra]:
        req = Requirement(spec)
        if canonicalize_name(req.name) == canonicalize_name(project["name"]):
            for sub in req.extras - seen:
                out += extra_requirements(sub, seen)
        else:
            out.append(req)
    return out


def local_extras(spec: str) -> set[str] | None:
    """Extras of a `.[a,b]` spec (the project itself), else None."""
    m = re.fullmatch(r"\.(?:\[([\w,\s-]*)\])?", spec)
    if not m:
        return None
    return {e.strip() for e in (m.group(1) or "").split(",") if e.strip()}


# -- tests -----------------------------------------------------------------------------


@pytest.fixture(params=sorted(IMAGES), scope="module")
def image(request: pytest.FixtureRequest) -> str:
    return request.param


def test_multi_stage_with_pinned_base(image: str) -> None:
    df = parse_dockerfile(IMAGES[image])
    assert df.header[0].startswith("# syntax=docker/dockerfile:1"), "BuildKit syntax line"
    base = df.global_args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", base), base
    header = "\n".join(df.header)
    assert "imagetools inspect" in header and "@sha256:" in header, "how to pin the digest"
    assert len(df.stages) >= 2, "multi-stage"
    assert df.stages[0].name == "build"
    assert all(s.base == "${PYTHON_IMAGE}" for s in df.stages)
    final_copies = [i.value for i in df.final.instructions if i.cmd == "COPY"]
    assert "--from=build /opt/venv /opt/venv" in final_copies


def test_final_stage_is_non_root_under_tini(image: str) -> None:
    df = parse_dockerfile(IMAGES[image])
    final = {i.cmd: i.value for i in df.final.instructions}
    user = final["USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot checks it)"
    assert final["ENTRYPOINT"] == '["posttrain"]'
    runs = " ".join(i.value for i in df.final.instructions if i.cmd == "RUN")
    assert re.search(r"\btini=[0-9][\w.+~-]*", runs), "tini from Debian, version pinned"
    copies = [i.value for i in df.final.instructions if i.cmd == "COPY"]
    assert "--chmod=0755 docker/entrypoint.sh /opt/posttrain/bin/posttrain" in copies
    env = " ".join(i.value for i in df.final.instructions if i.cmd == "ENV")
    assert "PATH=/opt/posttrain/bin:/opt/venv/bin:" in env, "the wrapper comes first on PATH"


def test_copied_files_exist_and_pass_the_dockerignore(image: str) -> None:
    df = parse_dockerfile(IMAGES[image])
    ignore = Path(f"{IMAGES[image]}.dockerignore")
    assert ignore.is_file(), f"{ignore.name} keeps .venv/.cache out of the build context"
    patterns = [
        line.strip()
        for line in ignore.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(rel: str) -> bool:
        verdict = False
        for p in patterns:
            neg = p.startswith("!")
            pat = p.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(rel, pat) or rel.split("/")[0] == pat:
                verdict = not neg
        return verdict

    for stage in df.stages:
        for sources, _ in copy_sources(stage):
            for src in sources:
                assert (ROOT / src).exists(), f"{image}: COPY {src}: no such file"
                assert not ignored(src.rstrip("/")), f"{image}: COPY {src} is dockerignored"


def test_pip_installs_are_pinned_and_name_real_extras(image: str) -> None:
    df = parse_dockerfile(IMAGES[image])
    installs = pip_installs(df.stage("build"))
    assert installs, "the build stage installs with pip"
    constraints = f"docker/constraints-{image}.txt"
    per_accelerator = f"docker/constraints-{image}-$ACCELERATOR.txt"
    extras_installed: set[str] = set()
    for inst in installs:
        assert inst.pip == "/opt/venv/bin/pip", "install into the venv the final stage copies"
        for f in inst.constraints + inst.requirement_files:
            if f == per_accelerator and image == "trainer":
                for acc in TRAINER_ACCELERATORS:
                    assert (ROOT / f.replace("$ACCELERATOR", acc)).is_file(), acc
                continue
            assert (ROOT / f).is_file(), f"{image}: {f} does not exist"
            assert f == constraints, f"{image}: pins come from {constraints}"
        assert inst.constraints or inst.requirement_files, f"unpinned: {' '.join(inst.argv)}"
        for spec in inst.requirements:
            extras = local_extras(spec)
            if extras is not None:
                unknown = extras - set(PYPROJECT["project"]["optional-dependencies"])
                assert not unknown, f"{image}: no such extra in pyproject.toml: {unknown}"
                extras_installed |= extras
            else:
                name = canonicalize_name(Requirement(spec.replace("$", "")).name)
                assert name in read_constraints(ROOT / constraints), f"{spec} is not pinned"
    wanted = {image} | IMAGE_EXTRAS.get(image, set())
    assert extras_installed == wanted, f"{image} image installs .[{','.join(sorted(wanted))}]"


# What an image installs beside its own extra: the trainer, the experiment trackers'
# clients (spec.tracking).
IMAGE_EXTRAS = {"trainer": {"mlflow", "wandb"}}


def test_constraints_pin_every_requirement(image: str) -> None:
    pins = read_constraints(ROOT / "docker" / f"constraints-{image}.txt")
    assert "pip" in pins
    extras = [image, *sorted(IMAGE_EXTRAS.get(image, set()))]
    for req in [r for extra in extras for r in extra_requirements(extra)]:
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints-{image}.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints-{image}.txt pins {req.name}=={pins[name]}, pyproject wants {req}"
        )


def test_operator_image_has_no_jax() -> None:
    reqs = {canonicalize_name(r.name) for r in extra_requirements("operator")}
    assert not reqs & JAX_FAMILY, "the operator extra pulls JAX"
    pins = read_constraints(ROOT / "docker" / "constraints-operator.txt")
    assert not set(pins) & JAX_FAMILY, "constraints-operator.txt pins JAX packages"
    trainer_pins = read_constraints(ROOT / "docker" / "constraints-trainer.txt")
    assert {"jax", "jaxlib"} <= set(trainer_pins)


def test_trainer_accelerator_pins() -> None:
    """Each accelerator image adds its backend, pinned to match JAX, and repins nothing."""
    df = parse_dockerfile(IMAGES["trainer"])
    assert df.stage("build").instructions[0].value == "ACCELERATOR=cpu", "CPU by default"
    header = "\n".join(df.header)
    base = read_constraints(ROOT / "docker" / "constraints-trainer.txt")
    for acc, backend in TRAINER_ACCELERATORS.items():
        assert f"--build-arg ACCELERATOR={acc}" in header, f"how to build the {acc} image"
        extra = read_constraints(ROOT / "docker" / f"constraints-trainer-{acc}.txt")
        assert backend in extra, f"constraints-trainer-{acc}.txt does not pin {backend}"
        assert not set(extra) & set(base), f"{acc}: repins {set(extra) & set(base)}"
    cuda = read_constraints(ROOT / "docker" / "constraints-trainer-cuda12.txt")
    assert cuda["jax-cuda12-plugin"] == cuda["jax-cuda12-pjrt"] == base["jax"]


def test_shared_packages_pinned_alike() -> None:
    """posttrain's own dependencies resolve to the same versions in both images."""
    op = read_constraints(ROOT / "docker" / "constraints-operator.txt")
    tr = read_constraints(ROOT / "docker" / "constraints-trainer.txt")
    for req in PYPROJECT["project"]["dependencies"]:
        name = canonicalize_name(Requirement(req).name)
        assert op[name] == tr[name], name


# -- the entrypoint script --------------------------------------------------------------

HANDLER = """
import pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
def term(signum, frame):
    marker.write_text("checkpointed")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
marker.with_suffix(".ready").write_text(" ".join(sys.argv[2:]))
time.sleep(30)
sys.exit(3)
"""


def test_entrypoint_is_executable_posix_sh() -> None:
    assert os.access(ENTRYPOINT, os.X_OK), "chmod 755 docker/entrypoint.sh"
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")
    subprocess.run(["sh", "-n", str(ENTRYPOINT)], check=True)
    assert 'exec /usr/bin/tini -- "$real" "$@"' in ENTRYPOINT.read_text()


def test_entrypoint_execs_so_sigterm_reaches_python(tmp_path: Path) -> None:
    """Not PID 1: the script execs Python in its own process, so SIGTERM sent to the
    container's process lands in the trainer's handler (which checkpoints)."""
    fake = tmp_path / "posttrain"
    fake.write_text(f"#!{sys.executable}\n{HANDLER}")
    fake.chmod(0o755)
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        ["sh", str(ENTRYPOINT), str(marker), "train", "--config", "/etc/posttrain/job.json"],
        env={**os.environ, "POSTTRAIN_BIN": str(fake)},
    )
    try:
        deadline = time.monotonic() + 20
        while not marker.with_suffix(".ready").exists():
            assert proc.poll() is None, "exited early"
            assert time.monotonic() < deadline, "never started"
            time.sleep(0.05)
        assert marker.with_suffix(".ready").read_text() == "train --config /etc/posttrain/job.json"
        proc.send_signal(signal.SIGTERM)  # to the PID we started: exec kept it
        assert proc.wait(timeout=10) == 0
        assert marker.read_text() == "checkpointed"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_entrypoint_sources_the_nccl_settings_script(tmp_path: Path) -> None:
    """POSTTRAIN_NCCL_ENV_SCRIPT's exports reach the trainer's process (LD_LIBRARY_PATH
    must be set before it starts); a missing script is reported and the trainer runs."""
    fake = tmp_path / "posttrain"
    fake.write_text(
        f"#!{sys.executable}\nimport os\n"
        "print(os.environ.get('NCCL_NET', '-'), os.environ.get('LD_LIBRARY_PATH', '-'))\n"
    )
    fake.chmod(0o755)
    script = tmp_path / "set_nccl_env.sh"
    script.write_text(
        'export NCCL_NET=gIB\nexport LD_LIBRARY_PATH="/usr/local/gib/lib64:$LD_LIBRARY_PATH"\n'
    )

    def run(path: Path) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": os.environ["PATH"],
            "POSTTRAIN_BIN": str(fake),
            "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
            "POSTTRAIN_NCCL_ENV_SCRIPT": str(path),
        }
        return subprocess.run(
            ["sh", str(ENTRYPOINT), "train"], env=env, capture_output=True, text=True, timeout=30
        )

    ok = run(script)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["gIB", "/usr/local/gib/lib64:/usr/local/nvidia/lib64"]
    missing = run(tmp_path / "absent.sh")
    assert missing.returncode == 0 and missing.stdout.split()[0] == "-"
    assert f"posttrain: {tmp_path / 'absent.sh'} not found" in missing.stderr
    assert "NCCL plugin installer" in missing.stderr
