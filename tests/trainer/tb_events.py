"""Read scalars back from TensorBoard event files (TFRecord framing + tensorboardX's
Event protobuf), so tests check what TensorBoard would show."""

from __future__ import annotations

import struct
from pathlib import Path


def events(logdir: Path):
    """Every Event protobuf under logdir (its step, wall_time and summary values)."""
    from tensorboardX.proto import event_pb2

    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            yield event_pb2.Event.FromString(record)


def _values(logdir: Path):
    """(step, summary value) of every event under logdir."""
    for event in events(logdir):
        for value in event.summary.value:
            yield event.step, value


def scalars(logdir: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for step, value in _values(logdir):
        if not value.tensor.string_val:
            out.setdefault(value.tag, {})[step] = value.simple_value
    return out


def texts(logdir: Path) -> dict[str, dict[int, str]]:
    """Text summaries (add_text) by tag and step."""
    out: dict[str, dict[int, str]] = {}
    for step, value in _values(logdir):
        if value.tensor.string_val:
            out.setdefault(value.tag, {})[step] = value.tensor.string_val[0].decode()
    return out
