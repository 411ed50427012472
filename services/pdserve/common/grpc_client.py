"""gRPC client side shared by every service: channels, deadlines, retries, status -> error.

Every client call has a deadline. ``call_with_retry`` gives one deadline to the whole call,
retries included, and hands each attempt the time that is left as its gRPC timeout. It retries
only the status codes it is told to (default: UNAVAILABLE, which gRPC returns when the call did
not reach a server); whether a call is safe to repeat is the caller's decision. Failures come out as
``PdserveError`` subclasses (``error_from_rpc_error``), so code above the stubs never handles raw
gRPC errors, and a ``CapacityError`` keeps the server's ``retry_after_s``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from pdserve.common.credentials import bearer_interceptors, outgoing_credential
from pdserve.common.errors import (
    CapacityError,
    DeadlineError,
    PdserveError,
    error_from_status,
)
from pdserve.common.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RETRY_AFTER_MS_KEY,
    STATUS_DETAILS_KEY,
)
from pdserve.common.settings import CommonSettings, TlsConfig
from pdserve.common.telemetry import client_interceptors

try:
    from google.protobuf.message import DecodeError
    from google.rpc import error_details_pb2, status_pb2

    _HAS_RICH_STATUS = True
except ImportError:  # pragma: no cover - googleapis-common-protos comes with grpcio-status/OTLP
    _HAS_RICH_STATUS = False

T = TypeVar("T")


RECONNECT_BACKOFF_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
"""gRPC's reconnect backoff grows to 120 s by default: a channel to a replica that was down for
a restart (tens of seconds) keeps waiting long after it is back, and when the next replica goes
down for its turn of a rolling restart, the channel has no backend at all (seen in the chaos
run: heartbeats to the pool managers and client calls to the routers failed for ~10 s with a
replica up). Capped at 1 s: a replica is used again within a second of its return, for one
connection attempt a second to one that is down. ``grpc.min_reconnect_backoff_ms`` stays at its
default: gRPC also takes it as the shortest time a connection attempt may take (set to 100 ms,
connections to a busy worker timed out before its SETTINGS frame and requests were retried)."""


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel arguments of every pdserve client.

    Keepalive pings every 30 s, also on idle channels (pool managers hold channels to workers
    that may sit idle), and a peer that does not answer within 10 s is declared dead, so calls
    fail fast instead of hanging on a half-open TCP connection. The server side accepts pings
    this often (``grpc_server.server_options``). Reconnects: ``RECONNECT_BACKOFF_OPTIONS``.
    """
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        *RECONNECT_BACKOFF_OPTIONS,
    ]


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """TLS credentials: ``ca_path`` verifies the server (system roots when None); ``cert_path``
    and ``key_path``, when set, are this client's identity for mutual TLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca_path.read_bytes() if tls.ca_path else None,
        private_key=tls.key_path.read_bytes() if tls.key_path else None,
        certificate_chain=tls.cert_path.read_bytes() if tls.cert_path else None,
    )


def channel_target(address: str) -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target and extra channel options for ``address``: one ``host:port`` as it is;
    a comma-separated list of replicas as one ``ipv4:``/``ipv6:`` target balanced round-robin
    (calls go to replicas that are up; a call in flight on one that dies fails UNAVAILABLE and
    the next goes to another; a replica back from a restart is used again within a second,
    ``RECONNECT_BACKOFF_OPTIONS``). Host names in a list are resolved once, here."""
    parts = [part.strip() for part in address.split(",") if part.strip()]
    if len(parts) <= 1:
        return address, []
    resolved = [_resolve(part) for part in parts]
    families = {family for family, _ in resolved}
    if families == {socket.AF_INET}:
        target = "ipv4:" + ",".join(endpoint for _, endpoint in resolved)
    elif families == {socket.AF_INET6}:
        target = "ipv6:" + ",".join(endpoint for _, endpoint in resolved)
    else:  # mixed families: no single-scheme target; fall back to the first replica
        return parts[0], []
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
        # TLS checks the server certificate against the first replica's name.
        ("grpc.ssl_target_name_override", parts[0].rpartition(":")[0].strip("[]")),
        *RECONNECT_BACKOFF_OPTIONS,
    ]
    return target, options


def _resolve(address: str) -> tuple[int, str]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        *_, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        ip = ipaddress.ip_address(sockaddr[0])
    if ip.version == 6:
        return socket.AF_INET6, f"[{ip}]:{port}"
    return socket.AF_INET, f"{ip}:{port}"


