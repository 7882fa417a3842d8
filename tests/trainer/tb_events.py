"""Read scalars back from TensorBoard event files (TFRecord framing + tensorboardX's
Event protobuf), so tests check what TensorBoard would show."""

from __future__ import annotations

import struct
from pathlib import Path


def scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out
