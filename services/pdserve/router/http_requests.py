"""Requests of the OpenAI front end, validated: the body's fields and the headers that steer a
request (``x-request-id``, ``x-pdserve-prefill-mode``) into a ``GenerationRequest``.

Every reader raises ``InvalidArgumentError`` naming the offending field (``param`` in the error
body) or ``NotFoundError`` for an unknown model. Unknown body fields are ignored; fields whose
meaning this server cannot honour (``n`` other than 1, ``logprobs``, ``echo``, ``best_of``,
``suffix``) are rejected rather than ignored.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import InvalidArgumentError, NotFoundError
from pdserve.common.tokenizer import Tokenizer
from pdserve.router.types import GenerationRequest, ModelCard, PrefillMode

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""
REQUEST_ID_HEADER = "x-request-id"
PREFILL_MODE_HEADER = "x-pdserve-prefill-mode"
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_SEQUENCES = 16
MAX_TOKENS_LIMIT = 2**32 - 1
"""``max_tokens`` travels as uint32 in the v1 protos."""
MAX_SEED = 2**64 - 1
"""Seeds travel as uint64 in the v1 protos."""
_UNSUPPORTED_FIELD_DEFAULTS: Mapping[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
}
"""Fields accepted only with these values: other values change the response's shape."""


# ---------------------------------------------------------------------------------------------
# Headers


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What comes from headers and auth rather than the body."""

    request_id: str
    tenant: str
    prefill_mode: PrefillMode


def request_id_of(headers: Mapping[str, str], prefix: str) -> str:
    """``x-request-id`` when the client sent one (1-128 printable ASCII characters, no spaces),
    else a new ``<prefix>-<hex>``."""
    given = headers.get(REQUEST_ID_HEADER)
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not 0 < len(given) <= MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in given):
        raise InvalidArgumentError(
            f"{REQUEST_ID_HEADER} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
            "characters without spaces",
            field=REQUEST_ID_HEADER,
        )
    return given


def prefill_mode_of(headers: Mapping[str, str]) -> PrefillMode:
    """``x-pdserve-prefill-mode`` (``auto|remote|local``, any case); ``auto`` when absent."""
    mode_text = headers.get(PREFILL_MODE_HEADER, PrefillMode.AUTO.value).strip().lower()
    try:
        return PrefillMode(mode_text)
    except ValueError:
        raise InvalidArgumentError(
            f"{PREFILL_MODE_HEADER} must be one of auto, remote, local",
            field=PREFILL_MODE_HEADER,
        ) from None


# ---------------------------------------------------------------------------------------------
# Field readers: each raises InvalidArgumentError naming the field. JSON null means "not given".


def _bool_field(body: Mapping[str, Any], name: str, default: bool, *, param: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"'{param or name}' must be a boolean", field=param or name)
    return value


def _int_field(
    body: Mapping[str, Any], name: str, default: int, *, minimum: int, maximum: int
) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"'{name}' must be an integer", field=name)
    if not minimum <= value <= maximum:
        raise InvalidArgumentError(
            f"'{name}' must be in [{minimum}, {maximum}], got {value}", field=name
        )
    return value


def _float_field(
    body: Mapping[str, Any],
    name: str,
    default: float,
    *,
    minimum: float,
    maximum: float,
    is_minimum_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(f"'{name}' must be a number", field=name)
    number = float(value)
    is_below = number <= minimum if is_minimum_open else number < minimum
    if not math.isfinite(number) or is_below or number > maximum:
        low = "(" if is_minimum_open else "["
        raise InvalidArgumentError(
            f"'{name}' must be in {low}{minimum}, {maximum}], got {value}", field=name
        )
    return number


def _stop_field(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOP_SEQUENCES
    ):
        raise InvalidArgumentError(
            f"'stop' must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} "
            "non-empty strings",
            field="stop",
        )
    return tuple(dict.fromkeys(stops))


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    for name, allowed in _UNSUPPORTED_FIELD_DEFAULTS.items():
        value = body.get(name)
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise InvalidArgumentError(
                f"'{name}'={json.dumps(value)} is not supported by this server", field=name
            )


def _max_tokens_field(
    body: Mapping[str, Any], names: Sequence[str], default: int | None
) -> int | None:
    """The first of ``names`` that is set, validated as an int in [1, MAX_TOKENS_LIMIT]."""
    for name in names:
        if body.get(name) is not None:
            return _int_field(body, name, 0, minimum=1, maximum=MAX_TOKENS_LIMIT)
    return default


def _prompt_token_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """``prompt`` as a string, a list of one string, token ids, or a list of one list of ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("'prompt' must not be empty", field="prompt")
        return tokenizer.encode(prompt, add_special_tokens=True)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        vocab_size = getattr(tokenizer, "vocab_size", None)
        upper = vocab_size if isinstance(vocab_size, int) and vocab_size > 0 else 2**32
        if not all(0 <= t < upper for t in prompt):
            raise InvalidArgumentError(f"prompt token ids must be in [0, {upper})", field="prompt")
        return list(prompt)
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise InvalidArgumentError("only one prompt per request is supported", field="prompt")
    raise InvalidArgumentError(
        "'prompt' must be a non-empty string or a non-empty list of token ids", field="prompt"
    )


