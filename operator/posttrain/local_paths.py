"""Checks of a job's local paths before anything loads, for `posttrain run` (errors) and
`posttrain validate` (warnings): inputs that do not exist, an output that cannot be
written.

A relative path in a job resolves against the working directory of the command (as the
trainer opens it, and as a pod resolves it against its container's working directory),
not against the job file's directory; the messages say where they looked, and when the
path exists under the job file's directory or one above it, where to run from.

gs:// and hf:// locations are not checked here (posttrain.trainer.storage asks the
bucket). No JAX, no cloud clients: these run in well under a second.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

from posttrain.api.validate import printable

REMOTE = ("gs://", "hf://")


# What a directory input must hold: a Hugging Face model's config.json, a PEFT adapter's
# adapter_config.json.
MODEL, ADAPTER = "config.json", "adapter_config.json"


def _inputs(spec: Any) -> list[tuple[str, str | None, str | None]]:
    """(field, location, kind) of every local input a run reads; kind is the file a
    directory must hold (MODEL, ADAPTER), or None for a file or a directory of files."""
    teacher = spec.distill.teacher if spec.distill else None
    return [
        ("spec.model.source", spec.model.source, MODEL),
        ("spec.data.source", spec.data.source, None),
        *(
            (f"spec.data.sources[{k}].source", entry.source, None)
            for k, entry in enumerate(spec.data.sources or [])
        ),
        ("spec.data.chatTemplate", spec.data.chat_template, None),
        ("spec.eval.source", spec.eval.source if spec.eval else None, None),
        ("spec.distill.teacher.source", teacher.source if teacher else None, MODEL),
        ("spec.lora.restoreFrom", spec.lora.restore_from if spec.lora else None, ADAPTER),
    ]


def gcs_inputs(spec: Any) -> list[tuple[str, str]]:
    """(field, URI) of every gs:// input a run reads."""
    return [(f, loc) for f, loc, _ in _inputs(spec) if loc and loc.startswith("gs://")]


def _where(path: str, job_file: str | None) -> str:
    """Where a relative path was looked for, and the fix when it is beside the job file."""
    if Path(path).is_absolute():
        return ""
    cwd = Path.cwd()
    said = f" (a relative path resolves against the working directory {cwd}"
    if job_file:  # the directory the job's author meant: the job file's, or one above it
        for directory in Path(job_file).resolve().parents:
            if (directory / path).exists() and directory != cwd:
                return f"{said}; {directory / path} exists: run from {directory})"
    return said + ")"


def missing_inputs(spec: Any, job_file: str | None = None) -> list[str]:
    """One line per local input of `spec` that is not there, naming the field and where
    it looked."""
    problems = []
    for field, location, kind in _inputs(spec):
        if not location or location.startswith(REMOTE):
            continue
        path, shown = Path(location).expanduser(), printable(location)
        what = "a model" if kind == MODEL else "an adapter"
        if not path.exists():
            missing = "no such directory" if kind else "no such file or directory"
            problems.append(f"{field}: {shown}: {missing}{_where(location, job_file)}")
        elif kind and not path.is_dir():
            problems.append(f"{field}: {shown} is a file, not {what} directory")
        elif kind and not (path / kind).is_file():
            problems.append(f"{field}: {shown} has no {kind}: not {what} directory")
    return problems


def unwritable_output(uri: str, field: str = "spec.output.uri", create: bool = True) -> str | None:
    """Why a local output location cannot be written (one line naming `field`), or None.
    Writes and removes one probe file: in the directory, created as the run would, or
    with `create` False in the nearest directory above it that exists (nothing is left
    behind)."""
    if uri.startswith(REMOTE):
        return None
    path = Path(uri).expanduser()
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        else:
            while not path.exists() and path.parent != path:
                path = path.parent
            if not path.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        fd, probe = tempfile.mkstemp(prefix=".posttrain-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if e.errno == errno.ENOTDIR or e.errno == errno.EEXIST:
            why = "a file is in the way"
        else:
            why = e.strerror or str(e)
        return f"{field}: {printable(uri)}: cannot write there: {why}"
    return None
