"""The HTTP API joins the caller's trace: a W3C ``traceparent`` header makes the router's work a
child of the caller's span (what the router's own spans then hang from); without one, no trace is
imposed on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from helpers.http_backend import MODEL, FakeBackend, serve
from opentelemetry import trace

from pdserve.router.types import GenerationChunk, GenerationRequest

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_SPAN_ID:016x}-01"


class TraceRecordingBackend(FakeBackend):
    """Records the span context current when the router is asked to generate."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[trace.SpanContext] = []

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.contexts.append(trace.get_current_span().get_span_context())
        return super().generate(request)


async def _complete(headers: dict[str, str]) -> trace.SpanContext:
    backend = TraceRecordingBackend()
    async with serve(backend) as (session, url):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as reply:
            assert reply.status == 200, await reply.text()
            await reply.json()
    assert len(backend.contexts) == 1
    return backend.contexts[0]


async def test_a_traceparent_header_makes_the_request_part_of_the_callers_trace() -> None:
    context = await _complete({"traceparent": TRACEPARENT})
    assert context.trace_id == TRACE_ID
    assert context.span_id == PARENT_SPAN_ID
    assert context.is_remote and context.trace_flags.sampled


async def test_without_the_header_no_trace_is_imposed() -> None:
    context = await _complete({})
    assert not context.is_valid


async def test_a_malformed_traceparent_is_ignored_not_an_error() -> None:
    context = await _complete({"traceparent": "00-not-a-trace-01"})
    assert not context.is_valid
