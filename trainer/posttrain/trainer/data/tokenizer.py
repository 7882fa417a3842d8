"""The model's tokenizer: a ``tokenizers.Tokenizer`` with its special tokens and chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from posttrain.trainer import storage
from posttrain.trainer.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    read_template_file,
    template_from_tokenizer_config,
)
from posttrain.trainer.data.errors import DataError


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) and tok else None


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's special tokens and chat template.

    encode() does not add special tokens unless asked: chat templates write them.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        origin: str = "tokenizer",
    ) -> None:
        self.tokenizer = tokenizer
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.origin = origin
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = self._id(bos_token)
        self.eos_id = self._id(eos_token)
        pad_id = self._id(pad_token)
        self.pad_token = pad_token if pad_id is not None else eos_token
        self.pad_id: int = pad_id if pad_id is not None else (self.eos_id or 0)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[Any]:
        """`tokenizers.Encoding`s (ids, offsets) of many texts, encoded in parallel."""
        return self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def template(self, override: str | None = None) -> ChatTemplate | None:
        """The chat template to use: the file `override` (spec.data.chatTemplate) when
        given, else the tokenizer's own, else None."""
        try:
            if override:
                source, origin = read_template_file(override), override
            elif self.chat_template:
                source, origin = self.chat_template, f"{self.origin}: chat_template"
            else:
                return None
            return ChatTemplate(
                source, bos_token=self.bos_token, eos_token=self.eos_token, origin=origin
            )
        except ChatTemplateError as e:
            raise DataError(str(e)) from e


def load_tokenizer(model_dir: str) -> Tokenizer:
    """Load tokenizer.json, tokenizer_config.json (special tokens, chat_template) and
    chat_template.jinja from a Hugging Face model directory (local or gs://)."""
    from tokenizers import Tokenizer as HFTokenizer

    tok_path = storage.join(model_dir, "tokenizer.json")
    try:
        tok = HFTokenizer.from_str(storage.read_text(tok_path))
    except FileNotFoundError as e:
        raise DataError(
            f"{tok_path}: not found; the model directory (spec.model.source) needs a "
            "Hugging Face tokenizer.json"
        ) from e
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = storage.join(model_dir, name)
        if storage.exists(path):
            config.update(
                {k: v for k, v in json.loads(storage.read_text(path)).items() if v is not None}
            )
    template = template_from_tokenizer_config(config)
    jinja_path = storage.join(model_dir, "chat_template.jinja")
    if template is None and storage.exists(jinja_path):
        template = storage.read_text(jinja_path)
    return Tokenizer(
        tok,
        bos_token=_token_content(config.get("bos_token")),
        eos_token=_token_content(config.get("eos_token")),
        pad_token=_token_content(config.get("pad_token")),
        chat_template=template,
        origin=str(model_dir),
    )
