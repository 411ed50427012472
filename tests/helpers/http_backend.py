"""A fake router backend for the HTTP API's tests, and the API served over a real socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from helpers.tokenizers import OneTokenizer
from pdserve.common.tokenizer import ByteTokenizer
from pdserve.router.http_api import create_app, start_http_server
from pdserve.router.types import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ModelCard,
    Usage,
)

TOKENIZER = ByteTokenizer()
MODEL = "tiny-llama"
REPLY = "Hello, world! Nice to meet you."
NUM_CACHED_PROMPT_TOKENS = 2


class FakeBackend:
    """Replies with the bytes of ``reply`` (up to max_tokens), ``tokens_per_chunk`` per chunk.

    Finishes with LENGTH when it produced max_tokens tokens, else STOP (as if EOS came). Knobs
    make it fail before the first chunk, fail or hang after ``num_chunks_before_event`` chunks,
    or end with a given finish reason.
    """

    def __init__(
        self,
        *,
        reply: str = REPLY,
        tokens_per_chunk: int = 2,
        models: Sequence[ModelCard] = (
            ModelCard(MODEL, max_context_tokens=4096, created_unix_s=7),
        ),
    ) -> None:
        self.reply_ids = TOKENIZER.encode(reply)
        self.tokens_per_chunk = tokens_per_chunk
        self.models = list(models)
        self.requests: list[GenerationRequest] = []
        self.cancelled_ids: list[str] = []
        self.cancel_called = asyncio.Event()
        self.error_before_first: Exception | None = None
        self.error_mid_stream: Exception | None = None
        self.is_hanging_mid_stream = False
        self.hang_started = asyncio.Event()
        self.num_chunks_before_event = 2
        self.final_reason: FinishReason | None = None

    def list_models(self) -> list[ModelCard]:
        return list(self.models)

    async def cancel(self, request_id: str) -> bool:
        self.cancelled_ids.append(request_id)
        self.cancel_called.set()
        return True

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        return self._chunks(request)

    async def _chunks(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self.error_before_first is not None:
            raise self.error_before_first
        output = self.reply_ids[: request.max_tokens]
        step = self.tokens_per_chunk
        pieces = [tuple(output[i : i + step]) for i in range(0, len(output), step)]
        for index, piece in enumerate(pieces):
            if index == self.num_chunks_before_event:
                if self.error_mid_stream is not None:
                    raise self.error_mid_stream
                if self.is_hanging_mid_stream:
                    self.hang_started.set()
                    await asyncio.Event().wait()
            if index < len(pieces) - 1:
                yield GenerationChunk(token_ids=piece)
                continue
            reason = self.final_reason or (
                FinishReason.LENGTH if len(output) == request.max_tokens else FinishReason.STOP
            )
            usage = Usage(len(request.prompt_token_ids), len(output), NUM_CACHED_PROMPT_TOKENS)
            yield GenerationChunk(token_ids=piece, finish_reason=reason, usage=usage)


@asynccontextmanager
async def serve(
    backend: FakeBackend, **options: Any
) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    app = create_app(backend, OneTokenizer(TOKENIZER), clock=lambda: 1_700_000_000.5,
                     **options)
    runner, port = await start_http_server(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            yield session, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
