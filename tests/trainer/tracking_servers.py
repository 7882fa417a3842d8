"""A real MLflow tracking server for the spec.tracking tests, and a reader of the run
files Weights & Biases writes offline."""

from __future__ import annotations

import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = ROOT / ".cache" / "mlflow-server-venv" / "bin" / "mlflow"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store and an artifact directory under
    `root`; stop() and start() again keep its port and its data."""

    def __init__(self, root: Path):
        if not MLFLOW.exists():
            raise AssertionError(
                f"{MLFLOW} is needed for the tracking tests; make it with `make mlflow-server-venv`"
            )
        self.root, self.port = root, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.log = open(self.root / "server.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(MLFLOW),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination",
                str(self.root / "artifacts"),
            ],  # fmt: skip
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        "mlflow server exited: " + (self.root / "server.log").read_text()[-2000:]
                    ) from None
                if time.monotonic() > deadline:
                    raise AssertionError("mlflow server did not start in 90 s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            self.log.close()


@contextmanager
def mlflow_server(root: Path) -> Iterator[MlflowServer]:
    server = MlflowServer(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def wandb_records(path: Path) -> list:
    """The records of an offline run file (run-<id>.wandb): W&B's LevelDB-style log of
    protobuf Records (a 7-byte header, then 32 KiB blocks of checksum, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, out, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out
