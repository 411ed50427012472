"""What the connector's worker side tells the agent: one Unix datagram per event.

vLLM returns nothing from the worker process that a sidecar could read in time: a prefill
request's output is emitted before its KV has been sent, and the counters of refused frames live
only in the worker. So the worker side sends small JSON datagrams (``ConnectorEvent``) to a
socket the agent listens on (``ConnectorSettings.events_path``). Datagrams need no framing and die
with the machine: the channel is local by construction. Linux queues only
``net.unix.max_dgram_qlen`` datagrams per listener (10 by default), fewer than a burst of
handoffs emits while the agent's loop is busy, so a sender waits (up to ``EMIT_TIMEOUT_S``) for
room rather than drop an event the agent needs (a lost ``SENT`` would fail its handoff); a
missing listener, or one that stays full that long, drops the event, which is logged.

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
EMIT_TIMEOUT_S = 2.0
"""Longest a sender waits for room in a full listener's queue."""


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
    definition (every layer of the handoff's blocks, layer-major, blocks in sequence order; a
    CRC-32C where the handoff ran at tcp frame version 3, on both sides alike);
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
    layer_computed_s: tuple[float, ...] = ()
    """``SENT``: per layer, when its prompt KV was final (``worker_side.LayerTimeline``)."""
    layer_sent_s: tuple[float, ...] = ()
    """``SENT``: per layer, when the transport had taken its last blocks."""
    done_s: float = 0.0
    """``SENT``: when the receiver acknowledged DONE."""
    exposed_s: float = 0.0
    """``SENT``: DONE's acknowledgement minus the end of prefill compute."""

    def encode(self) -> bytes:
        entry = asdict(self)
        for name in _TUPLE_FIELDS:
            entry[name] = list(getattr(self, name))
        return json.dumps(entry, separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes) -> ConnectorEvent:
        entry = json.loads(raw)
        entry["kind"] = EventKind(entry["kind"])
        for name in _TUPLE_FIELDS:
            entry[name] = tuple(entry.get(name, ()))
        return ConnectorEvent(**entry)


_TUPLE_FIELDS = ("block_crc32s", "layer_computed_s", "layer_sent_s")


class EventSink:
    """Worker side: sends events to ``path``; with no path, only logs them."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.settimeout(EMIT_TIMEOUT_S)  # blocks only while the queue is full
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