# ---------------------------------------------------------------------------------------------
# Parsed requests


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated HTTP request: what to ask the backend and how to answer."""

    generation: GenerationRequest
    is_chat: bool
    is_stream: bool
    is_usage_streamed: bool
    """``stream_options.include_usage``: send a final chunk with ``usage`` and empty choices."""


def _stream_fields(body: Mapping[str, Any]) -> tuple[bool, bool]:
    is_stream = _bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return is_stream, False
    if not isinstance(options, Mapping):
        raise InvalidArgumentError("'stream_options' must be an object", field="stream_options")
    include_usage = _bool_field(
        options, "include_usage", False, param="stream_options.include_usage"
    )
    return is_stream, is_stream and include_usage


def requested_model(body: Mapping[str, Any], models: Sequence[ModelCard]) -> ModelCard:
    """The card named by ``model``; with one model served, a missing ``model`` means that one.

    Checked first (before ``parse_request``, which needs the model's tokenizer), with the fields
    this server cannot honour. Raises ``InvalidArgumentError`` or ``NotFoundError``.
    """
    _reject_unsupported(body)
    name = body.get("model")
    if name is None and len(models) == 1:
        return models[0]
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("'model' must be a non-empty string", field="model")
    for card in models:
        if card.name == name:
            return card
    raise NotFoundError(f"The model '{name}' does not exist", field="model")


def _check_context(
    card: ModelCard,
    num_prompt_tokens: int,
    max_tokens: int,
    prompt_field: str,
    max_tokens_field: str,
) -> None:
    limit = card.max_context_tokens
    if limit <= 0:
        return
    if num_prompt_tokens >= limit:
        raise InvalidArgumentError(
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{num_prompt_tokens} tokens",
            field=prompt_field,
        )
    if num_prompt_tokens + max_tokens > limit:
        raise InvalidArgumentError(
            f"This model's maximum context length is {limit} tokens; you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} in '{max_tokens_field}')",
            field=max_tokens_field,
        )


def parse_request(
    body: Mapping[str, Any],
    *,
    is_chat: bool,
    card: ModelCard,
    tokenizer: Tokenizer,
    context: RequestContext,
) -> ParsedRequest:
    """Validate a completions or chat body for the model of ``card`` (``requested_model``) into
    a ``ParsedRequest``, with that model's tokenizer and chat template.

    Raises ``InvalidArgumentError`` (``field`` = the offending field). For chat without
    ``max_tokens``/``max_completion_tokens`` the completion may use the rest of the model's
    context (``max_context_tokens``; 16 tokens when the card gives none).
    """
    if is_chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgumentError("'messages' must be a non-empty list", field="messages")
        prompt_ids = tokenizer.encode(tokenizer.render_chat(messages))
        prompt_field = "messages"
        max_tokens_names: Sequence[str] = ("max_completion_tokens", "max_tokens")
        default_max_tokens = None
    else:
        if body.get("prompt") is None:
            raise InvalidArgumentError("'prompt' is required", field="prompt")
        prompt_ids = _prompt_token_ids(body["prompt"], tokenizer)
        prompt_field = "prompt"
        max_tokens_names = ("max_tokens",)
        default_max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _max_tokens_field(body, max_tokens_names, default_max_tokens)
    max_tokens_field = next((n for n in max_tokens_names if body.get(n) is not None), "max_tokens")
    if max_tokens is None:
        remaining = card.max_context_tokens - len(prompt_ids)
        max_tokens = remaining if card.max_context_tokens > 0 else DEFAULT_COMPLETION_MAX_TOKENS
        max_tokens = min(max(max_tokens, 1), MAX_TOKENS_LIMIT)
    _check_context(card, len(prompt_ids), max_tokens, prompt_field, max_tokens_field)
    is_stream, is_usage_streamed = _stream_fields(body)
    generation = GenerationRequest(
        request_id=context.request_id,
        model=card.name,
        prompt_token_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        temperature=_float_field(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
        top_p=_float_field(body, "top_p", 1.0, minimum=0.0, maximum=1.0, is_minimum_open=True),
        seed=_int_field(body, "seed", 0, minimum=0, maximum=MAX_SEED),
        ignore_eos=_bool_field(body, "ignore_eos", False),
        stop=_stop_field(body),
        prefill_mode=context.prefill_mode,
        tenant=context.tenant,
    )
    return ParsedRequest(generation, is_chat, is_stream, is_usage_streamed)
