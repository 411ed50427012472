"""The router's OpenAI-compatible HTTP front end (aiohttp): an adapter only, no policy.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``GET /health``. Standard clients (the OpenAI SDK, aiperf,
guidellm) work unmodified: same request fields, same response and SSE chunk shapes, same error
body ``{"error": {"message", "type", "param", "code"}}``.

The adapter tokenizes (the backend takes token ids), validates every field it reads (a 400 names
the field in ``param``), turns the backend's token chunks back into text and maps ``PdserveError``
subclasses to HTTP statuses in one place (``_error_for``). Stop strings are matched here, on the
decoded text, so the text a client gets never contains one: a match ends the request early and
cancels the backend. Errors raised before the first chunk become a plain HTTP error, even for
``stream: true``, because the first chunk is awaited before the SSE response starts; a failure
after that ends the stream with one ``data: {"error": ...}`` event and ``data: [DONE]``.

Extensions: ``ignore_eos`` (as in vLLM; default false), the ``x-pdserve-prefill-mode`` request
header (``auto|remote|local``), ``x-request-id`` (taken from the request or generated, and always
returned). Unknown body fields are ignored; fields whose meaning this server cannot honour (``n``
other than 1, ``logprobs``, ``echo``, ``best_of``, ``suffix``) are rejected rather than ignored.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.common.errors import (
    CapacityError,
    DeadlineError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from pdserve.common.tokenizer import Tokenizer, render_chat_prompt
from pdserve.router.types import (
    FinishReason,
    GenerationBackend,
    GenerationChunk,
    GenerationRequest,
    ModelCard,
    PrefillMode,
    Usage,
)

logger = logging.getLogger(__name__)

ChatTemplate = Callable[[Sequence[Mapping[str, Any]]], str]
"""Renders OpenAI chat messages into one prompt string (raises ``InvalidArgumentError``)."""

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""Largest accepted request body; a 128K-token prompt as JSON token ids is about 1 MB."""
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
_MAX_HELD_TOKENS = 8
"""Tokens held back at most while their text ends in an incomplete UTF-8 sequence."""
_REPLACEMENT_CHAR = "\ufffd"
_FINISH_REASON_TO_OPENAI = {
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "abort",
}
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
# Errors


class ApiError(Exception):
    """An HTTP error with an OpenAI error body; ``headers`` carries e.g. ``Retry-After``."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self, request_id: str | None = None) -> web.Response:
        headers = dict(self.headers)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        return web.json_response(self.body(), status=self.status, headers=headers)


def _retry_after_headers(retry_after_s: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (rounded up), and the OpenAI SDK's ``retry-after-ms``."""
    retry_after_s = max(0.0, retry_after_s)
    return {
        "Retry-After": str(math.ceil(retry_after_s)),
        "retry-after-ms": str(math.ceil(retry_after_s * 1000)),
    }