def open_channel(
    address: str,
    settings: CommonSettings,
    tls: TlsConfig | None = None,
    *,
    tracer_provider: Any = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    options: Iterable[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """An aio channel to ``address`` (``host:port``, or replicas ``host:port,host:port``:
    ``channel_target``).

    ``tls`` defaults to the process's own TLS files (``settings.tls``); plaintext when neither is
    set. Every call presents the process's credential (``auth.outgoing_credential``: a worker's
    credential, or the service token) unless it carries an authorization of its own.
    Tracing interceptors are added when tracing is on (they propagate ``traceparent``), then
    ``interceptors``. ``options`` extend or override ``channel_options``. Close the channel when
    done (``await channel.close()``).
    """
    target, target_options = channel_target(address)
    merged = dict(channel_options(settings.grpc_max_message_bytes))
    if target_options:
        merged.update(target_options)
        if (tls if tls is not None else settings.tls) is None:
            merged.pop("grpc.ssl_target_name_override", None)
    merged.update(options)
    address = target
    all_interceptors = [*client_interceptors(settings, tracer_provider), *interceptors]
    credential = outgoing_credential(settings)
    if credential is not None:
        all_interceptors.extend(bearer_interceptors(credential))
    tls = tls if tls is not None else settings.tls
    if tls is None:
        return grpc.aio.insecure_channel(
            address, options=list(merged.items()), interceptors=all_interceptors or None
        )
    return grpc.aio.secure_channel(
        address,
        channel_credentials(tls),
        options=list(merged.items()),
        interceptors=all_interceptors or None,
    )


# ------------------------------------------------------------------------------ status -> error


def _rich_details(trailing: Iterable[Any]) -> tuple[float | None, str | None]:
    """``(retry_after_s, field)`` from trailing metadata, ``(key, value)`` pairs (grpc's stubs
    type a sync error's entries as objects without saying they are pairs): the rich status
    first, then the plain ``retry-after-ms`` entry. Malformed entries are ignored (a peer's bug
    is not our failure)."""
    retry_after_s: float | None = None
    field: str | None = None
    plain_retry_after_s: float | None = None
    for key, value in trailing:
        if key == STATUS_DETAILS_KEY and _HAS_RICH_STATUS and isinstance(value, bytes):
            try:
                status = status_pb2.Status.FromString(value)
            except DecodeError:
                continue
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    retry_after_s = info.retry_delay.ToMilliseconds() / 1000.0
                elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    detail.Unpack(bad)
                    if bad.field_violations:
                        field = bad.field_violations[0].field
        elif key == RETRY_AFTER_MS_KEY:
            try:
                plain_retry_after_s = max(0, int(value)) / 1000.0
            except (TypeError, ValueError):
                continue
    return (retry_after_s if retry_after_s is not None else plain_retry_after_s), field


def error_from_rpc_error(error: grpc.RpcError) -> PdserveError:
    """The ``PdserveError`` a failed call stands for (``errors.error_from_status``), with the
    retry delay and field the server attached. Codes with no class of their own (CANCELLED,
    UNIMPLEMENTED, ...) give a plain ``PdserveError`` whose ``code`` is the original code."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or ""
    mapped = error_from_status(code, message)
    if type(mapped) is PdserveError:
        mapped.code = code
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    retry_after_s, field = _rich_details(trailing or ())
    if isinstance(mapped, CapacityError) and retry_after_s is not None:
        mapped.retry_after_s = retry_after_s
    if field:
        mapped.field = field
    return mapped


# ---------------------------------------------------------------------------------- retries


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: attempt ``n`` (0-based) waits a uniform random time
    in ``[0, min(max_s, base_s * 2**n))``, so clients that failed together do not retry together."""

    base_s: float = 0.05
    max_s: float = 2.0

    def delay_s(self, attempt: int, rng: Callable[[], float]) -> float:
        return rng() * min(self.max_s, self.base_s * (2.0**attempt))


async def call_with_retry(
    fn: Callable[[float], Awaitable[T]],
    *,
    deadline_s: float,
    retries: int = 2,
    retry_on: Collection[grpc.StatusCode] = (grpc.StatusCode.UNAVAILABLE,),
    backoff: Backoff = Backoff(),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    rng: Callable[[], float] = random.random,
) -> T:
    """Run ``fn(timeout_s)`` until it succeeds, at most ``1 + retries`` times, within
    ``deadline_s`` seconds in all.

    ``fn`` makes one attempt and must pass ``timeout_s`` (the time left) as its call's timeout,
    e.g. ``lambda t: stub.Reserve(request, timeout=t)``. It may raise ``grpc.RpcError`` or
    ``PdserveError``; a code in ``retry_on`` is retried after a jittered backoff (at least the
    server's ``retry_after_s`` for RESOURCE_EXHAUSTED), anything else is raised at once as a
    ``PdserveError``. When no time is left for another attempt the last error is raised; when
    none was left even for the first, ``DeadlineError``. ``clock``, ``sleep`` and ``rng`` are
    injected for tests (monotonic seconds, ``asyncio.sleep``, uniform [0, 1)).
    """
    if deadline_s <= 0:
        raise DeadlineError(f"deadline must be positive, got {deadline_s} s")
    end = clock() + deadline_s
    attempt = 0
    while True:
        remaining_s = end - clock()
        if remaining_s <= 0:
            raise DeadlineError(f"deadline of {deadline_s:g} s passed after {attempt} attempts")
        try:
            return await fn(remaining_s)
        except (grpc.RpcError, PdserveError) as exc:
            error = exc if isinstance(exc, PdserveError) else error_from_rpc_error(exc)
            delay_s = backoff.delay_s(attempt, rng)
            if isinstance(error, CapacityError):
                delay_s = max(delay_s, error.retry_after_s)
            is_retried = (
                error.code in retry_on and attempt < retries and clock() + delay_s < end
            )
            if not is_retried:
                if error is exc:
                    raise
                raise error from exc
            await sleep(delay_s)
            attempt += 1
