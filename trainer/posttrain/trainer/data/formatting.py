"""Formatting rows: conversations (messages, or prompt + completion) and prompts, rendered
through the chat template (or as plain text when the tokenizer has none)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from posttrain.trainer.chat_template import ChatTemplate, ChatTemplateError
from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.reading import Row
from posttrain.trainer.data.tokenizer import Tokenizer


def as_messages(value: Any, role: str, where: Any, field_name: str) -> list[dict[str, Any]]:
    """A string as one message of `role`, or a validated list of {role, content}."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if hasattr(value, "tolist"):  # numpy arrays from some readers
        value = value.tolist()
    if not isinstance(value, list | tuple):
        raise DataError(
            f"{where}: spec.data.columns.{field_name} must be text or a list of "
            f"{{role, content}} messages, got {type(value).__name__}"
        )
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise DataError(
                f"{where}: message {j} of spec.data.columns.{field_name} must be an object "
                f"with 'role' and 'content', got {str(m)[:80]!r}"
            )
        out.append(dict(m))
    return out


def _messages_value(row: Row, column: str) -> Any:
    v = row.value(column, "messages")
    if isinstance(v, str) and v.lstrip().startswith("["):  # messages stored as JSON text
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise DataError(f"{row.where}: column {column!r} is not valid JSON: {e}") from e
    return v


def uses_messages(records: Any, columns: Any) -> bool:
    """Whether rows are conversations in the messages column (else prompt + completion);
    DataError naming the file when the columns for either are missing."""
    if records.has(columns.messages):
        records.require(columns.messages, "messages")
        return True
    if not records.has(columns.prompt):
        f = records.files[0]
        raise DataError(
            f"{f.path}: column {columns.messages!r} (spec.data.columns.messages) not "
            f"found, nor column {columns.prompt!r} (spec.data.columns.prompt) with "
            f"{columns.completion!r} (spec.data.columns.completion); columns are: "
            f"{', '.join(f.columns) or '(none)'}"
        )
    records.require(columns.prompt, "prompt")
    records.require(columns.completion, "completion")
    return False


def sft_conversation(row: Row, columns: Any, messages: bool) -> list[dict[str, Any]]:
    """A row as a conversation: its messages column (`messages`), else prompt and
    completion as a user turn and an assistant turn."""
    if messages:
        msgs = as_messages(_messages_value(row, columns.messages), "user", Where(row), "messages")
        if not any(m.get("role") == "assistant" for m in msgs):
            raise DataError(
                f"{row.where}: column {columns.messages!r} (spec.data.columns.messages)"
                " has no assistant message to learn"
            )
        return msgs
    prompt = as_messages(row.value(columns.prompt, "prompt"), "user", Where(row), "prompt")
    completion = as_messages(
        row.value(columns.completion, "completion"), "assistant", Where(row), "completion"
    )
    return prompt + completion


class Where:
    """A row's location, found only when a message is formatted with it."""

    def __init__(self, row: Row) -> None:
        self.row = row

    def __str__(self) -> str:
        return self.row.where

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def render_conversation(
    template: ChatTemplate | None, conversation: list[dict[str, Any]], where: Any
) -> tuple[str, list[tuple[int, int]], bool]:
    """Text, assistant character spans, and whether the tokenizer should add its own
    special tokens (only without a chat template)."""
    if template is None:
        roles = [m.get("role") for m in conversation]
        if roles != ["user", "assistant"] or not all(
            isinstance(m.get("content"), str) for m in conversation
        ):
            raise DataError(
                f"{where}: the tokenizer has no chat template, so only plain prompt/completion "
                "text can be used; set spec.data.chatTemplate to a Jinja chat template file"
            )
        prompt, completion = conversation[0]["content"], conversation[1]["content"]
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))], True
    try:
        text, spans = template.render_with_spans(conversation)
    except ChatTemplateError as e:
        raise DataError(f"{where}: {e}") from e
    return text, spans, False


def prompt_messages(value: Any, where: Any) -> list[dict[str, Any]]:
    return as_messages(value, "user", where, "prompt")


def render_prompt(template: ChatTemplate | None, messages: list[dict[str, Any]], where: Any) -> str:
    if template is None:
        if len(messages) != 1 or not isinstance(messages[0]["content"], str):
            raise DataError(
                f"{where}: the tokenizer has no chat template, so prompts must be plain "
                "text; set spec.data.chatTemplate"
            )
        return messages[0]["content"]
    try:
        return template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise DataError(f"{where}: {e}") from e


def generation_prompts(spec: Any, tokenizer: Tokenizer, records: Any, n: int) -> list[str]:
    """The first n rows' prompts, rendered with the generation prompt: the conversation
    before its last assistant turn (sft, distill) or the prompt column (dpo, grpo)."""
    columns, template = spec.data.columns, tokenizer.template(spec.data.chat_template)
    rows = [records[i] for i in range(min(n, len(records)))]
    if str(spec.technique) in ("dpo", "grpo"):
        records.require(columns.prompt, "prompt")
        messages = [prompt_messages(r.value(columns.prompt, "prompt"), Where(r)) for r in rows]
    else:
        use = uses_messages(records, columns)
        messages = []
        for r in rows:
            conv = sft_conversation(r, columns, use)
            last = max(i for i, m in enumerate(conv) if m.get("role") == "assistant")
            messages.append(conv[:last])
    return [render_prompt(template, m, Where(r)) for r, m in zip(rows, messages, strict=True)]
