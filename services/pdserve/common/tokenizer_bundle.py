"""A model's tokenizer as it travels from a worker to the routers: ``TokenizerBundle``.

A worker that serves a real model builds the bundle from the model (or tokenizer) folder at start
(``bundle_from_folder``) and sends it once, with ``Register``; its ``WorkerInfo`` carries only the
digest, so nothing big rides on heartbeats. The pool manager checks the bundle (the router's
tokenizer must load from it) and keeps it in the hot state by digest; routers load it by the digest
their pool view shows. No shared filesystem anywhere.

Digest (``sha256``): SHA-256 over a canonical encoding that any implementation can reproduce:
``b"pdserve-tokenizer-bundle-v1\\n"``, then for each field in order (``tokenizer_json``,
``chat_template``, ``bos_token``, ``eos_token``, ``pad_token`` as UTF-8, ``max_model_len`` as
decimal ASCII) its length as 8 bytes little-endian and its bytes. Lowercase hex.

Size cap: ``MAX_BUNDLE_BYTES`` (40 MiB over all fields). The largest ``tokenizer.json`` in common
use (Gemma 3's, a 262K vocabulary) is about 33 MB; the cap keeps a ``RegisterRequest`` well inside
the 64 MiB gRPC message limit of pdserve's servers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.api.v1 import common_pb2 as pb
from pdserve.common.errors import ConfigError, InvalidArgumentError

MAX_BUNDLE_BYTES = 40 * 2**20
"""Largest bundle accepted (sum of all fields), bytes."""
_DIGEST_HEADER = b"pdserve-tokenizer-bundle-v1\n"
_UNLIMITED_MODEL_MAX_LENGTH = 10**9
"""``model_max_length`` at or above this means "no limit" (transformers writes 1e30 then)."""


@dataclass(frozen=True, slots=True)
class TokenizerBundle:
    """Everything a router needs to tokenize, template and detokenize for one model.

    ``tokenizer_json`` is the Hugging Face ``tokenizer.json`` (UTF-8 JSON bytes);
    ``chat_template`` the Jinja chat template ("" if the model has none); the special tokens are
    their text ("" if none); ``max_model_len`` the model's context limit in tokens (0 = unknown).
    ``sha256`` is computed (see the module docstring). Raises ``InvalidArgumentError`` (field
    ``tokenizer``) when the bundle is over ``MAX_BUNDLE_BYTES``.
    """

    tokenizer_json: bytes
    chat_template: str = ""
    bos_token: str = ""
    eos_token: str = ""
    pad_token: str = ""
    max_model_len: int = 0
    sha256: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_bytes > MAX_BUNDLE_BYTES:
            raise InvalidArgumentError(
                f"tokenizer: the bundle has {self.num_bytes} bytes, more than the "
                f"{MAX_BUNDLE_BYTES} accepted", field="tokenizer")
        if not 0 <= self.max_model_len < 2**32:
            raise InvalidArgumentError("tokenizer.max_model_len: must be in [0, 2**32)",
                                       field="tokenizer.max_model_len")
        object.__setattr__(self, "sha256", _digest(self._canonical_fields()))

    @property
    def num_bytes(self) -> int:
        return len(self.tokenizer_json) + sum(
            len(text.encode("utf-8"))
            for text in (self.chat_template, self.bos_token, self.eos_token, self.pad_token))

    def _canonical_fields(self) -> tuple[bytes, ...]:
        texts = (self.chat_template, self.bos_token, self.eos_token, self.pad_token)
        return (self.tokenizer_json, *(t.encode("utf-8") for t in texts),
                str(self.max_model_len).encode("ascii"))


def _digest(fields: tuple[bytes, ...]) -> str:
    digest = hashlib.sha256(_DIGEST_HEADER)
    for value in fields:
        digest.update(len(value).to_bytes(8, "little"))
        digest.update(value)
    return digest.hexdigest()


def bundle_to_pb(bundle: TokenizerBundle) -> pb.TokenizerBundle:
    return pb.TokenizerBundle(
        tokenizer_json=bundle.tokenizer_json, chat_template=bundle.chat_template,
        bos_token=bundle.bos_token, eos_token=bundle.eos_token, pad_token=bundle.pad_token,
        max_model_len=bundle.max_model_len, sha256=bundle.sha256)


def bundle_from_pb(message: pb.TokenizerBundle) -> TokenizerBundle:
    """The bundle a ``tokenizer`` field carries, its digest checked. Raises
    ``InvalidArgumentError`` naming the field: ``tokenizer`` (over ``MAX_BUNDLE_BYTES``),
    ``tokenizer.tokenizer_json`` (empty or not UTF-8), ``tokenizer.sha256`` (not the content's)."""
    if not message.tokenizer_json:
        raise InvalidArgumentError("tokenizer.tokenizer_json: required",
                                   field="tokenizer.tokenizer_json")
    try:
        message.tokenizer_json.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgumentError("tokenizer.tokenizer_json: not UTF-8 text",
                                   field="tokenizer.tokenizer_json") from None
    bundle = TokenizerBundle(
        tokenizer_json=message.tokenizer_json, chat_template=message.chat_template,
        bos_token=message.bos_token, eos_token=message.eos_token, pad_token=message.pad_token,
        max_model_len=message.max_model_len)
    if message.sha256 != bundle.sha256:
        raise InvalidArgumentError(
            f"tokenizer.sha256: {message.sha256!r} is not the digest of the bundle's content",
            field="tokenizer.sha256")
    return bundle


def bundle_from_folder(path: str | Path) -> TokenizerBundle:
    """The bundle of a Hugging Face model or tokenizer folder.

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (chat template, special tokens,
    ``model_max_length``), ``special_tokens_map.json`` (special tokens it lacks),
    ``chat_template.jinja`` (the template newer ``transformers`` saves there; it wins) and
    ``config.json`` (``max_position_embeddings``, the model's context limit, which wins over the
    tokenizer's). Raises ``ConfigError`` naming the path when the folder or its
    ``tokenizer.json`` is missing or a file is malformed.
    """
    folder = Path(path)
    tokenizer_file = folder / "tokenizer.json"
    if not folder.is_dir():
        raise ConfigError(f"tokenizer_path: {folder} is not a folder", field="tokenizer_path")
    if not tokenizer_file.is_file():
        raise ConfigError(f"tokenizer_path: no tokenizer.json in {folder}",
                          field="tokenizer_path")
    config = _json_file(folder / "tokenizer_config.json")
    special_map = _json_file(folder / "special_tokens_map.json")
    template_file = folder / "chat_template.jinja"
    chat_template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                     else _default_template(config.get("chat_template"), folder))
    try:
        return TokenizerBundle(
            tokenizer_json=tokenizer_file.read_bytes(), chat_template=chat_template,
            bos_token=_token_text(config, special_map, "bos_token"),
            eos_token=_token_text(config, special_map, "eos_token"),
            pad_token=_token_text(config, special_map, "pad_token"),
            max_model_len=_max_model_len(config, _json_file(folder / "config.json")))
    except InvalidArgumentError as exc:
        raise ConfigError(f"tokenizer_path: {folder}: {exc.message}",
                          field="tokenizer_path") from None


