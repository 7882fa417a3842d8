"""Chat templates: the Hugging Face-compatible Jinja environment and assistant spans."""

from __future__ import annotations

import pytest

from posttrain.trainer.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    assistant_spans,
    read_template_file,
    template_from_tokenizer_config,
)
from tests.trainer.data_helpers import CHATML_SMOL

CONV = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Answer: Paris."},
]

MULTI = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "2 + 3?"},
    {"role": "assistant", "content": "Answer: 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "Answer: 8."},
]


def test_chatml_renders_like_smollm2():
    t = ChatTemplate(CHATML_SMOL, eos_token="<|im_end|>")
    assert t.render(CONV) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nAnswer: Paris.<|im_end|>\n"
    )
    assert t.render(CONV[:1], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # a system message replaces the default one
    assert t.render(MULTI[:2]).startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>")


def test_trim_and_lstrip_blocks_like_hf():
    src = """
    {% for m in messages %}
        {% if m.role == 'user' %}
            U: {{ m.content }}
        {% else %}
            A: {{ m.content }}
        {% endif %}
    {% endfor %}
    """
    # lstrip_blocks removes indentation before tags, trim_blocks the newline after them
    out = ChatTemplate(src).render(CONV)
    assert out == (
        "\n            U: What is the capital of France?\n            A: Answer: Paris.\n    "
    )


def test_bos_eos_generation_prompt_and_extra_variables():
    src = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
        "{% if date %}<{{ date }}>{% endif %}"
    )
    t = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    assert t.render(CONV[:1], add_generation_prompt=True) == (
        "<s>[user]What is the capital of France?</s>[assistant]"
    )
    assert t.render(CONV[:1], date="today") == "<s>[user]What is the capital of France?</s><today>"


def test_raise_exception():
    src = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation roles must start with user') }}{% endif %}ok"
    )
    t = ChatTemplate(src, origin="my.jinja")
    assert t.render(CONV) == "ok"
    with pytest.raises(ChatTemplateError, match="my.jinja: Conversation roles must start"):
        t.render(CONV[1:])


def test_tojson_keeps_unicode_and_accepts_indent():
    t = ChatTemplate("{{ messages[0] | tojson }}|{{ {'a': [1, 2]} | tojson(indent=2) }}")
    out = t.render([{"role": "user", "content": "café <b>"}])
    assert out == '{"role": "user", "content": "café <b>"}|{\n  "a": [\n    1,\n    2\n  ]\n}'


def test_loop_controls():
    src = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }};{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
    )
    assert ChatTemplate(src).render(MULTI) == "2 + 3?;Answer: 5.;"


def test_sandbox_refuses_unsafe_attributes():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        t.render(CONV)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_strftime_now_is_available():
    assert len(ChatTemplate("{{ strftime_now('%Y') }}").render([])) == 4


def _pieces(text, spans):
    return [text[a:b] for a, b in spans]


def test_assistant_spans_single_turn():
    t = ChatTemplate(CHATML_SMOL)
    text, spans = t.render_with_spans(CONV)
    assert _pieces(text, spans) == ["Answer: Paris.<|im_end|>\n"]


def test_assistant_spans_multi_turn_cover_only_assistant_segments():
    t = ChatTemplate(CHATML_SMOL)
    text, spans = t.render_with_spans(MULTI)
    assert _pieces(text, spans) == ["Answer: 5.<|im_end|>\n", "Answer: 8.<|im_end|>\n"]
    outside = text[: spans[0][0]] + text[spans[0][1] : spans[1][0]] + text[spans[1][1] :]
    assert "Answer" not in outside and "And 4 + 4?" in outside


def test_generation_tags_mark_assistant_text():
    src = (
        "{% for m in messages %}<|{{ m.role }}|>"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
        "{% else %}{{ m.content }}<|end|>{% endif %}{% endfor %}"
    )
    t = ChatTemplate(src)
    text, spans = t.render_with_spans(MULTI)
    assert "\ue000" not in text and text == t.render(MULTI)
    assert _pieces(text, spans) == ["Answer: 5.<|end|>", "Answer: 8.<|end|>"]


def test_spans_fall_back_when_earlier_turns_render_differently():
    # Like Qwen3: earlier assistant turns lose their reasoning once a later turn follows,
    # so rendering a prefix of the conversation is not a prefix of the full rendering.
    src = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.role == 'assistant' and not loop.last %}"
        "{{ m.content.split('</think>')[-1] }}"
        "{% else %}{{ m.content }}{% endif %}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    t = ChatTemplate(src, eos_token="</s>")
    conv = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>hmm</think>a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>ok</think>a2"},
    ]
    text = t.render(conv)
    assert text == "<user>q1</s><assistant>a1</s><user>q2</s><assistant><think>ok</think>a2</s>"
    assert _pieces(text, assistant_spans(t, conv)) == ["a1</s>", "<think>ok</think>a2</s>"]


def test_chatml_constant_and_tokenizer_config_forms():
    assert ChatTemplate(CHATML_TEMPLATE).render(CONV[:1], add_generation_prompt=True) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template_from_tokenizer_config({"chat_template": "x"}) == "x"
    assert template_from_tokenizer_config({}) is None
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    assert template_from_tokenizer_config({"chat_template": named}) == "d"


def test_read_template_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(CHATML_TEMPLATE)
    assert read_template_file(str(path)) == CHATML_TEMPLATE
    with pytest.raises(ChatTemplateError, match=r"missing.jinja: chat template file not found"):
        read_template_file(str(tmp_path / "missing.jinja"))
