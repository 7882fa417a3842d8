"""Chat templates: the Hugging Face-compatible Jinja environment, and assistant spans.

Templates render exactly as `transformers`' apply_chat_template does: a sandboxed
environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` filter that keeps non-ASCII text, and the variables
`messages`, `add_generation_prompt`, `bos_token`, `eos_token` (plus any extra ones).
`{% generation %}...{% endgeneration %}` blocks are supported and mark assistant text.

`assistant_spans` finds which characters of a rendered conversation the model should
learn (the assistant turns), which gives the completion-only loss mask.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Private-use characters that bracket {% generation %} output while rendering.
_GEN_OPEN = "\ue000"
_GEN_CLOSE = "\ue001"

Span = tuple[int, int]


class ChatTemplateError(ValueError):
    """A template that fails to compile or render (including raise_exception)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same as transformers: no HTML escaping, unicode kept.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationExtension(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: renders body, bracketed by markers that
    `ChatTemplate.render_with_spans` turns into assistant spans (and strips)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_mark", [])
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        return _GEN_OPEN + caller() + _GEN_CLOSE


def make_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment Hugging Face uses for chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationExtension, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return make_environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: line {e.lineno}: {e}") from e


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens bound."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = "",
        eos_token: str | None = "",
        origin: str = "chat template",
    ) -> None:
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.origin = origin
        self.template = _compile(source)
        self.has_generation_tags = "generation" in source and "endgeneration" in source

    def _render_raw(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self.template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.origin}: {e}") from e

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to text, like tokenizer.apply_chat_template(tokenize=False)."""
        text = self._render_raw(messages, add_generation_prompt, **kwargs)
        if self.has_generation_tags:
            text = text.replace(_GEN_OPEN, "").replace(_GEN_CLOSE, "")
        return text

    def render_with_spans(
        self, messages: Sequence[dict[str, Any]], **kwargs: Any
    ) -> tuple[str, list[Span]]:
        """The full conversation and the character spans of its assistant turns.

        Spans cover each assistant message's rendered text including its end-of-turn
        marker (so the model learns to stop), and exclude every non-assistant segment.
        """
        if self.has_generation_tags:
            raw = self._render_raw(messages, False, **kwargs)
            spans = _strip_generation_markers(raw)
            if spans is not None:
                return spans
        text = self.render(messages, **kwargs)
        return text, assistant_spans(self, messages, text, **kwargs)


def _strip_generation_markers(raw: str) -> tuple[str, list[Span]] | None:
    out: list[str] = []
    spans: list[Span] = []
    pos = 0
    start: int | None = None
    for ch in raw:
        if ch == _GEN_OPEN:
            if start is not None:
                return None
            start = pos
        elif ch == _GEN_CLOSE:
            if start is None:
                return None
            if pos > start:
                spans.append((start, pos))
            start = None
        else:
            out.append(ch)
            pos += 1
    if start is not None:
        return None
    return "".join(out), spans


def assistant_spans(
    template: ChatTemplate,
    messages: Sequence[dict[str, Any]],
    full_text: str | None = None,
    **kwargs: Any,
) -> list[Span]:
    """Character spans of the assistant turns of `messages` within its rendering.

    For the k-th message when it is an assistant turn, the span starts where the
    rendering of messages[:k] with add_generation_prompt=True ends, and stops where
    the rendering of messages[:k+1] ends. Templates whose earlier turns render
    differently once later turns follow (so the prefixes are not prefixes of the full
    text) fall back to locating the message content in order, plus a trailing
    end-of-sequence token.
    """
    text = template.render(messages, **kwargs) if full_text is None else full_text
    spans: list[Span] = []
    cursor = 0
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        try:
            prefix = template.render(messages[:k], add_generation_prompt=True, **kwargs)
            last = k == len(messages) - 1
            through = text if last else template.render(messages[: k + 1], **kwargs)
        except ChatTemplateError:  # e.g. templates that refuse a conversation ending early
            prefix = through = None
        start = end = None
        if prefix is not None and len(prefix) >= cursor and text.startswith(prefix):
            start = len(prefix)
            if through is not None and len(through) > start and text.startswith(through):
                end = len(through)
        if end is None:
            found = _locate_content(text, message, start if start is not None else cursor)
            if found is not None:
                start = found[0] if start is None else start
                end = found[1]
                if template.eos_token and text.startswith(template.eos_token, end):
                    end += len(template.eos_token)
        if start is None or end is None:
            raise ChatTemplateError(
                f"{template.origin}: cannot find assistant message {k} in the rendered "
                "conversation, so the loss mask cannot be computed; use a template whose "
                "earlier turns render the same when later turns follow, or one with "
                "{% generation %} blocks"
            )
        spans.append((start, end))
        cursor = end
    return spans


def _locate_content(text: str, message: dict[str, Any], cursor: int) -> Span | None:
    """Where the message content (or, when the template rewrote its beginning, its
    longest tail that starts after a '>' or newline) appears in text after cursor."""
    content = message.get("content")
    if isinstance(content, list):  # [{type: text, text: ...}, ...]
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str) or not content.strip():
        return None
    content = content.strip()
    cuts = [0] + [j + 1 for j, ch in enumerate(content[:-1]) if ch in ">\n"]
    for j in cuts:
        tail = content[j:].strip()
        if not tail:
            continue
        start = text.find(tail, cursor)
        if start >= 0:
            return start, start + len(tail)
    return None


def read_template_file(uri: str) -> str:
    """Read a Jinja chat template file (local or gs://)."""
    from posttrain.trainer import storage

    try:
        return storage.read_text(uri)
    except FileNotFoundError as e:
        raise ChatTemplateError(
            f"{uri}: chat template file not found (spec.data.chatTemplate)"
        ) from e


def template_from_tokenizer_config(config: dict[str, Any]) -> str | None:
    """The chat_template of a tokenizer_config.json: a string, or the 'default' entry of
    a list of {name, template}."""
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        by_name = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = by_name.get("default") or next(iter(by_name.values()), None)
    return tpl if isinstance(tpl, str) and tpl.strip() else None


# A ChatML template (as SmolLM2/Qwen use), for tests and for users who want one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
