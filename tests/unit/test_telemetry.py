"""Tracing across processes (W3C traceparent over gRPC), the on/off switch, sampling; metrics
names and endpoint; clocks."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from pdserve.common import metrics
from pdserve.common.clock import Clock, ManualClock, MonotonicClock, SystemClock
from pdserve.common.errors import CapacityError
from pdserve.common.grpc_client import open_channel
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings
from pdserve.common.telemetry import (
    add_in_memory_exporter,
    client_interceptors,
    configure_tracing,
    is_tracing_enabled,
    server_interceptors,
)

TRACING_ON = CommonSettings(otel_endpoint="http://127.0.0.1:4317", otel_sampling_ratio=1.0)


def test_tracing_off_installs_no_interceptors() -> None:
    no_endpoint = CommonSettings(otel_endpoint="", otel_sampling_ratio=1.0)
    ratio_zero = CommonSettings(otel_endpoint="http://127.0.0.1:4317", otel_sampling_ratio=0.0)
    for settings in (CommonSettings(), no_endpoint, ratio_zero):
        assert not is_tracing_enabled(settings)
        assert server_interceptors(settings) == []
        assert client_interceptors(settings) == []
    assert is_tracing_enabled(TRACING_ON)
    assert len(server_interceptors(TRACING_ON)) == 1
    assert len(client_interceptors(TRACING_ON)) == 4  # one per call shape


def test_sampler_follows_the_parent_and_samples_roots_by_ratio() -> None:
    provider = configure_tracing("unit-test", "", 0.0, set_global=False)
    tracer = provider.get_tracer(__name__)
    with tracer.start_as_current_span("root") as root:
        assert not root.is_recording()  # ratio 0: a new trace is not sampled
    sampled_parent = trace.SpanContext(
        trace_id=0x1234, span_id=0x5678, is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    context = trace.set_span_in_context(trace.NonRecordingSpan(sampled_parent))
    with tracer.start_as_current_span("child", context=context) as child:
        assert child.is_recording()  # the caller sampled it, so this hop records too
    always = configure_tracing("unit-test", "", 1.0, set_global=False).get_tracer(__name__)
    with always.start_as_current_span("root") as root:
        assert root.is_recording()


SERVICE = "pdserve.test.TraceService"


def _span(spans: list[ReadableSpan], method: str, kind: SpanKind) -> ReadableSpan:
    (found,) = [s for s in spans if s.name == f"/{SERVICE}/{method}" and s.kind == kind]
    return found


async def test_server_span_is_child_of_client_span_across_two_hops() -> None:
    """Client -> Front (server A) -> Leaf (server B), traced through one in-memory provider."""
    provider = configure_tracing("unit-test", "", 1.0, set_global=False)
    exporter = add_in_memory_exporter(provider)
    traceparents: list[str] = []

    async def leaf(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        metadata = dict(context.invocation_metadata() or ())
        traceparents.append(str(metadata.get("traceparent", "")))
        return request + b"-leaf"

    leaf_server = GrpcServer.from_settings(TRACING_ON, tracer_provider=provider)
    leaf_server.add_generic_handler(grpc.method_handlers_generic_handler(
        SERVICE, {"Leaf": grpc.unary_unary_rpc_method_handler(leaf)}
    ))
    await leaf_server.start()
    to_leaf = open_channel(leaf_server.address, TRACING_ON, tracer_provider=provider)

    async def front(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await to_leaf.unary_unary(f"/{SERVICE}/Leaf")(request + b"-front", timeout=5)

    front_server = GrpcServer.from_settings(TRACING_ON, tracer_provider=provider)
    front_server.add_generic_handler(grpc.method_handlers_generic_handler(
        SERVICE, {"Front": grpc.unary_unary_rpc_method_handler(front)}
    ))
    await front_server.start()
    to_front = open_channel(front_server.address, TRACING_ON, tracer_provider=provider)
    try:
        reply = await to_front.unary_unary(f"/{SERVICE}/Front")(b"req", timeout=5)
    finally:
        await to_front.close()
        await to_leaf.close()
        await front_server.stop(0)
        await leaf_server.stop(0)
    assert reply == b"req-front-leaf"

    spans = list(exporter.get_finished_spans())
    front_client = _span(spans, "Front", SpanKind.CLIENT)
    front_server_span = _span(spans, "Front", SpanKind.SERVER)
    leaf_client = _span(spans, "Leaf", SpanKind.CLIENT)
    leaf_server_span = _span(spans, "Leaf", SpanKind.SERVER)

    assert front_server_span.parent is not None and front_server_span.parent.is_remote
    assert front_server_span.parent.span_id == front_client.context.span_id
    assert leaf_client.parent is not None
    assert leaf_client.parent.span_id == front_server_span.context.span_id
    assert leaf_server_span.parent is not None
    assert leaf_server_span.parent.span_id == leaf_client.context.span_id
    hops = (front_client, front_server_span, leaf_client, leaf_server_span)
    assert {s.context.trace_id for s in hops} == {front_client.context.trace_id}

    (header,) = traceparents  # W3C: version-traceid-spanid-flags
    version, trace_hex, span_hex, _flags = header.split("-")
    assert version == "00"
    assert int(trace_hex, 16) == front_client.context.trace_id
    assert int(span_hex, 16) == leaf_client.context.span_id


async def test_mapped_error_status_is_recorded_on_the_server_span() -> None:
    provider = configure_tracing("unit-test", "", 1.0, set_global=False)
    exporter = add_in_memory_exporter(provider)

    async def busy(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise CapacityError("no free KV blocks", retry_after_s=1.0)

    server = GrpcServer.from_settings(TRACING_ON, tracer_provider=provider)
    server.add_generic_handler(grpc.method_handlers_generic_handler(
        SERVICE, {"Busy": grpc.unary_unary_rpc_method_handler(busy)}
    ))
    await server.start()
    channel = open_channel(server.address, TRACING_ON, tracer_provider=provider)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary(f"/{SERVICE}/Busy")(b"", timeout=5)
    finally:
        await channel.close()
        await server.stop(0)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    span = _span(list(exporter.get_finished_spans()), "Busy", SpanKind.SERVER)
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


# ----------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize(
    ("area", "noun", "unit", "problem"),
    [
        ("kv_transfer", "bytes_moved", "bytes", "one lowercase word"),
        ("router", "TTFT", "seconds", "snake_case"),
        ("router", "ttft", "ms", "use 'seconds'"),
        ("pool", "kv_usage", "percent", "use 'ratio'"),
        ("router", "requests", "parsecs", "must be one of"),
        ("router", "requests_total", "requests", "'_total' added"),
    ],
)
def test_metric_name_enforces_the_grammar(area: str, noun: str, unit: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        metrics.metric_name(area, noun, unit)


def test_metric_helpers_reuse_and_refuse_conflicts() -> None:
    registry = CollectorRegistry()
    assert metrics.metric_name("router", "time_to_first_token", "seconds") == (
        "pdserve_router_time_to_first_token_seconds"
    )
    first = metrics.counter("router", "admitted", "requests", "Requests admitted.",
                            ["model"], registry=registry)
    again = metrics.counter("router", "admitted", "requests", "Requests admitted.",
                            ["model"], registry=registry)
    assert again is first
    with pytest.raises(ValueError, match="exists as Counter"):
        metrics.gauge("router", "admitted", "requests", "x", ["model"], registry=registry)
    with pytest.raises(ValueError, match="exists as Counter"):
        metrics.counter("router", "admitted", "requests", "x", ["pool"], registry=registry)


def test_metrics_endpoint_serves_text_format_on_a_free_port() -> None:
    registry = CollectorRegistry()
    ttft = metrics.histogram("router", "time_to_first_token", "seconds", "TTFT.", ["model"],
                             registry=registry)
    ttft.labels(model="m").observe(0.2)
    assert metrics.start_metrics_server(-1, registry=registry) is None
    server = metrics.start_metrics_server(0, registry=registry)
    assert server is not None
    try:
        assert server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
            content_type = resp.headers["Content-Type"]
    finally:
        server.close()
    assert content_type.startswith("text/plain")
    assert 'pdserve_router_time_to_first_token_seconds_bucket{le="0.25",model="m"} 1.0' in body
    assert 'pdserve_router_time_to_first_token_seconds_count{model="m"} 1.0' in body


# ------------------------------------------------------------------------------------ clocks


def test_clocks_are_plain_callables_and_manual_clock_only_moves_forward() -> None:
    clock = ManualClock(10.0)
    for each in (clock, SystemClock(), MonotonicClock()):
        assert isinstance(each, Clock)
        assert isinstance(each(), float)
    assert clock.advance(2.5) == 12.5 and clock() == 12.5
    clock.set(20.0)
    assert clock() == 20.0
    with pytest.raises(ValueError):
        clock.advance(-1.0)
    with pytest.raises(ValueError):
        clock.set(19.0)
    assert clock() == 20.0
