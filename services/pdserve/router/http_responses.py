"""Response bodies of the OpenAI front end, in the shapes standard clients parse (the OpenAI
SDK, aiperf, guidellm), and their framing as server-sent events: one ``data: <json>`` event per
chunk, ``data: [DONE]`` at the end."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pdserve.router.http_requests import ParsedRequest
from pdserve.router.types import ModelCard

SSE_DONE = b"data: [DONE]\n\n"


def model_object(card: ModelCard) -> dict[str, Any]:
    """A ``/v1/models`` entry."""
    return {
        "id": card.name,
        "object": "model",
        "created": card.created_unix_s,
        "owned_by": "pdserve",
        "max_model_len": card.max_context_tokens,
    }



def choice_object(
    parsed: ParsedRequest,
    text: str,
    finish_reason: str | None,
    *,
    is_chunk: bool,
    is_first: bool = False,
) -> dict[str, Any]:
    """The one choice of a response (``is_chunk``: of a streamed chunk, whose first one names
    the assistant role in a chat)."""
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


def envelope(parsed: ParsedRequest, created_s: int, *, is_chunk: bool) -> dict[str, Any]:
    """The fields around the choices: id, object kind, creation time (Unix s), model."""
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


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """``payload`` as one server-sent event (compact JSON, UTF-8 as is)."""
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )
