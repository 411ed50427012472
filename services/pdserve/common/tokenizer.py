"""The package's own tokenizer: byte-level, self-contained, no downloads.

The tokenizer of every deployment whose workers ship none of their own (``sim`` and ``tiny``):
the router counts tokens with it (admission, context limits, ``usage``, prefix hashes), so all
services agree with each other and with the ``tiny`` engine, whose vocabulary is exactly this one.
Workers that serve a real model ship its tokenizer instead (``pdserve.common.tokenizer_bundle``).
The ``Tokenizer`` protocol here is what both kinds provide.

Token ids:

==========  ===============  =====================================================
id          string           meaning
==========  ===============  =====================================================
0 .. 255    (one raw byte)   the UTF-8 bytes of the text, byte value = token id
256         ``<|bos|>``      begin of a chat turn / sequence (``BOS_ID``)
257         ``<|eos|>``      end of a chat turn / sequence (``EOS_ID``)
258         ``<|pad|>``      padding (``PAD_ID``); never produced by ``encode`` of normal text
==========  ===============  =====================================================

``VOCAB_SIZE`` is 259. The special strings are recognised anywhere in the input text (exactly as a
Hugging Face tokenizer recognises its added special tokens), so ``encode(render_chat_prompt(m))``
yields real BOS/EOS ids and the exported Hugging Face tokenizer gives the same ids as ``encode``.

``export(dir)`` writes a Hugging Face tokenizer folder (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``) so that OpenAI-HTTP load generators can
count tokens locally with ``AutoTokenizer.from_pretrained(dir)``. A real model's tokenizer is
``pdserve.common.hf_tokenizer.HfTokenizer``, behind the same ``Tokenizer`` protocol.

``prefix_block_hashes`` chains a stable 64-bit hash over full blocks of token ids; routers compare
these with the hashes a worker reports to estimate prefix-cache overlap.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pdserve.common.errors import InvalidArgumentError

NUM_BYTE_TOKENS = 256
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
SPECIAL_TOKEN_TO_ID: Mapping[str, int] = {BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID, PAD_TOKEN: PAD_ID}
SPECIAL_ID_TO_TOKEN: Mapping[int, str] = {v: k for k, v in SPECIAL_TOKEN_TO_ID.items()}
VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKEN_TO_ID)

# No special string is a prefix of another, so a plain alternation gives the same leftmost-longest
# split as the Hugging Face added-token matcher.
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKEN_TO_ID) + ")")

# Chat format (ChatML-shaped, with BOS/EOS as the turn delimiters):
#   <|bos|>{role}\n{content}<|eos|>\n   per message, then  <|bos|>assistant\n  to prompt a reply.
# The Jinja version below renders the identical string for Hugging Face ``apply_chat_template``.
_CHAT_TEMPLATE_JINJA = (
    "{% for message in messages %}"
    "{{ '" + BOS_TOKEN + "' + message['role'] + '\\n' + message['content'] + '" + EOS_TOKEN
    + "' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + BOS_TOKEN + "assistant\\n' }}{% endif %}"
)

_HASH_DIGEST_BYTES = 8
_HASH_ROOT = bytes(_HASH_DIGEST_BYTES)


class TextStream(Protocol):
    """Text of a growing token sequence, released in whole characters (never half of one)."""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text they complete (empty while a character is incomplete)."""
        ...

    def finish(self) -> str:
        """The sequence ended: everything not yet released (an incomplete character as U+FFFD)."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """What services need from a tokenizer: ids in, ids out, counts, chat prompts, streaming."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` adds what the tokenizer's own
        post-processor adds around a raw prompt (a model's BOS; nothing for ``ByteTokenizer``);
        without it nothing is added that the text does not contain (a rendered chat prompt
        carries its own BOS)."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; invalid or partial UTF-8 becomes U+FFFD."""
        ...

    def count(self, text: str) -> int:
        """``len(encode(text))``, possibly without building the list."""
        ...

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """OpenAI-style chat messages as one prompt string, in this model's chat format.
        Raises ``InvalidArgumentError`` naming the field (``messages[i].role``, ``messages``)."""
        ...

    def decode_stream(self, *, skip_special_tokens: bool = True) -> TextStream:
        """A fresh incremental decoder: the text of tokens as they are generated."""
        ...


class ByteTokenizer:
    """The self-contained byte-level tokenizer (see the module docstring for the id table)."""

    vocab_size: int = VOCAB_SIZE
    bos_token_id: int | None = BOS_ID
    eos_token_id: int | None = EOS_ID
    pad_token_id: int | None = PAD_ID

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes, special strings as their ids; ``add_special_tokens`` adds nothing (this
        tokenizer has no post-processor: a prompt starts where its text starts)."""
        if "<|" not in text:  # fast path: no special token can occur
            return list(text.encode("utf-8"))
        token_ids: list[int] = []
        for piece in _SPECIAL_SPLIT.split(text):
            special_id = SPECIAL_TOKEN_TO_ID.get(piece)
            if special_id is not None:
                token_ids.append(special_id)
            elif piece:
                token_ids.extend(piece.encode("utf-8"))
        return token_ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """All bytes are joined, then decoded once with ``errors="replace"``.

        Specials are dropped when ``skip_special_tokens`` (what a server streams to a client),
        else rendered as their (ASCII) strings in place. Same result as the exported Hugging Face
        tokenizer's ``decode``. Raises ``InvalidArgumentError`` for an id outside the vocabulary.
        """
        return _token_bytes(token_ids, skip_special_tokens).decode("utf-8", errors="replace")

    def count(self, text: str) -> int:
        if "<|" not in text:
            return len(text.encode("utf-8"))
        return len(self.encode(text))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        return render_chat_prompt(messages, add_generation_prompt=add_generation_prompt)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> TextStream:
        return _ByteTextStream(skip_special_tokens)


class _ByteTextStream:
    """Byte tokens through an incremental UTF-8 decoder: a character is released when its last
    byte arrives, an invalid byte at once as U+FFFD (the same text as ``decode`` of the whole)."""

    def __init__(self, skip_special_tokens: bool) -> None:
        self._is_skipping_specials = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        return str(self._decoder.decode(_token_bytes(token_ids, self._is_skipping_specials)))

    def finish(self) -> str:
        return str(self._decoder.decode(b"", final=True))


def _token_bytes(token_ids: Sequence[int], skip_special_tokens: bool) -> bytes:
    """The bytes of byte-tokenizer ids, specials as their strings unless skipped. Raises
    ``InvalidArgumentError`` for an id outside the vocabulary."""
    data = bytearray()
    for token_id in token_ids:
        if 0 <= token_id < NUM_BYTE_TOKENS:
            data.append(token_id)
            continue
        special = SPECIAL_ID_TO_TOKEN.get(token_id)
        if special is None:
            raise InvalidArgumentError(
                f"token id {token_id} is outside the vocabulary [0, {VOCAB_SIZE})",
                field="token_ids",
            )
        if not skip_special_tokens:
            data += special.encode("ascii")
    return bytes(data)


DEFAULT_TOKENIZER = ByteTokenizer()


def encode(text: str) -> list[int]:
    """Token ids of ``text`` with the package tokenizer (UTF-8 bytes; special strings -> ids)."""
    return DEFAULT_TOKENIZER.encode(text)


def decode(token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of ``token_ids`` with the package tokenizer (partial UTF-8 -> U+FFFD)."""
    return DEFAULT_TOKENIZER.decode(token_ids, skip_special_tokens=skip_special_tokens)


def count(text: str) -> int:
    """Number of tokens of ``text`` with the package tokenizer."""
    return DEFAULT_TOKENIZER.count(text)


def render_chat_prompt(
    messages: Iterable[Mapping[str, Any]], *, add_generation_prompt: bool = True
) -> str:
    """Render OpenAI-style chat messages into one prompt string.

    Each message is ``{"role": str, "content": str | list[{"type": "text", "text": str}] | None}``;
    text parts are concatenated, ``None`` content (an assistant turn with tool calls) is empty,
    other part types are rejected. Output: ``<|bos|>{role}\\n{content}<|eos|>\\n`` per message and,
    if ``add_generation_prompt``, a trailing ``<|bos|>assistant\\n``. The exported Hugging Face
    ``chat_template`` renders the same string for string contents.

    Raises ``InvalidArgumentError`` (field ``messages[i].role`` / ``.content``) on malformed input.
    """
    parts: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgumentError(
                "a chat message must be an object", field=f"messages[{index}]"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role or "\n" in role or "<|" in role:
            raise InvalidArgumentError(
                "role must be a non-empty single-line string", field=f"messages[{index}].role"
            )
        content = content_text(message.get("content"), field=f"messages[{index}].content")
        parts.append(f"{BOS_TOKEN}{role}\n{content}{EOS_TOKEN}\n")
    if add_generation_prompt:
        parts.append(f"{BOS_TOKEN}assistant\n")
    return "".join(parts)


def content_text(content: Any, *, field: str, separator: str = "") -> str:
    """A message's ``content`` as one string: a string as it is, text parts joined with
    ``separator``, ``None`` (an assistant turn with tool calls) empty. Raises
    ``InvalidArgumentError`` (``field``) for anything else, other part types included."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidArgumentError("only text content parts are supported", field=field)
            texts.append(part["text"])
        return separator.join(texts)
    raise InvalidArgumentError("content must be a string or a list of text parts", field=field)


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``token_ids``; a partial last block is ignored.

    ``hash[i] = blake2b-64(hash[i-1] (8 bytes, little-endian) || block i as little-endian uint32)``
    with ``hash[-1]`` = 8 zero bytes, returned as unsigned ints in ``[0, 2**64)``. So hash i
    identifies the whole prefix up to the end of block i: two sequences share leading hashes
    exactly as far as they share full blocks. Stable across processes, machines and Python
    versions (no salted ``hash()``). Token ids must be in ``[0, 2**32)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    if num_full_blocks == 0:
        return []
    data = np.asarray(token_ids[: num_full_blocks * block_size], dtype=np.int64)
    if data.size and (int(data.min()) < 0 or int(data.max()) >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    raw = data.astype("<u4").tobytes()
    block_nbytes = 4 * block_size
    hashes: list[int] = []
    parent = _HASH_ROOT
    for start in range(0, len(raw), block_nbytes):
        parent = hashlib.blake2b(
            parent + raw[start : start + block_nbytes], digest_size=_HASH_DIGEST_BYTES
        ).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


def chained_block_hash(parent_hash: int | None, block_token_ids: Sequence[int]) -> int:
    """The ``prefix_block_hashes`` hash of one block after a block hashed ``parent_hash`` (None:
    the sequence's first block): what an engine's "block stored" event maps to, so that routers,
    simulator and engines agree on every prefix."""
    parent = _HASH_ROOT if parent_hash is None else parent_hash.to_bytes(_HASH_DIGEST_BYTES,
                                                                         "little")
    data = np.asarray(block_token_ids, dtype=np.int64)
    if data.size and (int(data.min()) < 0 or int(data.max()) >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    digest = hashlib.blake2b(parent + data.astype("<u4").tobytes(),
                             digest_size=_HASH_DIGEST_BYTES).digest()
    return int.from_bytes(digest, "little")


def _byte_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable character map of the Hugging Face ``ByteLevel`` model.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the
    other 68 bytes take code points 256, 257, ... in byte order. ``tokenizers`` applies this map
    before the model lookup, so the exported vocabulary must be keyed by these characters.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    next_code_point = NUM_BYTE_TOKENS
    for b in range(NUM_BYTE_TOKENS):
        if b not in mapping:
            mapping[b] = chr(next_code_point)
            next_code_point += 1
    return mapping


def hf_tokenizer_json() -> dict[str, Any]:
    """The ``tokenizer.json`` document of ``ByteTokenizer`` (BPE without merges over ByteLevel).

    No regex pre-split and no post-processor, so ids equal ``encode`` exactly (nothing is added).
    """
    byte_chars = _byte_to_unicode()
    vocab = {byte_chars[b]: b for b in range(NUM_BYTE_TOKENS)}
    vocab.update(SPECIAL_TOKEN_TO_ID)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_id, "content": token, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for token, token_id in sorted(SPECIAL_TOKEN_TO_ID.items(), key=lambda kv: kv[1])
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def export(directory: str | Path, *, model_max_length: int | None = None) -> Path:
    """Write a Hugging Face tokenizer folder for ``ByteTokenizer`` into ``directory``.

    Files: ``tokenizer.json`` (see ``hf_tokenizer_json``), ``tokenizer_config.json`` (fast
    tokenizer class, BOS/EOS/PAD, chat template, no space clean-up so decode is byte-exact) and
    ``special_tokens_map.json``. ``model_max_length`` (tokens) is written when given. Creates the
    directory if needed and returns it.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE_JINJA,
        "added_tokens_decoder": {
            str(token_id): {"content": token, "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}
            for token, token_id in SPECIAL_TOKEN_TO_ID.items()
        },
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    _write_json(path / "tokenizer.json", hf_tokenizer_json())
    _write_json(path / "tokenizer_config.json", config)
    _write_json(path / "special_tokens_map.json", special_map)
    return path


def _write_json(path: Path, document: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(document, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
