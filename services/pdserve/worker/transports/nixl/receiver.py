"""Decode side of ``nixl``: a control socket for the senders' announcements, and NIXL READs of
each admitted layer into blocks the receiver picked (the pull model: only the decode side ever
writes into its memory)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.common.errors import IllegalTransitionError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.addresses import format_address
from pdserve.worker.transports.base import KvReceiver
from pdserve.worker.transports.nixl.agent import NixlAgent, read_descriptors
from pdserve.worker.transports.nixl.control import (
    FORMAT_VERSION,
    MAX_TEXT_NBYTES,
    ControlError,
    Hello,
    Kind,
    decode_done,
    decode_layer,
    encode_message,
    error_body,
    max_message_nbytes,
    read_message,
)
from pdserve.worker.transports.nixl.settings import DEFAULT_NIXL_SETTINGS, NixlTransportSettings
from pdserve.worker.transports.receiver_tickets import LayerAdmission
from pdserve.worker.transports.values import FrameRefusedError, MonotonicClock, RejectReason

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a ticket's layers are read from: the sender's agent and its layer buffers."""

    agent_name: str
    base_addresses: np.ndarray
    num_blocks: int
    memory_kind: str = "DRAM"
    """NIXL memory type of the sender's layers (host or a GPU's)."""
    device_id: int = 0


@dataclass(eq=False)
class _Read:
    """One posted READ of one admitted layer. ``is_ended``: no byte of it moves any more
    (completed, failed, or cancelled by NIXL, ``is_cancelled``)."""

    admission: LayerAdmission
    handle: Any
    status: str = "PROC"
    is_ended: bool = False
    is_cancelled: bool = False

    @property
    def token(self) -> FencingToken:
        return self.admission.token

    def try_cancel(self) -> bool:
        try:
            self.handle.release()
        except Exception:  # noqa: BLE001 - NIXL could not cancel it (yet)
            return False
        self.is_cancelled = True
        self.is_ended = True
        self.status = "CANCELLED"
        return True


@dataclass(eq=False)
class _Connection:
    """One sender's control connection. LAYER and DONE messages wait in ``ordered`` for the
    connection's worker, which posts each layer's READ without waiting for the previous one to
    finish (``pending``, polled by one poller task) and holds DONE until the ticket's READs have
    ended; HELLO and ABORT act at once, so an ABORT stops READs that wait for a sender that has
    gone quiet."""

    writer: asyncio.StreamWriter
    sources: dict[FencingToken, _Source] = field(default_factory=dict)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ordered: asyncio.Queue[tuple[Kind, FencingToken | None, bytes]] = field(
        default_factory=asyncio.Queue)
    pending: list[_Read] = field(default_factory=list)
    read_ended: asyncio.Event = field(default_factory=asyncio.Event)
    poller: asyncio.Task[None] | None = None


