"""The router's ``generate`` span is current only while the generator runs its own code: closing
the generator from another context (an HTTP handler's cancellation, the event loop's
async-generator finalizer) must not fail to detach a context token, and the attempts still run
as children of the request's span."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.api.v1 import common_pb2 as pb
from pdserve.common.types import WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.router import core
from pdserve.router.core import Router, RouterConfig
from pdserve.router.pool_view import PoolView
from pdserve.router.types import FinishReason, GenerationChunk, GenerationRequest


class _StreamingRouter(Router):
    """A router whose attempts stream fixed chunks, recording the span current for each."""

    def __init__(self, view: PoolView) -> None:
        super().__init__(RouterConfig(), view, tickets=None, workers=None)  # type: ignore[arg-type]
        self.current_spans: list[trace.Span] = []
        self.closed = asyncio.Event()

    async def _attempts(self, request: GenerationRequest, request_id: str,
                        progress: object) -> AsyncGenerator[GenerationChunk, None]:
        try:
            for index in range(3):
                self.current_spans.append(trace.get_current_span())
                finish = FinishReason.LENGTH if index == 2 else None
                yield GenerationChunk(token_ids=(index,), finish_reason=finish)
        finally:
            self.current_spans.append(trace.get_current_span())
            self.closed.set()


def _view() -> PoolView:
    info = pb.WorkerInfo(worker_id="d0", model="m", gpu="h100-sxm-80gb", tp_size=1,
                         kv_layout=pb.KvLayout(block_size_tokens=16, num_blocks=64))
    view = PoolView()
    view.replace("m", [WorkerRecord(
        worker_id="d0", deployment="m", role=WorkerRole.DECODE, state=WorkerState.READY,
        address="d0:1", last_heartbeat_s=1.0, spec=info.SerializeToString(),
        load=WorkerLoad(num_free_blocks=64, num_total_blocks=64))])
    return view


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(core, "tracer", provider.get_tracer("test"))
    return spans


REQUEST = GenerationRequest(request_id="r1", model="m", prompt_token_ids=(1, 2, 3), max_tokens=3)


async def test_closing_the_stream_from_another_task_detaches_cleanly(
    exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    router = _StreamingRouter(_view())
    stream = router.generate(REQUEST)
    first = await asyncio.create_task(anext(stream))  # type: ignore[arg-type]
    assert first.token_ids == (0,)
    with caplog.at_level(logging.ERROR):
        await asyncio.create_task(stream.aclose())  # another task: another context
    assert "Failed to detach context" not in caplog.text
    assert router.closed.is_set()  # the attempts were closed with the request, not later
    (span,) = exporter.get_finished_spans()
    assert span.name == "router.generate"
    assert span.attributes is not None and span.attributes["pdserve.request_id"] == "r1"
    # Every step of the attempts, its clean-up included, ran under the request's span.
    assert [s.get_span_context().span_id for s in router.current_spans] == [
        span.context.span_id] * 2
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing left attached here


async def test_a_finished_stream_ends_its_span_with_the_parent_kept(
    exporter: InMemorySpanExporter,
) -> None:
    router = _StreamingRouter(_view())
    parent_provider = TracerProvider()
    with parent_provider.get_tracer("caller").start_as_current_span("caller") as parent:
        chunks = [chunk async for chunk in router.generate(REQUEST)]
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    (span,) = exporter.get_finished_spans()
    assert span.parent is not None
    assert span.parent.span_id == parent.get_span_context().span_id
    assert len(router.current_spans) == 4
    assert {s.get_span_context().span_id for s in router.current_spans} == {span.context.span_id}