def _error_for(error: BaseException, request_id: str) -> ApiError:
    """The one mapping from exceptions to HTTP errors. Unknown errors say nothing inside."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, InvalidArgumentError):
        return ApiError(400, error.message, param=error.field)
    if isinstance(error, NotFoundError):
        return ApiError(404, error.message, param=error.field or "model", code="model_not_found")
    if isinstance(error, CapacityError):
        return ApiError(
            429,
            error.message,
            error_type="rate_limit_error",
            param=error.field,
            code="rate_limit_exceeded",
            headers=_retry_after_headers(error.retry_after_s),
        )
    if isinstance(error, UnavailableError):
        retry_after_s = float(getattr(error, "retry_after_s", 1.0))
        return ApiError(
            503,
            error.message,
            error_type="service_unavailable_error",
            param=error.field,
            code="service_unavailable",
            headers=_retry_after_headers(retry_after_s),
        )
    if isinstance(error, UnauthenticatedError):
        return ApiError(401, error.message, "authentication_error", code="invalid_api_key")
    if isinstance(error, PermissionDeniedError):
        return ApiError(403, error.message, "permission_error", code="permission_denied")
    if isinstance(error, DeadlineError):
        return ApiError(504, error.message, "timeout_error", code="timeout")
    logger.error("request %s failed", request_id, exc_info=error)
    return ApiError(500, "internal error", "server_error", code="internal_error")


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
        return tokenizer.encode(prompt)
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


@dataclass(frozen=True, slots=True)
class _RequestContext:
    """What comes from headers and auth rather than the body."""

    request_id: str
    tenant: str
    prefill_mode: PrefillMode


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


def _resolve_model(body: Mapping[str, Any], models: Sequence[ModelCard]) -> ModelCard:
    """The card named by ``model``; with one model served, a missing ``model`` means that one."""
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
    models: Sequence[ModelCard],
    tokenizer: Tokenizer,
    chat_template: ChatTemplate,
    context: _RequestContext,
) -> ParsedRequest:
    """Validate a completions or chat body into a ``ParsedRequest``.

    Raises ``InvalidArgumentError`` (``field`` = the offending field) or ``NotFoundError`` (unknown
    model). For chat without ``max_tokens``/``max_completion_tokens`` the completion may use the
    rest of the model's context (``max_context_tokens``; 16 tokens when the card gives none).
    """
    _reject_unsupported(body)
    card = _resolve_model(body, models)
    if is_chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgumentError("'messages' must be a non-empty list", field="messages")
        prompt_ids = tokenizer.encode(chat_template(messages))
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


# ---------------------------------------------------------------------------------------------
# From token chunks to text


class IncrementalText:
    """Turns a growing token sequence into released text: whole characters, no stop string.

    Text is decoded over a small window of already-decoded tokens (the previous chunk) so that
    tokenizers whose pieces decode differently at the start of a sequence still give the right
    text. Tokens whose text ends in an incomplete UTF-8 sequence (U+FFFD) wait for the next
    tokens, up to ``_MAX_HELD_TOKENS``. A tail that could begin a stop string is held back too;
    once a stop string appears, the text before it is released and ``is_stopped`` is set.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window: an earlier clean boundary
        self._read_offset = 0  # tokens before this are part of ``_text``
        self._unreleased_text = ""  # decoded, not yet released: may begin a stop string
        self.is_stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that became final (possibly empty)."""
        if self.is_stopped:
            return ""
        self._token_ids.extend(token_ids)
        self._unreleased_text += self._decode_new(is_final=False)
        return self._release(is_final=False)

    def finish(self) -> str:
        """The generation ended: release everything left, incomplete characters included."""
        if self.is_stopped:
            return ""
        self._unreleased_text += self._decode_new(is_final=True)
        return self._release(is_final=True)

    def _decode_new(self, *, is_final: bool) -> str:
        ids = self._token_ids
        if len(ids) == self._read_offset:
            return ""
        decode = self._tokenizer.decode
        end, full = self._clean_end(is_final=is_final)
        if end == self._read_offset:
            return ""
        context = decode(ids[self._prefix_offset : self._read_offset])
        if full.startswith(context):
            new_text = full[len(context) :]
        else:
            new_text = decode(ids[self._read_offset : end])
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return new_text

    def _clean_end(self, *, is_final: bool) -> tuple[int, str]:
        """The largest token count whose text does not end in an incomplete character, and
        that text (decoded from ``_prefix_offset``); ``_read_offset`` if none within reach.

        A chunk may end inside a character and the next one too, so backing off a few tokens
        (not holding the whole chunk) is what keeps text flowing. After ``_MAX_HELD_TOKENS``
        pending tokens, or at the end, the text is taken as it is (U+FFFD included).
        """
        ids = self._token_ids
        decode = self._tokenizer.decode
        full = decode(ids[self._prefix_offset :])
        if is_final or not full.endswith(_REPLACEMENT_CHAR):
            return len(ids), full
        lowest_end = max(self._read_offset + 1, len(ids) - _MAX_HELD_TOKENS)
        for end in range(len(ids) - 1, lowest_end - 1, -1):
            text = decode(ids[self._prefix_offset : end])
            if not text.endswith(_REPLACEMENT_CHAR):
                return end, text
        if len(ids) - self._read_offset >= _MAX_HELD_TOKENS:
            return len(ids), full
        return self._read_offset, ""

    def _release(self, *, is_final: bool) -> str:
        """Release the unreleased text up to a stop string, or up to a tail that may begin one.

        No stop string can begin in text released earlier: that text never ended in a stop
        string's prefix, so searching the unreleased text alone is enough.
        """
        text = self._unreleased_text
        match = self._first_stop()
        if match is not None:
            self.is_stopped = True
            end = match
        elif is_final:
            end = len(text)
        else:
            end = len(text) - self._held_tail_chars()
        self._unreleased_text = "" if self.is_stopped else text[end:]
        return text[:end]

    def _first_stop(self) -> int | None:
        """Where the stop string that completes first begins (the earliest one on a tie).

        "Completes first" (smallest end) is what a character-by-character check would find, so
        the result does not depend on how the text was split into chunks.
        """
        best: tuple[int, int] | None = None
        for stop in self._stop:
            begin = self._unreleased_text.find(stop)
            if begin >= 0 and (best is None or (begin + len(stop), begin) < best):
                best = (begin + len(stop), begin)
        return best[1] if best is not None else None

    def _held_tail_chars(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._unreleased_text
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


@dataclass(frozen=True, slots=True)
class _Step:
    """One piece of output: text released by one backend chunk, and the end when it ends."""

    text: str
    finish_reason: str | None = None


class _GenerationRun:
    """One backend generation seen as text steps; cancels the backend if abandoned early.

    ``start`` awaits the first chunk, so errors the backend raises before it (bad input, no
    capacity, no worker) surface before any response byte is sent. ``close`` must always be
    called; it calls ``backend.cancel`` unless the backend finished on its own.
    """

    def __init__(
        self, backend: GenerationBackend, request: GenerationRequest, tokenizer: Tokenizer
    ) -> None:
        self._backend = backend
        self._request = request
        self._text = IncrementalText(tokenizer, request.stop)
        self._chunks: AsyncIterator[GenerationChunk] | None = None
        self._first: GenerationChunk | None = None
        self._is_backend_done = False
        self.backend_usage: Usage | None = None

    async def start(self) -> None:
        self._chunks = aiter(self._backend.generate(self._request))
        self._first = await self._next_chunk()

    async def _next_chunk(self) -> GenerationChunk | None:
        """The next chunk, or None at the end. A backend that raised has ended: no cancel then.

        ``CancelledError`` (the client went away) is not an end: ``close`` cancels the backend.
        """
        assert self._chunks is not None
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            self._is_backend_done = True
            return None
        except Exception:
            self._is_backend_done = True
            raise

    async def steps(self) -> AsyncIterator[_Step]:
        """Text steps; the last one has ``finish_reason``. Raises what the backend raises."""
        assert self._chunks is not None, "start() first"
        chunk = self._first
        while chunk is not None:
            text = self._text.push(chunk.token_ids)
            if self._text.is_stopped:
                yield _Step(text, "stop")
                return
            if chunk.finish_reason is not None:
                self._is_backend_done = True
                self.backend_usage = chunk.usage
                yield self._final_step(text, chunk.finish_reason)
                return
            if text:
                yield _Step(text)
            chunk = await self._next_chunk()
        logger.warning(
            "request %s: backend ended without a finish reason", self._request.request_id
        )
        yield _Step(self._text.finish(), "stop")

    def _final_step(self, text: str, reason: FinishReason) -> _Step:
        if reason == FinishReason.ERROR:
            raise PdserveError("generation failed")
        text += self._text.finish()
        if self._text.is_stopped:
            return _Step(text, "stop")
        return _Step(text, _FINISH_REASON_TO_OPENAI.get(reason, str(reason)))

    def usage(self) -> dict[str, Any]:
        """OpenAI ``usage``: the backend's counts when it sent them, else what was received."""
        usage = self.backend_usage
        num_prompt = len(self._request.prompt_token_ids)
        if usage is not None and usage.prompt_tokens > 0:
            num_prompt = usage.prompt_tokens
        num_completion = self._text.num_tokens
        if usage is not None and not self._text.is_stopped:
            num_completion = usage.completion_tokens
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens if usage else 0},
        }

    async def close(self) -> None:
        if not self._is_backend_done and self._chunks is not None:
            try:
                await self._backend.cancel(self._request.request_id)
            except Exception:
                logger.exception("request %s: backend cancel failed", self._request.request_id)
        self._is_backend_done = True
        aclose = getattr(self._chunks, "aclose", None)
        self._chunks = None
        if aclose is not None:
            try:
                await aclose()
            except Exception:
                logger.exception(
                    "request %s: closing the backend stream failed", self._request.request_id
                )


