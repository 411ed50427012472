"""gRPC server bootstrap shared by every service: health, reflection, error mapping, shutdown.

``GrpcServer`` wraps ``grpc.aio.server`` with

* the library's health service (``grpc.health.v1.Health``, aio servicer) holding one status per
  registered service plus the overall ``""`` status;
* reflection listing the registered services (for ``grpcurl`` and friends);
* error mapping at the boundary: a ``PdserveError`` raised by a servicer becomes its status code
  and message (``errors.status_for``); anything else becomes ``INTERNAL`` / ``"internal error"``
  with the traceback logged, so internals never reach a client; a method the servicer does not
  implement is UNIMPLEMENTED, and request bytes that do not parse are INVALID_ARGUMENT (gRPC
  alone would answer UNKNOWN with the parser's message);
* graceful shutdown on SIGTERM/SIGINT: health flips to NOT_SERVING (health watchers, i.e. client
  load balancers, hear it at once), then, after ``drain_delay_s``, the server refuses new calls and
  lets in-flight ones run for up to ``grace_period_s`` before cancelling them. A second signal
  cancels everything at once.

Error details travel in trailing metadata. A ``CapacityError`` carries its ``retry_after_s`` twice:
as ``google.rpc.RetryInfo`` in the rich status (``grpc-status-details-bin``, the form other gRPC
stacks understand; needs the ``grpcio-status`` package) and as a plain ``retry-after-ms`` entry
(integer milliseconds, readable with no extra package). An error's ``field`` travels as a
``google.rpc.BadRequest`` field violation. ``grpc_client.error_from_rpc_error`` reads both back.

Error mapping is installed twice over, on purpose cheap: ``GrpcServer`` adds
``ErrorMappingInterceptor`` around every handler, and ``map_errors`` is a decorator for servicer
methods that run outside ``GrpcServer``. Both handle unary and streaming responses, in both aio
styles (return/yield, or ``await context.write``); applied twice they are harmless.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.common.errors import CapacityError, PdserveError, status_for
from pdserve.common.grpc_handlers import wrap_handler
from pdserve.common.settings import CommonSettings, TlsConfig
from pdserve.common.settings_parsers import format_address
from pdserve.common.telemetry import server_interceptors

try:  # grpcio-status packs the rich status; without it only retry-after-ms is sent.
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status
except ImportError:  # pragma: no cover - exercised only where grpcio-status is missing
    rpc_status = None

logger = logging.getLogger(__name__)

RETRY_AFTER_MS_KEY = "retry-after-ms"
"""Trailing metadata key: milliseconds to wait before retrying (decimal integer as text)."""

STATUS_DETAILS_KEY = "grpc-status-details-bin"
"""Trailing metadata key of the serialized ``google.rpc.Status`` (the gRPC rich error model)."""

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

Metadata = tuple[tuple[str, str | bytes], ...]
F = TypeVar("F", bound=Callable[..., Any])


# ------------------------------------------------------------------------------ error mapping


def error_trailing_metadata(
    error: BaseException, code: grpc.StatusCode, message: str
) -> Metadata:
    """Trailing metadata that carries ``error``'s retry delay and field, if it has any."""
    entries: list[tuple[str, str | bytes]] = []
    retry_after_s = error.retry_after_s if isinstance(error, CapacityError) else None
    field = error.field if isinstance(error, PdserveError) else None
    if retry_after_s is not None:
        retry_after_ms = max(0, round(retry_after_s * 1000))
        entries.append((RETRY_AFTER_MS_KEY, str(retry_after_ms)))
    if rpc_status is not None and (retry_after_s is not None or field):
        details = []
        if retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(max(0, round(retry_after_s * 1000)))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        if field:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=field, description=message
            )
            details.append(error_details_pb2.BadRequest(field_violations=[violation]))
        status = status_pb2.Status(code=code.value[0], message=message)
        for detail in details:
            packed = any_pb2.Any()
            packed.Pack(detail)
            status.details.append(packed)
        entries.extend(rpc_status.to_status(status).trailing_metadata)
    return tuple(entries)


async def abort_with_error(
    context: grpc.aio.ServicerContext, error: BaseException, method: str
) -> None:
    """End the call with the status ``error`` maps to. Never returns (``context.abort`` raises).

    Unknown errors, and ``PdserveError``s that map to INTERNAL, are logged with their traceback;
    expected ones (invalid input, no capacity, ...) only at debug level, since the caller sees
    them and a busy service would otherwise log every rejected request.
    """
    code, message = status_for(error)
    if isinstance(error, NotImplementedError):
        # What generated servicer bases raise for a method the service does not implement
        # (after setting UNIMPLEMENTED on the context, which an abort would override).
        code, message = grpc.StatusCode.UNIMPLEMENTED, "method not implemented"
    if code is grpc.StatusCode.INTERNAL:
        logger.error("%s failed: %s", method, type(error).__name__, exc_info=error)
    else:
        logger.debug("%s -> %s: %s", method, code.name, message)
    await context.abort(code, message, error_trailing_metadata(error, code, message))


