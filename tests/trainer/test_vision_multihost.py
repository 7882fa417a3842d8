"""Multi-host multimodal SFT on one machine: a LoRA job on the tiny Gemma 3 vision
fixture with spec.data.columns.images, run by 2 processes x 2 CPU devices
(jax.distributed, configured as in a JobSet's pods), matches the loss curve of 1 process
x 4 devices, and the 2 hosts read disjoint rows and load only the images of their rows
(each row has an image file of its own; a startup hook in the trainer processes records
every image they load)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_multihost import _assert_same_losses, _env, _finish, _job, _run, _two_hosts

pytestmark = pytest.mark.trainer

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3-vision"
ROWS = 24  # 6 steps of 4 rows: one epoch, so every row is trained once

# Loaded by the trainer processes (PYTHONPATH): appends each image they load to a file
# of their own.
_HOOK = """
import os

_LOG = os.environ.get("POSTTRAIN_TEST_IMAGE_LOG")
if _LOG:
    from posttrain.trainer.data import images

    _load = images.load_image

    def _recording_load(value, base, where, column):
        with open(os.path.join(_LOG, str(os.getpid())), "a") as f:
            f.write(f"{value}\\n")
        return _load(value, base, where, column)

    images.load_image = _recording_load
"""


def _image_rows(directory: Path) -> Path:
    """ROWS colour questions, each with its own image file (a link to a fixture image)."""
    (directory / "images").mkdir(parents=True)
    colours = (("rgb_50x37", "red"), ("rgba_20x28", "green"), ("grey_64x64", "blue"))
    rows = []
    for i in range(ROWS):
        name, colour = colours[i % 3]
        (directory / "images" / f"{i}.png").symlink_to(FIXTURE / "images" / f"{name}.png")
        question = [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]
        answer = [{"type": "text", "text": f"It is {colour}."}]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "images": [f"images/{i}.png"]})
    path = directory / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _loaded(log: Path, pid: int) -> list[str]:
    path = log / str(pid)
    return path.read_text().split() if path.exists() else []


def test_two_processes_match_one_with_images(tmp_path: Path, monkeypatch):
    rows = _image_rows(tmp_path / "data")
    hook, log = tmp_path / "hook", tmp_path / "loaded"
    hook.mkdir()
    log.mkdir()
    (hook / "sitecustomize.py").write_text(_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("POSTTRAIN_TEST_IMAGE_LOG", str(log))
    data = {"source": str(rows), "maxLength": 64, "columns": {"images": "images"}}
    single = _job(tmp_path, FIXTURE, tmp_path / "single", batch_size=4, data=data)
    multi = _job(tmp_path, FIXTURE, tmp_path / "multi", batch_size=4, data=data)
    procs = [_run(single, _env(4)), *_two_hosts(multi)]
    logs = _finish(procs)
    assert "process 1 of 2" in logs[2]
    _assert_same_losses(tmp_path / "single", tmp_path / "multi")
    everything = {f"images/{i}.png" for i in range(ROWS)}
    one, (host0, host1) = _loaded(log, procs[0].pid), (_loaded(log, p.pid) for p in procs[1:])
    assert sorted(one) == sorted(everything)  # each row's image loaded once
    assert len(host0) == len(host1) == ROWS // 2, (host0, host1)
    assert not set(host0) & set(host1) and set(host0) | set(host1) == everything