class NixlKvReceiver(KvReceiver):
    """Decode side of ``nixl``: a control socket for announcements, NIXL READs for the KV."""

    frame_versions: tuple[int, ...] = (FORMAT_VERSION,)
    """The control socket's message format (its own numbering: ``nixl.control``)."""

    def __init__(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                 clock: MonotonicClock = time.perf_counter,
                 settings: NixlTransportSettings = DEFAULT_NIXL_SETTINGS) -> None:
        super().__init__(kv_cache, owner_table, clock)
        self._settings = settings
        layout = kv_cache.layout
        self._max_body_nbytes = max_message_nbytes(layout.num_blocks, layout.num_layers)
        self._agent: NixlAgent | None = None
        self._server: asyncio.Server | None = None
        self._address = ""
        self._connections: set[_Connection] = set()
        self._token_to_connection: dict[FencingToken, _Connection] = {}
        self._inflight: dict[int, _Read] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_reads = 0
        self.tickets.on_failed = self._on_ticket_failed

    @property
    def agent_name(self) -> str:
        return self._agent.name if self._agent is not None else ""

    async def start(self, host: str, port: int) -> str:
        if self._server is not None:
            raise IllegalTransitionError(f"receiver already started at {self._address}")
        self._agent = NixlAgent(self.kv_cache, "recv")
        self._server = await asyncio.start_server(self._serve, host, port)
        bound_port = self._server.sockets[0].getsockname()[1]
        self._address = format_address(host, bound_port)
        logger.info("NIXL KV receiver %s, control socket %s", self._agent.name, self._address)
        return self._address

    async def close(self) -> None:
        for token in self.tickets.active_tokens():
            self.tickets.fail(token, "receiver closed")
        for read in list(self._inflight.values()):
            self._quiesce(read.token)
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.writer.close()  # its handler sees EOF and ends
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
        if self._agent is not None:
            self._agent.close()

    def cancel(self, token: FencingToken, reason: str) -> None:
        """See ``KvReceiver.cancel``; also waits for a READ of ``token`` in flight to end."""
        super().cancel(token, reason)
        self._quiesce(token)

    def _quiesce(self, token: FencingToken) -> None:
        """End ``token``'s READs in flight (if any) before returning, blocking for a layer at
        most: drive each for up to ``quiesce_spin_s``, then ask NIXL to cancel it (release);
        if NIXL cannot, keep driving it until ``quiesce_timeout_s``."""
        if self._agent is None:
            return
        agent = self._agent.agent
        started = time.monotonic()
        for read in list(self._inflight.values()):
            if read.token != token or read.is_ended:
                continue
            while not read.is_ended:
                read.status = agent.check_xfer_state(read.handle)
                read.is_ended = read.status != "PROC"
                waited_s = time.monotonic() - started
                if not read.is_ended and waited_s > self._settings.quiesce_spin_s:
                    if read.try_cancel():
                        break
                    if waited_s > self._settings.quiesce_timeout_s:
                        logger.error("READ of %s still in flight after %.1f s", token, waited_s)
                        return

    # -- connections --

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        connection = _Connection(writer)
        self._connections.add(connection)
        worker = asyncio.create_task(self._work(connection), name="nixl-reads")
        try:
            while not worker.done():
                try:
                    message = await read_message(reader, self._max_body_nbytes)
                except ControlError as exc:
                    rejection = self.tickets.refuse(None, "?", 0, RejectReason.MALFORMED_FRAME,
                                                    str(exc))
                    await self._reply(connection, encode_message(
                        Kind.ERROR, None, error_body(0, rejection.reason, rejection.detail)))
                    break
                if message is None:
                    break
                if message[0] in (Kind.LAYER, Kind.DONE):
                    connection.ordered.put_nowait(message)
                elif not await self._dispatch(connection, *message):
                    break
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            logger.debug("NIXL control connection lost: %s", exc)
        finally:
            self._connections.discard(connection)
            for token in connection.sources:
                if self._token_to_connection.get(token) is connection:
                    del self._token_to_connection[token]
                self.tickets.fail(token, "connection lost")
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            if connection.poller is not None:
                connection.poller.cancel()
                await asyncio.gather(connection.poller, return_exceptions=True)
            writer.close()

    async def _work(self, connection: _Connection) -> None:
        """Ordered messages of one connection. At EOF the reader cancels this: a sender that
        closed before DONE's ACK has failed (its READs may never complete)."""
        while True:
            kind, token, body = await connection.ordered.get()
            if not await self._dispatch(connection, kind, token, body):
                return

    async def _reply(self, connection: _Connection, message: bytes) -> None:
        try:
            async with connection.write_lock:
                connection.writer.write(message)
                await connection.writer.drain()
        except (ConnectionError, OSError) as exc:
            logger.debug("NIXL control reply lost: %s", exc)

    async def _refused(self, connection: _Connection, kind: int, token: FencingToken | None,
                       exc: FrameRefusedError) -> None:
        rejection = exc.rejection
        await self._reply(connection, encode_message(
            Kind.ERROR, token, error_body(kind, rejection.reason, rejection.detail)))

    def _on_ticket_failed(self, token: FencingToken, reason: str) -> None:
        """Tell the sender at once (it can stop computing); best effort."""
        connection = self._token_to_connection.get(token)
        if connection is not None:
            body = error_body(0, reason.partition(":")[0], reason)
            self._spawn(self._reply(connection, encode_message(Kind.ERROR, token, body)))

    async def _dispatch(self, connection: _Connection, kind: int, token: FencingToken | None,
                        body: bytes) -> bool:
        """Handle one message; False ends the connection."""
        assert token is not None or kind in (Kind.ACK, Kind.ERROR)
        try:
            if kind == Kind.HELLO:
                assert token is not None
                self._on_hello(connection, token, body)
                await self._reply(connection, encode_message(Kind.ACK, token, bytes([Kind.HELLO])))
            elif kind == Kind.LAYER:
                assert token is not None
                await self._on_layer(connection, token, body)
            elif kind == Kind.DONE:
                assert token is not None
                first_token_id, prefill_compute_s, num_layers = decode_done(body)
                while any(read.token == token for read in connection.pending):
                    connection.read_ended.clear()
                    await connection.read_ended.wait()
                self.tickets.admit_done(token, first_token_id, prefill_compute_s, num_layers)
                await self._reply(connection, encode_message(Kind.ACK, token, bytes([Kind.DONE])))
            elif kind == Kind.ABORT:
                assert token is not None
                reason = body[:MAX_TEXT_NBYTES].decode("utf-8", errors="replace")
                if token in connection.sources:
                    self.tickets.fail(token, f"aborted by sender: {reason}")
                else:  # only the connection that introduced a ticket may abort it
                    self.tickets.refuse(None, "ABORT", 0, RejectReason.PROTOCOL,
                                        f"ABORT for {token} from a connection not carrying it")
            else:
                self.tickets.refuse(token, Kind(kind).name, 0, RejectReason.PROTOCOL,
                                    "senders do not send ACK or ERROR")
                return False
        except FrameRefusedError as exc:
            await self._refused(connection, kind, token, exc)
        except ControlError as exc:
            rejection = self.tickets.refuse(token if token in connection.sources else None,
                                            Kind(kind).name, 0, RejectReason.MALFORMED_FRAME,
                                            str(exc))
            await self._reply(connection, encode_message(
                Kind.ERROR, token, error_body(kind, rejection.reason, rejection.detail)))
        return True

    def _on_hello(self, connection: _Connection, token: FencingToken, body: bytes) -> None:
        layout = self.kv_cache.layout
        try:
            hello = Hello.decode(body, layout.num_blocks, layout.num_layers)
        except (ControlError, UnicodeDecodeError) as exc:
            raise FrameRefusedError(self.tickets.refuse(
                None, "HELLO", 0, RejectReason.MALFORMED_FRAME, str(exc))) from None
        self.tickets.admit_hello(token, hello.dst_block_ids, hello.num_layers,
                                 hello.block_size_tokens, hello.block_nbytes)
        assert self._agent is not None
        try:
            self._agent.add_remote(hello.agent_name, hello.metadata)
        except ControlError as exc:
            raise FrameRefusedError(self.tickets.refuse(
                token, "HELLO", 0, RejectReason.PROTOCOL, str(exc))) from None
        connection.sources[token] = _Source(hello.agent_name, hello.base_addresses,
                                            hello.src_num_blocks, hello.memory_kind,
                                            hello.device_id)
        self._token_to_connection[token] = connection

    async def _on_layer(self, connection: _Connection, token: FencingToken, body: bytes) -> None:
        layer, dst_ids, src_ids = decode_layer(body, self.kv_cache.layout.num_blocks)
        source = connection.sources.get(token)
        if source is None:  # not this connection's ticket: record, fail nothing
            raise FrameRefusedError(self.tickets.refuse(
                None, "LAYER", layer, RejectReason.PROTOCOL,
                f"LAYER for {token} before its HELLO on this connection"))
        if np.unique(dst_ids).size != dst_ids.size or int(src_ids.max()) >= source.num_blocks:
            raise FrameRefusedError(self.tickets.refuse(
                token, "LAYER", layer, RejectReason.MALFORMED_FRAME,
                "destination ids repeat or source ids exceed the sender's cache"))
        admission = self.tickets.admit_layer(token, layer, dst_ids)
        if layer >= source.base_addresses.size:
            raise FrameRefusedError(self.tickets.refuse(
                token, "LAYER", layer, RejectReason.LAYER_OUT_OF_RANGE, "sender has no such layer"))
        self._post_read(connection, admission, source, src_ids)

    def _post_read(self, connection: _Connection, admission: LayerAdmission, source: _Source,
                   src_ids: np.ndarray) -> None:
        """Post the READ of one admitted layer into its blocks; the poller finishes it."""
        assert self._agent is not None
        agent = self._agent.agent
        if not admission.still_writable():
            return
        local, remote = read_descriptors(self._agent, admission.layer, admission.block_ids,
                                         int(source.base_addresses[admission.layer]), src_ids,
                                         source.device_id)
        try:
            handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, self._agent.memory_kind),
                agent.get_xfer_descs(remote, source.memory_kind), source.agent_name)
        except Exception as exc:  # noqa: BLE001 - NIXL refuses unregistered source ranges here
            raise FrameRefusedError(self.tickets.refuse(
                admission.token, "LAYER", admission.layer, RejectReason.MALFORMED_FRAME,
                f"NIXL refused the READ: {type(exc).__name__} {exc}")) from None
        read = _Read(admission, handle)
        self._inflight[id(read)] = read
        connection.pending.append(read)
        read.status = agent.transfer(handle)
        read.is_ended = read.status != "PROC"
        if read.is_ended:
            self._end_read(connection, read)
        elif connection.poller is None or connection.poller.done():
            connection.poller = asyncio.create_task(self._poll_reads(connection),
                                                    name="nixl-read-poller")

    async def _poll_reads(self, connection: _Connection) -> None:
        """Drive the connection's READs until none is pending (spin, then back off)."""
        assert self._agent is not None
        agent = self._agent.agent
        polls = 0
        try:
            while connection.pending:
                for read in list(connection.pending):
                    if not read.is_ended and read.admission.ticket.state.is_terminal:
                        self._quiesce(read.token)  # failed or cancelled: end it now
                    if not read.is_ended:
                        read.status = agent.check_xfer_state(read.handle)
                        read.is_ended = read.status != "PROC"
                    if read.is_ended:
                        self._end_read(connection, read)
                if connection.pending:
                    polls += 1
                    await asyncio.sleep(0 if polls < self._settings.read_spin_polls
                                        else self._settings.read_poll_interval_s)
        finally:  # cancelled (connection gone, receiver closing): no READ may outlive us
            for read in list(connection.pending):
                self._quiesce(read.token)
                self._end_read(connection, read)

    def _end_read(self, connection: _Connection, read: _Read) -> None:
        """An ended READ: land it if it completed and the ticket still owns the blocks."""
        connection.pending.remove(read)
        self._inflight.pop(id(read), None)
        connection.read_ended.set()
        if not read.is_cancelled:
            with contextlib.suppress(Exception):
                read.handle.release()
        self.num_reads += 1
        admission = read.admission
        if read.status != "DONE" or not read.is_ended:
            self.tickets.fail(read.token,
                              f"NIXL READ of layer {admission.layer} failed ({read.status})")
        elif admission.still_writable():
            num_bytes = admission.block_ids.size * self.kv_cache.layout.block_nbytes
            self.tickets.layer_landed(admission, num_bytes)