class _Undecodable:
    """Stands for a request whose bytes did not parse (see ``_tolerant_deserializer``)."""


_UNDECODABLE = _Undecodable()


def _tolerant_deserializer(deserializer: Callable[[bytes], Any] | None) -> Any:
    """``deserializer`` that returns ``_UNDECODABLE`` instead of raising: gRPC itself would
    answer UNKNOWN with the parser's message and log an error for every malformed request; the
    wrapped handler answers INVALID_ARGUMENT instead."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:  # noqa: BLE001 - DecodeError, or whatever a deserializer raises
            return _UNDECODABLE

    return deserialize


async def _refuse_undecodable(context: grpc.aio.ServicerContext, method: str) -> None:
    logger.debug("%s: request bytes do not parse", method)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid message")


def _wrap_coroutine(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """Wrap a handler that returns (unary) or writes with ``context.write`` (streaming)."""

    @functools.wraps(behavior)
    async def wrapped(*args: Any) -> Any:
        if args[0] is _UNDECODABLE:
            await _refuse_undecodable(args[-1], method)
        try:
            return await behavior(*args)
        except grpc.aio.AbortError:
            raise  # the handler aborted on purpose; the status is set already
        except Exception as error:  # noqa: BLE001 - this is the boundary
            await abort_with_error(args[-1], error, method)

    return wrapped


def _wrap_async_generator(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """Wrap a streaming handler written as an async generator; already-yielded messages stay
    delivered, the error ends the stream with its status."""

    @functools.wraps(behavior)
    async def wrapped(*args: Any) -> AsyncIterator[Any]:
        if args[0] is _UNDECODABLE:
            await _refuse_undecodable(args[-1], method)
        try:
            async for response in behavior(*args):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - this is the boundary
            await abort_with_error(args[-1], error, method)

    return wrapped


def _wrap_behavior(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        return _wrap_async_generator(behavior, method)
    return _wrap_coroutine(behavior, method)


def map_errors(method: F) -> F:
    """Decorator for aio servicer methods (``async def`` or async generators): errors become
    statuses as described in the module docstring. The context must be the last argument."""
    return cast(F, _wrap_behavior(method, method.__qualname__))


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Applies the error mapping of ``map_errors`` to every handler of a server."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return wrap_handler(
            handler, lambda behavior: _wrap_behavior(behavior, method), _tolerant_deserializer
        )


# ------------------------------------------------------------------------------------ server


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel arguments of every pdserve server.

    Keepalive: the server pings idle clients every 60 s (20 s to answer) so half-open
    connections of crashed peers are noticed, and accepts client pings as often as every 10 s
    even with no call in flight; gRPC core's default would answer a client pinging more often
    than every 5 minutes with GOAWAY (grpc/grpc doc/keepalive.md). ``so_reuseport`` is off so a
    port taken by another process fails loudly instead of silently sharing its traffic.
    """
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.so_reuseport", 0),
    ]


