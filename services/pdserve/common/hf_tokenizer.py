"""A real model's tokenizer: its ``tokenizer.json`` through the ``tokenizers`` library and its chat
template, behind the same ``Tokenizer`` protocol as the package's byte tokenizer.

Routers build one per deployment from the ``TokenizerBundle`` its workers shipped
(``HfTokenizer.from_bundle``); pool managers build one to check a bundle before they store it;
tests build one from a folder (``load``). Counting, templating and streaming follow what vLLM
does with the same files: raw prompts get the tokenizer's post-processor (``add_special_tokens``,
e.g. Llama's BOS), rendered chat prompts do not (the template wrote the BOS), streamed text comes
from ``tokenizers.decoders.DecodeStream``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from pdserve.common.chat_template import ChatTemplate
from pdserve.common.errors import ConfigError, InvalidArgumentError
from pdserve.common.tokenizer import TextStream
from pdserve.common.tokenizer_bundle import TokenizerBundle, bundle_from_folder


class HfTokenizer:
    """One model's tokenizer (see the module docstring). Build with ``from_bundle``.

    ``max_model_len`` is the model's context limit from the bundle (0 = unknown); ``sha256`` the
    bundle's digest, which names this tokenizer in the pool view.
    """

    def __init__(self, backend: tokenizers.Tokenizer, bundle: TokenizerBundle,
                 chat_template: ChatTemplate | None) -> None:
        self._backend = backend
        self._chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = _token_id(backend, bundle.bos_token)
        self.eos_token_id = _token_id(backend, bundle.eos_token)
        self.pad_token_id = _token_id(backend, bundle.pad_token)
        self.max_model_len = bundle.max_model_len
        self.sha256 = bundle.sha256

    @classmethod
    def from_bundle(cls, bundle: TokenizerBundle) -> HfTokenizer:
        """Raises ``InvalidArgumentError`` naming the field of a ``tokenizer`` bundle the
        library or Jinja cannot load (``tokenizer.tokenizer_json``, ``tokenizer.chat_template``).
        Parsing a large vocabulary takes a while (about a second for 250K tokens): callers on an
        event loop run this in a thread."""
        try:
            backend = tokenizers.Tokenizer.from_str(bundle.tokenizer_json.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - the library raises bare Exception
            raise InvalidArgumentError(
                f"tokenizer.tokenizer_json: not a tokenizer.json the tokenizers library can load "
                f"({str(exc)[:200]})", field="tokenizer.tokenizer_json") from None
        template = None
        if bundle.chat_template:
            specials = {"bos_token": bundle.bos_token, "eos_token": bundle.eos_token,
                        "pad_token": bundle.pad_token}
            template = ChatTemplate(bundle.chat_template, specials,
                                    field="tokenizer.chat_template")
        return cls(backend, bundle, template)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def count(self, text: str) -> int:
        return len(self._backend.encode(text, add_special_tokens=False).ids)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        if self._chat_template is None:
            raise InvalidArgumentError(
                "messages: this model has no chat template; send a prompt to /v1/completions",
                field="messages")
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> TextStream:
        return _HfTextStream(self._backend, skip_special_tokens)


class _HfTextStream:
    """``DecodeStream`` (whole characters only, with the context that start-of-word decoders
    need) and, at the end, what it still holds: the text of the whole sequence past what was
    released (one full decode, once)."""

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._is_skipping_specials = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._token_ids: list[int] = []
        self._released: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        pieces = []
        for token_id in token_ids:
            self._token_ids.append(token_id)
            piece = self._stream.step(self._backend, token_id)
            if piece:
                pieces.append(piece)
        text = "".join(pieces)
        self._released.append(text)
        return text

    def finish(self) -> str:
        released = "".join(self._released)
        full = str(self._backend.decode(self._token_ids,
                                        skip_special_tokens=self._is_skipping_specials))
        return full[len(released):] if full.startswith(released) else ""


def _token_id(backend: tokenizers.Tokenizer, token: str) -> int | None:
    if not token:
        return None
    token_id = backend.token_to_id(token)
    return int(token_id) if token_id is not None else None


def load(path: str | Path) -> HfTokenizer:
    """The tokenizer of a local Hugging Face model or tokenizer folder (never downloads).
    Raises ``ConfigError`` naming the path if the folder has no usable tokenizer."""
    try:
        return HfTokenizer.from_bundle(bundle_from_folder(path))
    except InvalidArgumentError as exc:
        raise ConfigError(f"tokenizer_path: {path}: {exc.message}",
                          field="tokenizer_path") from None