# ---------------------------------------------------------------------------------------------
# Response bodies


def _choice(
    parsed: ParsedRequest,
    text: str,
    finish_reason: str | None,
    *,
    is_chunk: bool,
    is_first: bool = False,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if not parsed.is_chat:
        choice["text"] = text
    elif is_chunk:
        delta: dict[str, Any] = {"role": "assistant"} if is_first else {}
        if text or is_first:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["message"] = {"role": "assistant", "content": text}
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    return choice


def _envelope(parsed: ParsedRequest, created_s: int, *, is_chunk: bool) -> dict[str, Any]:
    if parsed.is_chat:
        kind = "chat.completion.chunk" if is_chunk else "chat.completion"
    else:
        kind = "text_completion"
    return {
        "id": parsed.generation.request_id,
        "object": kind,
        "created": created_s,
        "model": parsed.generation.model,
    }


def _sse(payload: Mapping[str, Any]) -> bytes:
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


_SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# The application


class _OpenAiHandlers:
    """The route handlers; every /v1 handler authenticates first and answers errors in-shape."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        api_keys: Mapping[str, str] | None,
        max_body_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        # Kept as given, not copied: a live mapping (``pdserve.common.auth.KeyFile``) follows
        # edits to its file without a restart.
        self._api_keys = api_keys
        self._max_body_bytes = max_body_bytes
        self._clock = clock

    # -- auth and headers

    def _tenant(self, request: web.Request) -> str:
        """The caller's tenant; ``""`` when no keys are configured. Raises 401 ``ApiError``."""
        if self._api_keys is None:
            return ""
        scheme, _, key = request.headers.get("Authorization", "").strip().partition(" ")
        key = key.strip()
        tenant: str | None = None
        if scheme.lower() == "bearer" and key:
            # Compare against every key so the time taken does not depend on which one matched.
            for known_key, known_tenant in self._api_keys.items():
                if hmac.compare_digest(known_key.encode(), key.encode()):
                    tenant = known_tenant
        if tenant is None:
            message = (
                "Incorrect API key provided"
                if key
                else "Missing API key: send 'Authorization: Bearer <key>'"
            )
            raise ApiError(
                401,
                message,
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant

    def _context(self, request: web.Request, request_id: str) -> _RequestContext:
        mode_text = request.headers.get(PREFILL_MODE_HEADER, PrefillMode.AUTO.value).strip().lower()
        try:
            mode = PrefillMode(mode_text)
        except ValueError:
            raise ApiError(
                400,
                f"{PREFILL_MODE_HEADER} must be one of auto, remote, local",
                param=PREFILL_MODE_HEADER,
            ) from None
        return _RequestContext(request_id, self._tenant(request), mode)

    @staticmethod
    def _request_id(request: web.Request, prefix: str) -> str:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not 0 < len(given) <= MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in given):
            raise ApiError(
                400,
                f"{REQUEST_ID_HEADER} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                "characters without spaces",
                param=REQUEST_ID_HEADER,
            )
        return given

    async def _read_json(self, request: web.Request) -> Mapping[str, Any]:
        """The body as a JSON object. Raises ``ApiError`` 413 (too large) or 400 (not an object)."""
        max_bytes = self._max_body_bytes
        if request.content_length is not None and request.content_length > max_bytes:
            raise _too_large(max_bytes)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(max_bytes) from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ApiError(400, f"The request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object")
        return body

    # -- endpoints

    async def health(self, request: web.Request) -> web.Response:
        try:
            num_models = len(self._backend.list_models())
        except Exception:
            logger.exception("health: listing models failed")
            num_models = 0
        status = 200 if num_models > 0 else 503
        return web.json_response(
            {"status": "ok" if num_models else "unavailable", "num_models": num_models},
            status=status,
        )

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            self._tenant(request)
            cards = self._backend.list_models()
        except Exception as error:  # mapped to an HTTP error in one place
            return _error_for(error, "").to_response()
        return web.json_response({"object": "list", "data": [self._model(c) for c in cards]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        try:
            self._tenant(request)
            cards = [c for c in self._backend.list_models() if c.name == name]
            if not cards:
                raise NotFoundError(f"The model '{name}' does not exist", field="model")
        except Exception as error:
            return _error_for(error, "").to_response()
        return web.json_response(self._model(cards[0]))

    @staticmethod
    def _model(card: ModelCard) -> dict[str, Any]:
        return {
            "id": card.name,
            "object": "model",
            "created": card.created_unix_s,
            "owned_by": "pdserve",
            "max_model_len": card.max_context_tokens,
        }

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=True)

    async def _generate(self, request: web.Request, *, is_chat: bool) -> web.StreamResponse:
        request_id = ""
        try:
            request_id = self._request_id(request, "chatcmpl" if is_chat else "cmpl")
            context = self._context(request, request_id)
            body = await self._read_json(request)
            parsed = parse_request(
                body,
                is_chat=is_chat,
                models=self._backend.list_models(),
                tokenizer=self._tokenizer,
                chat_template=self._chat_template,
                context=context,
            )
        except Exception as error:
            return _error_for(error, request_id).to_response(request_id)
        run = _GenerationRun(self._backend, parsed.generation, self._tokenizer)
        try:
            await run.start()
            if parsed.is_stream:
                return await self._stream(request, parsed, run)
            return await self._complete(parsed, run)
        except Exception as error:
            return _error_for(error, request_id).to_response(request_id)
        finally:
            await run.close()

    async def _complete(self, parsed: ParsedRequest, run: _GenerationRun) -> web.Response:
        texts: list[str] = []
        finish_reason: str | None = None
        async with aclosing(run.steps()) as steps:
            async for step in steps:
                texts.append(step.text)
                finish_reason = step.finish_reason
        body = _envelope(parsed, int(self._clock()), is_chunk=False)
        body["choices"] = [_choice(parsed, "".join(texts), finish_reason, is_chunk=False)]
        body["usage"] = run.usage()
        return web.json_response(
            body,
            headers={REQUEST_ID_HEADER: parsed.generation.request_id},
            dumps=lambda obj: json.dumps(obj, ensure_ascii=False),
        )

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, run: _GenerationRun
    ) -> web.StreamResponse:
        request_id = parsed.generation.request_id
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                REQUEST_ID_HEADER: request_id,
            }
        )
        await response.prepare(request)
        envelope = _envelope(parsed, int(self._clock()), is_chunk=True)
        usage_field = {"usage": None} if parsed.is_usage_streamed else {}
        try:
            is_first = parsed.is_chat
            async with aclosing(run.steps()) as steps:
                async for step in steps:
                    if not (step.text or step.finish_reason or is_first):
                        continue
                    choice = _choice(
                        parsed, step.text, step.finish_reason, is_chunk=True, is_first=is_first
                    )
                    await response.write(_sse({**envelope, "choices": [choice], **usage_field}))
                    is_first = False
            if parsed.is_usage_streamed:
                await response.write(_sse({**envelope, "choices": [], "usage": run.usage()}))
        except ConnectionResetError:
            logger.info("request %s: client went away during the stream", request_id)
            return response
        except Exception as error:  # the status line is sent: report in-band
            api_error = _error_for(error, request_id)
            try:
                await response.write(_sse(api_error.body()))
            except ConnectionResetError:
                return response
        try:
            await response.write(_SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:
            logger.info("request %s: client went away at the end of the stream", request_id)
        return response


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413, f"The request body is larger than {max_bytes} bytes", code="request_too_large"
    )


