"""What the connector's worker side tells the agent: one Unix datagram per event.

vLLM returns nothing from the worker process that a sidecar could read in time: a prefill
request's output is emitted before its KV has been sent, and the counters of refused frames live
only in the worker. So the worker side sends small JSON datagrams (``ConnectorEvent``) to a
socket the agent listens on (``ConnectorSettings.events_path``). Datagrams need no framing, never
block the sender (a missing or full listener drops the event, which is logged), and die with the
machine: the channel is local by construction.

Events: a handoff that landed (``RECEIVED``) or was pushed (``SENT``), with its checksum for the
audit; one that failed on either side (``FAILED``), with the reason; and the receiver's running
count of refused frames (``REJECTED``) whenever it grows; and, with the agent's rendezvous, where
a ticket's prompt lands (``DESTINATION``), which the agent publishes at the coordinator.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

MAX_EVENT_NBYTES = 64 * 1024


class EventKind(enum.StrEnum):
    READY = "ready"  # the worker side registered vLLM's KV cache; layout and address known
    RECEIVED = "received"
    SENT = "sent"
    FAILED = "failed"
    REJECTED = "rejected"
    DESTINATION = "destination"  # the decode side placed a ticket's prompt: publish it (agent)


@dataclass(frozen=True, slots=True)
class ConnectorEvent:
    """One event. ``token`` is ``str(FencingToken)``; ``crc32`` follows ``kv_checksum``'s
    definition (every layer of the handoff's blocks, layer-major, blocks in sequence order);
    ``block_crc32s`` is one CRC-32 per block over its layers in order, to find which block
    differs."""

    kind: EventKind
    req_id: str = ""
    token: str = ""
    crc32: int = 0
    block_crc32s: tuple[int, ...] = ()
    num_blocks: int = 0
    num_layers: int = 0
    num_bytes: int = 0
    transfer_s: float = 0.0
    reason: str = ""
    num_rejections: int = 0
    kv_address: str = ""
    num_total_blocks: int = 0
    block_size_tokens: int = 0
    block_nbytes: int = 0
    destination: str = ""
    """``DESTINATION``: the ``KvDestination`` proto, base64."""

    def encode(self) -> bytes:
        entry = asdict(self)
        entry["block_crc32s"] = list(self.block_crc32s)
        return json.dumps(entry, separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes) -> ConnectorEvent:
        entry = json.loads(raw)
        entry["kind"] = EventKind(entry["kind"])
        entry["block_crc32s"] = tuple(entry.get("block_crc32s", ()))
        return ConnectorEvent(**entry)


class EventSink:
    """Worker side: sends events to ``path``; with no path, only logs them."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        self.num_dropped = 0

    def emit(self, event: ConnectorEvent) -> None:
        logger.debug("connector event %s", event)
        if self._sock is None:
            return
        raw = event.encode()
        if len(raw) > MAX_EVENT_NBYTES:  # a very long prompt's per-block list: keep the total
            raw = ConnectorEvent(**{**asdict(event), "block_crc32s": ()}).encode()
        try:
            self._sock.sendto(raw, self._path)
        except OSError as exc:
            self.num_dropped += 1
            logger.warning("connector event dropped (%s): %s", self._path, exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, on_event: Callable[[ConnectorEvent], None]) -> None:
        self._on_event = on_event

    def datagram_received(self, data: bytes, addr: object) -> None:
        try:
            event = ConnectorEvent.decode(data)
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("malformed connector event ignored: %s", exc)
            return
        self._on_event(event)


class EventListener:
    """Agent side: receives the worker side's events on a Unix datagram socket at ``path``."""

    def __init__(self, path: str, on_event: Callable[[ConnectorEvent], None]) -> None:
        self.path = path
        self._on_event = on_event
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        sock.bind(self.path)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self._on_event), sock=sock)
        self._transport = transport

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
