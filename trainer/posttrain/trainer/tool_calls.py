"""Tool calls and tool results in each chat family's format (spec.grpo.agent.toolFormat).

- chatml (Qwen2/3, SmolLM2, any ``<|im_start|>`` template): the model writes
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a result is a user turn
  of ``<tool_response>...</tool_response>`` (Qwen3's template renders tool messages so);
- llama3 (``<|start_header_id|>`` templates): a turn that is one JSON object
  ``{"name": ..., "parameters": {...}}`` is a call; a result is an ``ipython`` turn;
- gemma (``<start_of_turn>`` templates): ``\u0060\u0060\u0060tool_code\nname(a=1, b="x")\n\u0060\u0060\u0060``;
  a result is a user turn with a ``\u0060\u0060\u0060tool_output`` block.

``parse`` returns the calls and the malformed ones (a call that is not the format's JSON
or keyword call): a malformed call is answered with an error message as its result, as
a tool's error is, and counted. Tunix's QwenToolParser prints and skips a malformed
call and its GeminiToolParser finds none; this module counts them instead.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

FENCE = "`" * 3


@dataclass
class Call:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the call could not be read: this is said to the model


@dataclass(frozen=True)
class Format:
    name: str
    end_of_turn: str  # the token text that ends a model turn

    def parse(self, text: str) -> list[Call]:
        return _PARSERS[self.name](text)

    def result_turn(self, results: list[str]) -> str:
        """The text after a model's turn (its end-of-turn included) up to the next
        model turn's start: the tool results as the family's tool message."""
        if self.name == "chatml":
            body = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
            return f"\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
        if self.name == "llama3":
            body = "\n".join(results)
            return (
                f"<|start_header_id|>ipython<|end_header_id|>\n\n{body}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n"
            )
        body = "\n".join(f"{FENCE}tool_output\n{r}\n{FENCE}" for r in results)
        return f"\n<start_of_turn>user\n{body}<end_of_turn>\n<start_of_turn>model\n"

    def with_tools(self, prompt: str, tools_text: str) -> str:
        """The rendered prompt with the tools' instructions in a system turn (chatml,
        llama3) or at the start of the first user turn (gemma, which has no system)."""
        if self.name == "chatml":
            return f"<|im_start|>system\n{tools_text}<|im_end|>\n{prompt}"
        if self.name == "llama3":
            head = "<|begin_of_text|>"
            rest = prompt[len(head) :] if prompt.startswith(head) else prompt
            system = f"<|start_header_id|>system<|end_header_id|>\n\n{tools_text}<|eot_id|>"
            return (head if prompt.startswith(head) else "") + system + rest
        marker = "<start_of_turn>user\n"
        at = prompt.find(marker)
        if at < 0:
            return f"{tools_text}\n\n{prompt}"
        at += len(marker)
        return f"{prompt[:at]}{tools_text}\n\n{prompt[at:]}"

    def instructions(self, schemas: list[dict[str, Any]]) -> str:
        """What the model is told about its tools and how to call them."""
        listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        if self.name == "chatml":
            how = (
                "For each function call, return a json object with function name and "
                "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
            )
            return (
                "# Tools\n\nYou may call one or more functions to assist with the user query."
                f"\n\nYou are provided with function signatures within <tools></tools> XML "
                f"tags:\n<tools>\n{listed}\n</tools>\n\n{how}"
            )
        if self.name == "llama3":
            return (
                "You have access to the following functions. To call a function, respond "
                'with only a JSON object {"name": function name, "parameters": dictionary '
                f"of argument name and its value}}.\n\n{listed}"
            )
        return (
            "You have access to the following functions. To call one, write a Python call "
            f"in a {FENCE}tool_code block, e.g.\n{FENCE}tool_code\nname(arg=1)\n{FENCE}\n\n"
            f"{listed}"
        )


FORMATS = {
    "chatml": Format("chatml", "<|im_end|>"),
    "llama3": Format("llama3", "<|eot_id|>"),
    "gemma": Format("gemma", "<end_of_turn>"),
}


def detect(template_text: str | None, field: str = "spec.grpo.agent.toolFormat") -> Format:
    """The format of a chat template (auto), from its turn markers."""
    text = template_text or ""
    for marker, name in (
        ("<|im_start|>", "chatml"),
        ("<|start_header_id|>", "llama3"),
        ("<start_of_turn>", "gemma"),
    ):
        if marker in text:
            return FORMATS[name]
    raise ValueError(
        f"{field}: auto cannot tell the tool-call format from the model's chat template; "
        "set toolFormat to chatml, llama3 or gemma"
    )


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object")
    return value


def _parse_chatml(text: str) -> list[Call]:
    calls = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL):
        calls.append(_json_call(body.strip(), "arguments"))
    return calls


def _json_call(body: str, key: str) -> Call:
    try:
        data = json.loads(body)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ValueError('a call is a JSON object with a string "name"')
        args = data.get(key, data.get("arguments" if key != "arguments" else "parameters", {}))
        return Call(data["name"], _arguments(args, f'"{key}"'))
    except ValueError as e:
        name = ""
        if found := re.search(r'"name"\s*:\s*"([^"]*)"', body):
            name = found.group(1)
        return Call(name, error=f"malformed tool call ({e}); write {_example(key)}")


def _example(key: str) -> str:
    return '{"name": "<tool>", "' + key + '": {...}}'


def _parse_llama3(text: str) -> list[Call]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{") or '"name"' not in body:
        return []
    return [_json_call(body, "parameters")]


def _parse_gemma(text: str) -> list[Call]:
    calls = []
    pattern = re.escape(FENCE) + r"tool_code\s*\n(.*?)(?:" + re.escape(FENCE) + "|$)"
    for body in re.findall(pattern, text, re.DOTALL):
        calls.append(_keyword_call(body.strip()))
    return calls


def _keyword_call(body: str) -> Call:
    """name(a=1, b="x"): literal keyword arguments only (nothing is evaluated)."""
    try:
        node = ast.parse(body, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("a call is name(argument=value, ...)")
        if node.args:
            raise ValueError("arguments are given by name")
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        return Call(node.func.id, args)
    except (SyntaxError, ValueError) as e:
        name = body.split("(", 1)[0].strip()
        return Call(name, error=f"malformed tool call ({e}); write name(argument=value)")


_PARSERS = {"chatml": _parse_chatml, "llama3": _parse_llama3, "gemma": _parse_gemma}