@web.middleware
async def _openai_error_bodies(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (no such route, wrong method) as OpenAI error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        headers = {k: v for k, v in error.headers.items() if k.lower() == "allow"}
        error_type = "invalid_request_error" if error.status < 500 else "server_error"
        message = f"{error.reason}: {request.method} {request.path}"
        return ApiError(error.status, message, error_type, headers=headers).to_response()


def create_app(
    backend: GenerationBackend,
    tokenizer: Tokenizer,
    *,
    api_keys: Mapping[str, str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: ChatTemplate = render_chat_prompt,
    clock: Callable[[], float] = time.time,
) -> web.Application:
    """The OpenAI-compatible application in front of ``backend``.

    ``tokenizer`` must be the served model's (prompt ids, ``usage`` and streamed text come from
    it); ``chat_template`` renders ``messages`` for it. ``api_keys`` maps API key -> tenant: when
    given (even empty), every ``/v1`` call needs ``Authorization: Bearer <key>``; ``/health``
    never does. ``max_body_bytes`` bounds request bodies (413 beyond). ``clock`` gives wall-clock
    seconds for ``created``.
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    handlers = _OpenAiHandlers(backend, tokenizer, chat_template, api_keys, max_body_bytes, clock)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_openai_error_bodies])
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model_id:.+}", handlers.get_model)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    return app


async def start_http_server(
    app: web.Application, host: str, port: int
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (port 0 = any free port); returns the runner and the port.

    Handlers are cancelled when their client disconnects, which cancels the backend request.
    Stop with ``await runner.cleanup()``.
    """
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
    except BaseException:
        await runner.cleanup()
        raise
    return runner, bound_port
