"""A real HTTP tool service for the tests of spec.grpo.agent's http tools.

POST /capital {"country": "France"} -> {"result": "Paris"} (401 without the token, when
the server has one); /slow waits 2 s; /broken answers 500; /binary answers bytes that are not
UTF-8. Every request is kept (path, JSON body, auth header).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Peru": "Lima"}


class ToolServer:
    def __init__(self, token: str | None = None):
        self.token = token
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                auth = self.headers.get("Authorization")
                server.requests.append({"path": self.path, "body": body, "auth": auth})
                token = server.token if self.path == "/capital" else None
                if token is not None and auth != f"Bearer {token}":
                    return self._send(401, b"{}")
                if self.path == "/slow":
                    time.sleep(2)
                    return self._send(200, b'{"result": "late"}')
                if self.path == "/broken":
                    return self._send(500, b"{}")
                if self.path == "/binary":
                    return self._send(200, b"\xff\xfe\xfa")
                capital = CAPITALS.get(body.get("country"), "unknown")
                self._send(200, json.dumps({"result": capital}).encode())

            def _send(self, status: int, payload: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except BrokenPipeError:  # the client timed out
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ToolServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
