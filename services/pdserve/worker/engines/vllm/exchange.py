"""The rendezvous step of a handoff, as the connector's worker side sees it: the decode side
publishes where a ticket's KV goes, the prefill side waits for it.

``DestinationExchange`` is the role interface; ``GrpcDestinationExchange`` is the real one (the
KV-transfer coordinator's ``PublishDestination``/``AwaitDestination``, backed by its Redis
rendezvous and checked against the ticket: a published destination dies with its ticket);
``DirectoryDestinationExchange`` is a folder both workers can see (one machine: tests and
debugging), with the same contract. Both run on the connector's own event loop.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import tempfile
from pathlib import Path
from typing import Protocol

import grpc

from pdserve.common.errors import InvalidArgumentError, NotFoundError, UnavailableError
from pdserve.common.types import FencingToken
from pdserve.worker.engines.vllm.events import ConnectorEvent, EventKind, EventSink
from pdserve.worker.engines.vllm.protocol import ConnectorSettings, RendezvousKind
from pdserve.worker.transports.values import KvDestinationSpec

logger = logging.getLogger(__name__)

_LONG_POLL_S = 5.0
"""One AwaitDestination call waits at most this long; a longer wait is several calls."""


class DestinationExchange(Protocol):
    async def publish(self, token: FencingToken, destination: KvDestinationSpec) -> None:
        """Make ``destination`` the KV destination of ``token``. Raises ``NotFoundError`` if
        the ticket is not open any more, ``UnavailableError`` if the exchange is unreachable."""
        ...

    async def wait(self, token: FencingToken, timeout_s: float) -> KvDestinationSpec | None:
        """The published destination, or None if none came within ``timeout_s``."""
        ...

    async def close(self) -> None: ...


class DirectoryDestinationExchange:
    """One file per ticket attempt, written atomically (rename); waiters poll."""

    def __init__(self, folder: Path, poll_interval_s: float = 0.005) -> None:
        self._folder = folder
        self._poll_interval_s = poll_interval_s
        folder.mkdir(parents=True, exist_ok=True)

    def _path(self, token: FencingToken) -> Path:
        if "/" in token.ticket_id or token.ticket_id.startswith("."):
            raise InvalidArgumentError(f"ticket id {token.ticket_id!r} is not a file name",
                                       field="token")
        return self._folder / f"{token.ticket_id}.{token.attempt}.dest"

    async def publish(self, token: FencingToken, destination: KvDestinationSpec) -> None:
        payload = destination.to_proto().SerializeToString()
        fd, staging = tempfile.mkstemp(dir=self._folder, prefix=".publish-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.replace(staging, self._path(token))

    async def wait(self, token: FencingToken, timeout_s: float) -> KvDestinationSpec | None:
        from pdserve.api.v1 import common_pb2

        path = self._path(token)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                if loop.time() >= deadline:
                    return None
                await asyncio.sleep(self._poll_interval_s)
                continue
            message = common_pb2.KvDestination()
            message.ParseFromString(raw)
            return KvDestinationSpec.from_proto(message)

    async def close(self) -> None:
        return None


class GrpcDestinationExchange:
    """The coordinator's rendezvous over gRPC. Every call has a deadline."""

    def __init__(self, address: str, rpc_timeout_s: float = 5.0,
                 channel: grpc.aio.Channel | None = None) -> None:
        from pdserve.api.v1 import kv_transfer_pb2_grpc

        self._channel = channel or grpc.aio.insecure_channel(address)
        self._stub = kv_transfer_pb2_grpc.KvTransferServiceStub(self._channel)
        self._rpc_timeout_s = rpc_timeout_s
        self._address = address

    async def publish(self, token: FencingToken, destination: KvDestinationSpec) -> None:
        from pdserve.api.v1 import common_pb2, kv_transfer_pb2

        request = kv_transfer_pb2.PublishDestinationRequest(
            token=common_pb2.FencingToken(ticket_id=token.ticket_id, attempt=token.attempt),
            destination=destination.to_proto(),
        )
        try:
            await self._stub.PublishDestination(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFoundError(f"{token}: ticket not open: {exc.details()}",
                                    field="token") from None
            raise UnavailableError(f"PublishDestination to {self._address}: "
                                   f"{exc.code().name} {exc.details()}") from None

    async def wait(self, token: FencingToken, timeout_s: float) -> KvDestinationSpec | None:
        from pdserve.api.v1 import common_pb2, kv_transfer_pb2

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        token_pb = common_pb2.FencingToken(ticket_id=token.ticket_id, attempt=token.attempt)
        while (remaining_s := deadline - loop.time()) > 0:
            poll_s = min(remaining_s, _LONG_POLL_S)
            request = kv_transfer_pb2.AwaitDestinationRequest(
                token=token_pb, timeout_ms=max(1, int(poll_s * 1000)))
            try:
                response = await self._stub.AwaitDestination(
                    request, timeout=poll_s + self._rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise UnavailableError(f"AwaitDestination from {self._address}: "
                                       f"{exc.code().name} {exc.details()}") from None
            if response.is_ready:
                return KvDestinationSpec.from_proto(response.destination)
            if response.HasField("ticket") and _is_terminal(response.ticket.state):
                return None  # the ticket ended: no destination will come
        return None

    async def close(self) -> None:
        await self._channel.close()


def _is_terminal(state: int) -> bool:
    from pdserve.api.v1 import common_pb2

    return state in (common_pb2.TICKET_STATE_DONE, common_pb2.TICKET_STATE_ABORTED,
                     common_pb2.TICKET_STATE_EXPIRED)


class AgentDestinationExchange:
    """The rendezvous through the agent (``RendezvousKind.AGENT``, what worker agents use):
    the decode side hands the destination to its agent as a ``DESTINATION`` event, and the
    agent publishes it at the coordinator; a prefill request always carries its destination
    (its agent waited for it before submitting). No gRPC runs inside vLLM's processes: they
    are forked from the agent, and gRPC does not survive a fork from a process using it."""

    def __init__(self, events: EventSink) -> None:
        self._events = events

    async def publish(self, token: FencingToken, destination: KvDestinationSpec) -> None:
        raw = destination.to_proto().SerializeToString()
        self._events.emit(ConnectorEvent(EventKind.DESTINATION, token=str(token),
                                         destination=base64.b64encode(raw).decode("ascii")))

    async def wait(self, token: FencingToken, timeout_s: float) -> KvDestinationSpec | None:
        raise InvalidArgumentError(
            f"{token}: with the agent's rendezvous a prefill request carries its destination",
            field="kv_transfer_params.destination")

    async def close(self) -> None:
        return None


def destination_of(event: ConnectorEvent) -> KvDestinationSpec:
    """The destination a ``DESTINATION`` event carries."""
    from pdserve.api.v1 import common_pb2

    message = common_pb2.KvDestination()
    message.ParseFromString(base64.b64decode(event.destination))
    return KvDestinationSpec.from_proto(message)


def make_exchange(settings: ConnectorSettings, events: EventSink) -> DestinationExchange:
    if settings.rendezvous is RendezvousKind.AGENT:
        return AgentDestinationExchange(events)
    if settings.rendezvous is RendezvousKind.DIRECTORY:
        return DirectoryDestinationExchange(Path(settings.rendezvous_dir))
    return GrpcDestinationExchange(settings.coordinator_address, settings.rpc_timeout_s)
