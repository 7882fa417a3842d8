"""A real HTTP verifier service for the tests of spec.grpo.rewards[].type http.

It answers POSTs of {"items": [{"prompt", "completion", "answer", "metadata"}]} with
{"rewards": [...]}: 1.0 when the completion's last digit run equals the answer, else 0.0.
Run in a thread (``VerifierServer``, whose behaviour a test may change while it runs) or
as its own process (``python verifier_server.py PORT LOG [TOKEN]``, which a test kills and
starts again): every request is one JSON line in the log (items, auth header matched).
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def score(item: dict[str, Any]) -> float:
    found = re.findall(r"\d+", item["completion"])
    return 1.0 if found and item["answer"] is not None and found[-1] == item["answer"] else 0.0


class Behaviour:
    """What the thread server does; a test changes it while the server runs."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.status = 200  # answer with this HTTP status (200: rewards)
        self.fail_next = 0  # this many requests get 503 first
        self.delay_s = 0.0
        self.null_for: set[str] = set()  # completions whose reward is null
        self.body: bytes | None = None  # answer this body instead of the rewards
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()


def _handler(behaviour: Behaviour, log: Path | None):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            b = behaviour
            with b.lock:
                b.in_flight += 1
                b.most_in_flight = max(b.most_in_flight, b.in_flight)
            try:
                self._answer(b)
            finally:
                with b.lock:
                    b.in_flight -= 1

        def _answer(self, b: Behaviour) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            auth = self.headers.get("Authorization")
            record = {"items": body["items"], "auth": auth, "path": self.path}
            with b.lock:
                b.requests.append(record)
                failing = b.fail_next > 0
                b.fail_next -= 1 if failing else 0
            time.sleep(b.delay_s)
            self._reply(b, body, failing)
            if log is not None:  # once answered: a test that kills the server after reads it
                with log.open("a") as f:
                    f.write(json.dumps({"items": len(body["items"]), "auth_ok": self._ok(b)}))
                    f.write("\n")

        def _reply(self, b: Behaviour, body: dict[str, Any], failing: bool) -> None:
            if not self._ok(b):
                return self._send(401, b'{"error": "unauthorized"}')
            if failing:
                return self._send(503, b'{"error": "busy"}')
            if b.status != 200:
                return self._send(b.status, b"{}")
            if b.body is not None:
                return self._send(200, b.body)
            rewards = [
                None if it["completion"] in b.null_for else score(it) for it in body["items"]
            ]
            self._send(200, json.dumps({"rewards": rewards}).encode())

        def _ok(self, b: Behaviour) -> bool:
            return b.token is None or self.headers.get("Authorization") == f"Bearer {b.token}"

        def _send(self, status: int, payload: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except BrokenPipeError:  # the client gave up waiting (a timeout test)
                pass

    return Handler


class VerifierServer:
    """The verifier on 127.0.0.1 in a thread of the test's own process."""

    def __init__(self, token: str | None = None, port: int = 0):
        self.behaviour = Behaviour(token)
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self.behaviour, None))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> VerifierServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str]) -> None:
    port, log = int(argv[0]), Path(argv[1])
    token = argv[2] if len(argv) > 2 else None
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(Behaviour(token), log))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
