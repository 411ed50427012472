"""GrpcServer: health, reflection, error mapping (unary and streaming, interceptor and decorator),
graceful shutdown; and the client helpers (status -> error, retries under a deadline)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.common.clock import ManualClock
from pdserve.common.errors import (
    CapacityError,
    DeadlineError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    UnavailableError,
)
from pdserve.common.grpc_client import Backoff, call_with_retry, error_from_rpc_error, open_channel
from pdserve.common.grpc_server import (
    RETRY_AFTER_MS_KEY,
    STATUS_DETAILS_KEY,
    GrpcServer,
    map_errors,
)
from pdserve.common.settings import CommonSettings

SERVICE = "pdserve.test.TestService"
SETTINGS = CommonSettings()


def _error_for(request: bytes) -> Exception | None:
    """Requests name the error the handler raises."""
    return {
        b"capacity": CapacityError("no free KV blocks", retry_after_s=2.5),
        b"invalid": InvalidArgumentError("prompt is empty", field="prompt"),
        b"missing": NotFoundError("worker w-1 not found"),
        b"boom": RuntimeError("secret internals: /var/lib/x"),
    }.get(request)


class _Handlers:
    """A tiny test service over raw bytes: unary, two streaming styles, and a slow call."""

    def __init__(self) -> None:
        self.slow_started = asyncio.Event()
        self.slow_release = asyncio.Event()

    async def echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        error = _error_for(request)
        if error is not None:
            raise error
        return request

    async def stream(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"one"
        yield b"two"
        error = _error_for(request)
        if error is not None:
            raise error

    async def write_stream(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.write(b"one")
        error = _error_for(request)
        if error is not None:
            raise error

    async def slow(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.slow_started.set()
        await self.slow_release.wait()
        return b"finished"

    def generic_handler(self, wrap: Callable[[Any], Any] = lambda f: f) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Echo": grpc.unary_unary_rpc_method_handler(wrap(self.echo)),
                "Stream": grpc.unary_stream_rpc_method_handler(wrap(self.stream)),
                "WriteStream": grpc.unary_stream_rpc_method_handler(wrap(self.write_stream)),
                "Slow": grpc.unary_unary_rpc_method_handler(wrap(self.slow)),
            },
        )


@pytest.fixture
async def handlers() -> _Handlers:
    return _Handlers()


@pytest.fixture
async def server(handlers: _Handlers) -> AsyncIterator[GrpcServer]:
    srv = GrpcServer(host="127.0.0.1", port=0, grace_period_s=10.0)
    srv.add_generic_handler(handlers.generic_handler())
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(0)


@pytest.fixture
async def channel(server: GrpcServer) -> AsyncIterator[grpc.aio.Channel]:
    ch = open_channel(server.address, SETTINGS)
    try:
        yield ch
    finally:
        await ch.close()


def _echo(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(f"/{SERVICE}/Echo")


async def _check(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


# ------------------------------------------------------------------------- health, reflection


async def test_bound_port_health_and_reflection(
    server: GrpcServer, channel: grpc.aio.Channel
) -> None:
    assert server.port > 0
    assert await _check(channel, "") == health_pb2.HealthCheckResponse.SERVING
    assert await _check(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING

    await server.set_serving(SERVICE, False)
    assert await _check(channel, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await _check(channel, "") == health_pb2.HealthCheckResponse.SERVING

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = [s.name async for r in call for s in r.list_services_response.service]
    assert SERVICE in names
    assert "grpc.health.v1.Health" in names


async def test_start_not_serving_until_ready(handlers: _Handlers) -> None:
    srv = GrpcServer(host="127.0.0.1", port=0)
    srv.add_generic_handler(handlers.generic_handler())
    await srv.start(is_serving=False)
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            assert await _check(ch, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await _check(ch, "") == health_pb2.HealthCheckResponse.NOT_SERVING
            await srv.set_serving(SERVICE, True)
            assert await _check(ch, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await srv.stop(0)


# ------------------------------------------------------------------------------ error mapping


@pytest.mark.parametrize(
    ("request_bytes", "code", "message"),
    [
        (b"capacity", grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks"),
        (b"invalid", grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (b"missing", grpc.StatusCode.NOT_FOUND, "worker w-1 not found"),
        (b"boom", grpc.StatusCode.INTERNAL, "internal error"),
    ],
)
async def test_unary_errors_arrive_as_statuses(
    channel: grpc.aio.Channel, request_bytes: bytes, code: grpc.StatusCode, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _echo(channel)(request_bytes, timeout=5)
    assert info.value.code() == code
    assert info.value.details() == message


async def test_capacity_error_carries_retry_info_both_ways(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _echo(channel)(b"capacity", timeout=5)
    trailing = dict(info.value.trailing_metadata() or ())
    assert trailing[RETRY_AFTER_MS_KEY] == "2500"
    status = status_pb2.Status.FromString(trailing[STATUS_DETAILS_KEY])
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    retry_info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(retry_info)
    assert retry_info.retry_delay.ToMilliseconds() == 2500

    error = error_from_rpc_error(info.value)
    assert isinstance(error, CapacityError)
    assert error.retry_after_s == 2.5
    assert error.message == "no free KV blocks"


async def test_invalid_argument_keeps_its_field(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _echo(channel)(b"invalid", timeout=5)
    error = error_from_rpc_error(info.value)
    assert isinstance(error, InvalidArgumentError)
    assert error.field == "prompt"


async def test_unknown_error_is_internal_and_logged_with_traceback(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="pdserve.common.grpc_server"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _echo(channel)(b"boom", timeout=5)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in (info.value.details() or "")
    (record,) = [r for r in caplog.records if r.name == "pdserve.common.grpc_server"]
    assert record.exc_info is not None and "secret internals" in str(record.exc_info[1])
    assert f"/{SERVICE}/Echo" in record.getMessage()


@pytest.mark.parametrize("method", ["Stream", "WriteStream"])
@pytest.mark.parametrize(
    ("request_bytes", "code", "message"),
    [
        (b"capacity", grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks"),
        (b"boom", grpc.StatusCode.INTERNAL, "internal error"),
    ],
)
async def test_streaming_errors_arrive_after_the_messages_sent(
    channel: grpc.aio.Channel, method: str, request_bytes: bytes, code: grpc.StatusCode,
    message: str,
) -> None:
    received: list[bytes] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for item in channel.unary_stream(f"/{SERVICE}/{method}")(request_bytes, timeout=5):
            received.append(item)
    assert received == ([b"one", b"two"] if method == "Stream" else [b"one"])
    assert info.value.code() == code
    assert info.value.details() == message
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert error_from_rpc_error(info.value).retry_after_s == 2.5  # type: ignore[attr-defined]


async def test_streaming_success_is_untouched(channel: grpc.aio.Channel) -> None:
    items = [i async for i in channel.unary_stream(f"/{SERVICE}/Stream")(b"ok", timeout=5)]
    assert items == [b"one", b"two"]


async def test_decorator_maps_errors_without_the_interceptor(handlers: _Handlers) -> None:
    raw = grpc.aio.server()  # a plain server: only the decorator maps errors here
    raw.add_generic_rpc_handlers((handlers.generic_handler(wrap=map_errors),))
    port = raw.add_insecure_port("127.0.0.1:0")
    await raw.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await ch.unary_unary(f"/{SERVICE}/Echo")(b"capacity", timeout=5)
            assert unary.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(unary.value.trailing_metadata() or ())[RETRY_AFTER_MS_KEY] == "2500"
            for method in ("Stream", "WriteStream"):
                with pytest.raises(grpc.aio.AioRpcError) as stream:
                    async for _ in ch.unary_stream(f"/{SERVICE}/{method}")(b"boom", timeout=5):
                        pass
                assert stream.value.code() == grpc.StatusCode.INTERNAL
                assert stream.value.details() == "internal error"
            assert await ch.unary_unary(f"/{SERVICE}/Echo")(b"ok", timeout=5) == b"ok"
    finally:
        await raw.stop(0)


# --------------------------------------------------------------------------- graceful shutdown


async def test_graceful_shutdown_drains_in_flight_and_refuses_new(
    server: GrpcServer, channel: grpc.aio.Channel, handlers: _Handlers
) -> None:
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=10
    )
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

    in_flight = asyncio.ensure_future(channel.unary_unary(f"/{SERVICE}/Slow")(b"", timeout=10))
    await handlers.slow_started.wait()
    stopping = asyncio.ensure_future(server.stop())

    assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()  # a watch is an in-flight call too; it would hold shutdown for the full grace

    refused: grpc.aio.AioRpcError | None = None
    async with grpc.aio.insecure_channel(server.address) as fresh:
        for _ in range(200):  # the server stops accepting right after flipping health
            try:
                await fresh.unary_unary(f"/{SERVICE}/Echo")(b"late", timeout=5)
            except grpc.aio.AioRpcError as exc:
                refused = exc
                break
            await asyncio.sleep(0.01)
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert not in_flight.done()

    handlers.slow_release.set()
    assert await in_flight == b"finished"
    await stopping
    await asyncio.wait_for(server.wait(), timeout=10)


async def test_sigterm_stops_the_server(handlers: _Handlers) -> None:
    srv = GrpcServer(host="127.0.0.1", port=0, grace_period_s=5.0)
    srv.add_generic_handler(handlers.generic_handler())
    await srv.start()
    srv.install_signal_handlers([signal.SIGTERM])
    try:
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        signal.raise_signal(signal.SIGTERM)
        await asyncio.wait_for(srv.wait(), timeout=10)
    finally:
        srv.remove_signal_handlers()
        await srv.stop(0)
    async with grpc.aio.insecure_channel(srv.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ch.unary_unary(f"/{SERVICE}/Echo")(b"late", timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------------------- client retries


def _rpc_error(code: grpc.StatusCode, details: str = "x", trailing: tuple = ()) -> grpc.RpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


class _FakeTime:
    """A manual clock with a sleep that advances it, recording each sleep."""

    def __init__(self) -> None:
        self.clock = ManualClock(100.0)
        self.sleeps: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.clock.advance(seconds)


async def test_retry_retries_unavailable_with_shrinking_timeouts() -> None:
    fake = _FakeTime()
    timeouts: list[float] = []

    async def attempt(timeout_s: float) -> str:
        timeouts.append(timeout_s)
        fake.clock.advance(0.5)  # each attempt takes half a second
        if len(timeouts) < 3:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    result = await call_with_retry(
        attempt, deadline_s=5.0, retries=2, backoff=Backoff(base_s=0.1, max_s=1.0),
        clock=fake.clock, sleep=fake.sleep, rng=lambda: 1.0,
    )
    assert result == "ok"
    assert fake.sleeps == [pytest.approx(0.1), pytest.approx(0.2)]
    assert timeouts == [pytest.approx(5.0), pytest.approx(4.4), pytest.approx(3.7)]


async def test_retry_does_not_retry_other_codes_and_maps_them() -> None:
    fake = _FakeTime()
    calls = 0

    async def attempt(timeout_s: float) -> str:
        nonlocal calls
        calls += 1
        raise _rpc_error(grpc.StatusCode.NOT_FOUND, "no such ticket")

    with pytest.raises(NotFoundError, match="no such ticket"):
        await call_with_retry(attempt, deadline_s=5.0, clock=fake.clock, sleep=fake.sleep)
    assert calls == 1 and fake.sleeps == []


async def test_retry_honours_retry_after_and_gives_up_at_the_deadline() -> None:
    fake = _FakeTime()
    trailing = ((RETRY_AFTER_MS_KEY, "1500"),)

    async def attempt(timeout_s: float) -> str:
        raise _rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", trailing)

    with pytest.raises(CapacityError) as info:
        await call_with_retry(
            attempt, deadline_s=4.0, retries=5,
            retry_on=(grpc.StatusCode.RESOURCE_EXHAUSTED,),
            clock=fake.clock, sleep=fake.sleep, rng=lambda: 0.0,
        )
    assert info.value.retry_after_s == 1.5
    assert fake.sleeps == [1.5, 1.5]  # a third wait would pass the 4 s deadline


async def test_retry_accepts_pdserve_errors_and_rejects_no_deadline() -> None:
    fake = _FakeTime()
    attempts = 0

    async def attempt(timeout_s: float) -> str:
        nonlocal attempts
        attempts += 1
        raise UnavailableError("no decode worker")

    with pytest.raises(UnavailableError):
        await call_with_retry(
            attempt, deadline_s=10.0, retries=3, clock=fake.clock, sleep=fake.sleep
        )
    assert attempts == 4
    with pytest.raises(DeadlineError):
        await call_with_retry(attempt, deadline_s=0.0)


def test_unmapped_code_keeps_its_code() -> None:
    error = error_from_rpc_error(_rpc_error(grpc.StatusCode.UNIMPLEMENTED, "no such method"))
    assert type(error) is PdserveError
    assert error.code == grpc.StatusCode.UNIMPLEMENTED
