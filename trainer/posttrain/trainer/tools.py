"""The tools of spec.grpo.agent.tools, as Tunix's agentic tools (``BaseTool``,
``ToolOutput``), and the toolbox that runs a turn's calls.

- calculator: Tunix's ``CalculatorTool`` (a, b, op of + - * /), deterministic;
- http: POSTs the call's arguments as JSON to the tool's URL (timeout, retries with
  backoff, the auth header from the Secret's variable ``tool_auth_env``, no redirects)
  and gives the answer's text (a JSON answer's "result" when it has one);
- python: ``module:callable`` imported as reward functions are (Python's own modules
  refused), called with the arguments.

A call that fails (an unknown tool, a malformed call, an error or timeout of the tool,
an answer that is not text or JSON) gives the model ``error: ...`` as its result and is
counted (``Toolbox.errors``), never a crash. Nothing here imports JAX.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from tunix.rl.agentic.tools import base_tool
from tunix.rl.agentic.tools.calculator_tool import CalculatorTool

from posttrain.api.service_urls import tool_auth_env
from posttrain.api.spec import AgentSpec, ToolSpec
from posttrain.trainer import reward_service
from posttrain.trainer.rewards import import_function
from posttrain.trainer.tool_calls import Call

CALCULATOR_DESCRIPTION = "Computes a op b for two numbers a and b and op one of + - * /."


class _Declared(base_tool.BaseTool):
    """A tool whose schema the job declares."""

    def __init__(self, spec: ToolSpec):
        super().__init__(spec.name, spec.description or "")
        object.__setattr__(self, "parameters", spec.parameters or {"type": "object"})

    def get_json_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


class HttpTool(_Declared):
    def __init__(self, spec: ToolSpec, field: str, environ: Mapping[str, str]):
        super().__init__(spec)
        http = spec.http
        headers = {"Content-Type": "application/json"}
        headers.update(
            reward_service.auth_headers(http, tool_auth_env(spec.name), f"{field}.http", environ)
        )
        object.__setattr__(self, "http", http)
        object.__setattr__(self, "headers", headers)

    def apply(self, **kwargs: Any) -> base_tool.ToolOutput:
        body = json.dumps(kwargs).encode()
        error = ""
        for attempt in range(int(self.http.retries) + 1):
            if attempt:
                time.sleep(reward_service.backoff(attempt - 1))
            request = urllib.request.Request(
                str(self.http.url), data=body, headers=self.headers, method="POST"
            )
            try:
                with reward_service.OPENER.open(
                    request, timeout=float(self.http.timeout_seconds)
                ) as response:
                    return base_tool.ToolOutput(name=self.name, output=_answer(response.read()))
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code} {e.reason}"
                if e.code < 500 and e.code not in (408, 429):
                    break
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", e)
                error = f"{type(reason).__name__}: {reason}"
            except ValueError as e:
                error = str(e)
        return base_tool.ToolOutput(name=self.name, error=error)


def _answer(raw: bytes) -> str:
    """A service's answer as the model sees it: a JSON object's "result", else the text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the tool's answer is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if isinstance(data, dict) and "result" in data:
        data = data["result"]
    return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)


class PythonTool(_Declared):
    def __init__(self, spec: ToolSpec, field: str):
        super().__init__(spec)
        object.__setattr__(self, "fn", import_function(spec.function, f"{field}.function"))

    def apply(self, **kwargs: Any) -> base_tool.ToolOutput:
        result = self.fn(**kwargs)
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        return base_tool.ToolOutput(name=self.name, output=text)


def build_tool(spec: ToolSpec, index: int, environ: Mapping[str, str]) -> base_tool.BaseTool:
    field = f"spec.grpo.agent.tools[{index}]"
    kind = str(spec.type)
    if kind == "calculator":
        return CalculatorTool(spec.name, spec.description or CALCULATOR_DESCRIPTION)
    if kind == "http":
        if spec.http is None:
            raise ValueError(f"{field}.http: an http tool needs http.url")
        return HttpTool(spec, field, environ)
    if not spec.function:
        raise ValueError(f"{field}.function: a python tool needs function (module:callable)")
    return PythonTool(spec, field)


class Toolbox:
    """The job's tools, by name; runs calls and counts them and their errors."""

    def __init__(self, agent: AgentSpec, environ: Mapping[str, str] = os.environ):
        self.tools = {t.name: build_tool(t, i, environ) for i, t in enumerate(agent.tools)}
        self.max_chars = int(agent.max_tool_output_chars)
        self.calls = 0
        self.errors = 0

    def schemas(self) -> list[dict[str, Any]]:
        return [t.get_json_schema() for t in self.tools.values()]

    def run(self, call: Call) -> str:
        """The result the model is shown for one call."""
        self.calls += 1
        if call.error is not None:
            return self._error(call.error)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return self._error(f"no tool named {call.name!r} (tools: {known})")
        try:
            out = tool.apply(**call.arguments)
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to see
            return self._error(f"{type(e).__name__}: {e}")
        if out.error is not None:
            return self._error(str(out.error))
        text = out.output if isinstance(out.output, str) else json.dumps(out.output)
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + f"... (cut at {self.max_chars} characters)"
        return text

    def _error(self, message: str) -> str:
        self.errors += 1
        return f"error: {message}"

    def take_counts(self) -> tuple[int, int]:
        counts = self.calls, self.errors
        self.calls = self.errors = 0
        return counts