class GrpcServer:
    """One service process's gRPC server. Register services, ``start()``, then ``wait()``.

    Construct inside the event loop that will run it. Lifecycle: ``add_servicer`` /
    ``add_generic_handler`` (before ``start``) -> ``start()`` binds and returns the port ->
    ``stop()`` (or a signal after ``install_signal_handlers``) -> ``wait()`` returns.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        grace_period_s: float = 15.0,
        drain_delay_s: float = 0.0,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        tls: TlsConfig | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """``interceptors`` run outside the error mapping (tracing first, so its span sees the
        final status). ``drain_delay_s`` is the time between health turning NOT_SERVING and the
        server refusing new calls, for load balancers that poll ``Check`` instead of watching."""
        if grace_period_s < 0 or drain_delay_s < 0:
            raise ValueError("grace_period_s and drain_delay_s must be >= 0")
        self._host = host
        self._requested_port = port
        self._grace_period_s = grace_period_s
        self._drain_delay_s = drain_delay_s
        self._tls = tls
        self.tls_credentials: Any = None
        """The reloading TLS credentials once started with TLS (``num_reloads`` for tests)."""
        self._server = grpc.aio.server(
            interceptors=[*interceptors, ErrorMappingInterceptor()],
            options=server_options(max_message_bytes),
        )
        self._health = grpc_health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = []
        self._port: int | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._signals: list[signal.Signals] = []
        self._background: set[asyncio.Future[Any]] = set()

    @classmethod
    def from_settings(
        cls,
        settings: CommonSettings,
        *,
        tracer_provider: Any = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        drain_delay_s: float = 0.0,
    ) -> GrpcServer:
        """A server per ``settings``: bind address, grace period, TLS, message size, the
        tracing interceptor when tracing is on, then authentication and authorization
        (``pdserve.common.auth``) when keys or mutual TLS are configured, then
        ``interceptors``."""
        from pdserve.common.auth import auth_interceptor

        auth = auth_interceptor(settings)
        return cls(
            host=settings.grpc_host,
            port=settings.grpc_port,
            grace_period_s=settings.grace_period_s,
            drain_delay_s=drain_delay_s,
            interceptors=[*server_interceptors(settings, tracer_provider),
                          *([auth] if auth is not None else []), *interceptors],
            tls=settings.tls,
            max_message_bytes=settings.grpc_max_message_bytes,
        )

    # -- registration ---------------------------------------------------------------------------

    def add_servicer(
        self, service_name: str, add_to_server: Callable[[Any, grpc.aio.Server], None],
        servicer: object,
    ) -> None:
        """Register a generated-code servicer, e.g.
        ``add_servicer(ROUTER_SERVICE, router_pb2_grpc.add_RouterServiceServicer_to_server, s)``
        where the name is the proto's full name (``pdserve.api.v1.RouterService``)."""
        self._check_not_started()
        add_to_server(servicer, self._server)
        self._service_names.append(service_name)

    def add_generic_handler(self, handler: grpc.GenericRpcHandler, service_name: str = "") -> None:
        """Register a generic handler (``grpc.method_handlers_generic_handler``); its service name
        is taken from the handler when it has one."""
        self._check_not_started()
        name = service_name or getattr(handler, "service_name", lambda: "")()
        if not name:
            raise ValueError("service_name is required for a handler that does not name itself")
        self._server.add_generic_rpc_handlers((handler,))
        self._service_names.append(name)

    def _check_not_started(self) -> None:
        if self._port is not None:
            raise RuntimeError("register services before start()")

    # -- health ---------------------------------------------------------------------------------

    async def set_serving(self, service_name: str, is_serving: bool) -> None:
        """Set one service's health (``""`` = the whole server). Ignored once shutting down."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._health.set(service_name, status)

    # -- lifecycle ------------------------------------------------------------------------------

    def _reloading_credentials(self) -> grpc.ServerCredentials:
        """TLS that follows renewed certificate files without a restart (new handshakes get
        the new pair; ``pdserve.common.certs.ReloadingServerCredentials``)."""
        from pdserve.common.certs import ReloadingServerCredentials

        assert self._tls is not None
        self.tls_credentials = ReloadingServerCredentials(self._tls)
        return self.tls_credentials.credentials()

    @property
    def port(self) -> int:
        """The bound port (known after ``start``)."""
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` actually bound, for logs and for clients in the same process."""
        return format_address(self._host, self.port)

    @property
    def service_names(self) -> tuple[str, ...]:
        return tuple(self._service_names)

    async def start(self, *, is_serving: bool = True) -> int:
        """Bind (port 0 = any free port), start serving, and set every service's health to
        ``is_serving`` (False for a process that must load first, e.g. a worker in its cold
        start; it calls ``set_serving`` when ready). Returns the bound port; raises RuntimeError
        when the address cannot be bound."""
        self._check_not_started()
        names = [*self._service_names, grpc_health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self._server)
        address = format_address(self._host, self._requested_port)
        try:
            if self._tls is not None:
                port = self._server.add_secure_port(address, self._reloading_credentials())
            else:
                port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot bind gRPC server to {address}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"cannot bind gRPC server to {address}")
        self._port = port
        await self._server.start()
        for name in ("", *self._service_names):
            await self.set_serving(name, is_serving)
        logger.info(
            "gRPC server listening on %s (%s; services: %s)",
            self.address, "TLS" if self._tls else "plaintext", ", ".join(self._service_names),
        )
        return port

    async def stop(self, grace_period_s: float | None = None) -> None:
        """Graceful shutdown; later calls wait for the first one. ``grace_period_s`` overrides the
        configured one (0 cancels in-flight calls at once)."""
        if self._stop_task is None:
            grace = self._grace_period_s if grace_period_s is None else grace_period_s
            self._stop_task = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stop_task)

    async def _stop(self, grace_period_s: float) -> None:
        logger.info("gRPC server shutting down: health NOT_SERVING, grace %.1f s", grace_period_s)
        await self._health.enter_graceful_shutdown()
        if self._drain_delay_s > 0:
            await asyncio.sleep(self._drain_delay_s)
        await self._server.stop(grace_period_s)
        logger.info("gRPC server stopped")

    async def wait(self) -> None:
        """Return once the server has terminated."""
        await self._server.wait_for_termination()

    def install_signal_handlers(
        self, signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
    ) -> None:
        """First signal: graceful ``stop()``. Second: cancel in-flight calls now. Main thread
        only (asyncio's rule); ``remove_signal_handlers`` undoes it."""
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals.append(sig)

    def remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals.clear()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stop_task is None:
            logger.info("received %s", sig.name)
            self._stop_task = asyncio.ensure_future(self._stop(self._grace_period_s))
        else:
            logger.warning("received %s again: cancelling in-flight calls", sig.name)
            task = asyncio.ensure_future(self._server.stop(None))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def serve(self) -> None:
        """``start``, handle SIGTERM/SIGINT, and run until stopped."""
        await self.start()
        self.install_signal_handlers()
        try:
            await self.wait()
            if self._stop_task is not None:
                await self._stop_task
        finally:
            self.remove_signal_handlers()
