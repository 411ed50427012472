"""One backend generation seen by the OpenAI front end: text steps with OpenAI finish reasons,
the ``usage`` to report, and a cancel of the backend if the client goes away early.

Stop strings are matched here, on the decoded text (``router.detokenizer``), so the text a
client gets never contains one: a match ends the request early and cancels the backend.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import PdserveError
from pdserve.common.tokenizer import Tokenizer
from pdserve.router.detokenizer import IncrementalText
from pdserve.router.types import (
    FinishReason,
    GenerationBackend,
    GenerationChunk,
    GenerationRequest,
    Usage,
)

logger = logging.getLogger(__name__)

_FINISH_REASON_TO_OPENAI: Mapping[FinishReason, str] = {
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "abort",
}


@dataclass(frozen=True, slots=True)
class Step:
    """One piece of output: text released by one backend chunk, and the end when it ends."""

    text: str
    finish_reason: str | None = None


class GenerationRun:
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

    async def steps(self) -> AsyncGenerator[Step, None]:
        """Text steps; the last one has ``finish_reason``. Raises what the backend raises."""
        assert self._chunks is not None, "start() first"
        chunk = self._first
        while chunk is not None:
            text = self._text.push(chunk.token_ids)
            if self._text.is_stopped:
                yield Step(text, "stop")
                return
            if chunk.finish_reason is not None:
                self._is_backend_done = True
                self.backend_usage = chunk.usage
                yield self._final_step(text, chunk.finish_reason)
                return
            if text:
                yield Step(text)
            chunk = await self._next_chunk()
        logger.warning(
            "request %s: backend ended without a finish reason", self._request.request_id
        )
        yield Step(self._text.finish(), "stop")

    def _final_step(self, text: str, reason: FinishReason) -> Step:
        if reason == FinishReason.ERROR:
            raise PdserveError("generation failed")
        text += self._text.finish()
        if self._text.is_stopped:
            return Step(text, "stop")
        return Step(text, _FINISH_REASON_TO_OPENAI.get(reason, str(reason)))

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