def _json_file(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` if absent; ``ConfigError`` naming it if malformed."""
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"tokenizer_path: {path} is not valid JSON ({exc})",
                          field="tokenizer_path") from None
    if not isinstance(document, dict):
        raise ConfigError(f"tokenizer_path: {path} is not a JSON object", field="tokenizer_path")
    return document


def _default_template(value: Any, folder: Path) -> str:
    """``chat_template`` of tokenizer_config.json: a string, or a list of named templates of
    which the one named ``default`` is what ``apply_chat_template`` uses without tools."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        template = named.get("default")
        if isinstance(template, str):
            return template
    raise ConfigError(f"tokenizer_path: {folder}/tokenizer_config.json: chat_template must be a "
                      "string or a list of named templates with a 'default' one",
                      field="tokenizer_path")


def _token_text(config: Mapping[str, Any], special_map: Mapping[str, Any], name: str) -> str:
    """A special token's text: a string, or an AddedToken object's ``content``."""
    value = config.get(name, special_map.get(name))
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _max_model_len(config: Mapping[str, Any], model_config: Mapping[str, Any]) -> int:
    for value in (model_config.get("max_position_embeddings"), config.get("model_max_length")):
        if isinstance(value, int | float) and 0 < value < _UNLIMITED_MODEL_MAX_LENGTH:
            return int(value)
    return 0
