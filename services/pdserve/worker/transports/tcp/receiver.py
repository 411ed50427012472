"""Decode side of ``tcp``: accepts senders, validates every frame against the receiver's tickets
and the block owner table before a byte lands, and reads admitted layers straight into the KV
cache."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np

from pdserve.common.errors import IllegalTransitionError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_checksums import LayerCrc, crc_kind_for
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.addresses import format_address
from pdserve.worker.transports.base import KvReceiver
from pdserve.worker.transports.block_views import coalesce_block_runs, layers_block_views
from pdserve.worker.transports.frames import (
    FLAG_BLOCK_IDS_U64,
    FLAG_NO_ACK,
    FRAME_VERSIONS,
    HEADER_NBYTES,
    MIN_FRAME_VERSION,
    DonePayload,
    ErrorPayload,
    FrameError,
    FrameHeader,
    FrameLimits,
    FrameType,
    HelloPayload,
    decode_block_ids,
    decode_header,
    encode_frame,
)
from pdserve.worker.transports.tcp.settings import DEFAULT_TCP_SETTINGS, TcpTransportSettings
from pdserve.worker.transports.tcp.socket_io import SocketIo, tune_socket
from pdserve.worker.transports.tcp.tls_io import TlsSocketIo
from pdserve.worker.transports.values import (
    FrameRefusedError,
    MonotonicClock,
    Rejection,
    RejectReason,
)

logger = logging.getLogger(__name__)

_MAX_SILENCED = 1024
_NO_BLOCK_IDS = np.zeros(0, dtype=np.int64)
_NO_BLOCK_IDS.flags.writeable = False


MAX_TRACKED_CRCS = 4096
"""Tickets whose landed-KV checksum is being built at once (the oldest is dropped past it: its
DONE then computes the checksum whole)."""


def _error_frame(token: FencingToken | None, refused: FrameType | int, layer: int,
                 reason: str, detail: str, version: int = MIN_FRAME_VERSION) -> bytes:
    """An ERROR at ``version``: the refused frame's, or the lowest (every sender reads it)."""
    payload = ErrorPayload(int(refused), reason, detail).encode()
    return encode_frame(FrameType.ERROR, token, layer=layer, payload=payload, version=version)


def _ack_frame(token: FencingToken, answered: FrameHeader) -> bytes:
    """The ACK of ``answered``, at its version (the one its sender speaks)."""
    return encode_frame(FrameType.ACK, token, payload=bytes([int(answered.frame_type)]),
                        version=answered.version)


class _Connection:
    """One accepted connection: the live tickets whose frames it carried (only this connection
    may abort them), and tickets whose NO_ACK HELLO was refused on it (their later frames are
    dropped unanswered: the sender has its ERROR and sent them before reading it)."""

    def __init__(self, io: SocketIo) -> None:
        self.io = io
        self.tokens: set[FencingToken] = set()
        self._silenced: collections.OrderedDict[FencingToken, None] = collections.OrderedDict()
        self._ids_key: tuple[bytes, int] | None = None
        self._ids: np.ndarray = _NO_BLOCK_IDS
        self._runs: list[tuple[int, int]] | None = None

    def decode_block_ids(self, header: FrameHeader, raw: bytearray,
                         limits: FrameLimits) -> np.ndarray:
        """``frames.decode_block_ids``, decoded once for a run of frames naming the same ids
        (every frame of a ticket does). The array is read-only, so the receiver's checks can
        recognise it (``ReceiverTickets._check_blocks``)."""
        key = (bytes(raw), header.flags & FLAG_BLOCK_IDS_U64)
        if key != self._ids_key:
            ids = decode_block_ids(header, raw, limits)
            ids.flags.writeable = False
            self._ids_key, self._ids, self._runs = key, ids, None
        return self._ids

    def block_runs(self, block_ids: np.ndarray) -> list[tuple[int, int]]:
        """``coalesce_block_runs(block_ids)``, computed once for the cached ids."""
        if block_ids is not self._ids:
            return coalesce_block_runs(block_ids)
        if self._runs is None:
            self._runs = coalesce_block_runs(block_ids)
        return self._runs

    def silence(self, token: FencingToken) -> None:
        self._silenced[token] = None
        while len(self._silenced) > _MAX_SILENCED:
            self._silenced.popitem(last=False)

    def is_silenced(self, token: FencingToken | None) -> bool:
        return token is not None and token in self._silenced


class TcpKvReceiver(KvReceiver):
    """Decode side of ``tcp``: accepts senders and lands admitted layers in the KV cache."""

    frame_versions: tuple[int, ...] = FRAME_VERSIONS

    def __init__(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                 clock: MonotonicClock = time.perf_counter,
                 settings: TcpTransportSettings = DEFAULT_TCP_SETTINGS) -> None:
        super().__init__(kv_cache, owner_table, clock)
        layout = kv_cache.layout
        self._settings = settings
        self._limits = FrameLimits(
            block_nbytes=layout.block_nbytes,
            num_blocks=layout.num_blocks,
            max_block_ids=layout.num_blocks,
            max_frame_nbytes=settings.max_frame_nbytes,
            num_layers=layout.num_layers,
        )
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._accept_task: asyncio.Task[None] | None = None
        self._token_to_connection: dict[FencingToken, _Connection] = {}
        self._address = ""
        self.num_accepted = 0
        """Connections accepted since start (senders keep theirs open across tickets)."""
        self.tickets.on_failed = self._on_ticket_failed
        self._crcs: collections.OrderedDict[FencingToken, LayerCrc] = collections.OrderedDict()
        """Version-2 tickets' landed-KV CRC-32, computed as their layers land (DONE checks it)."""

    async def start(self, host: str, port: int) -> str:
        if self._listener is not None:
            raise IllegalTransitionError(f"receiver already started at {self._address}")
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, sockaddr = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune_socket(listener, self._settings)  # accepted sockets inherit the buffer sizes
            listener.bind(sockaddr)
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._address = format_address(host, listener.getsockname()[1])
        self._accept_task = asyncio.create_task(self._accept_loop(), name="kv-tcp-accept")
        logger.info("KV receiver listening on %s", self._address)
        return self._address

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
            self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        while self._tasks:  # failing a ticket may spawn a (doomed) reply task: loop
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for token in self.tickets.active_tokens():
            self.tickets.fail(token, "receiver closed")

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        tls = self._settings.tls
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            self.num_accepted += 1
            tune_socket(sock, self._settings)
            if tls is None:
                io = SocketIo(sock, self._settings)
            else:
                io = TlsSocketIo(sock, self._settings, tls.contexts()[0], tls, server_side=True)
            self._spawn(self._serve(_Connection(io)))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_ticket_failed(self, token: FencingToken, reason: str) -> None:
        """Tell the sender at once (it may stop sending); best effort."""
        self._drop_crc(token)
        connection = self._token_to_connection.get(token)
        if connection is not None:
            self._unbind(connection, token)
            frame = _error_frame(token, 0, 0, reason.partition(":")[0], reason)
            connection.io.write_detached([frame])

    async def _reply(self, connection: _Connection, frame: bytes) -> None:
        try:
            await connection.io.send_views([frame])
        except OSError as exc:
            logger.debug("KV reply lost: %s", exc)

    async def _refused(self, connection: _Connection, header: FrameHeader,
                       rejection: Rejection) -> None:
        await self._reply(connection, _error_frame(
            header.token, header.frame_type, header.layer, rejection.reason, rejection.detail,
            header.version))

    def _bind(self, connection: _Connection, token: FencingToken) -> None:
        connection.tokens.add(token)
        self._token_to_connection[token] = connection

    def _unbind(self, connection: _Connection, token: FencingToken) -> None:
        """The ticket ended: a long-lived connection forgets it."""
        connection.tokens.discard(token)
        if self._token_to_connection.get(token) is connection:
            del self._token_to_connection[token]

    async def _serve(self, connection: _Connection) -> None:
        io = connection.io
        try:
            try:
                await io.handshake(self._settings.connect_timeout_s)
            except (ssl.SSLError, TimeoutError) as exc:
                logger.warning("KV connection refused: TLS handshake failed: %s", exc)
                return
            while True:
                raw = await io.recv_exact(HEADER_NBYTES, is_eof_ok=True)
                if raw is None:
                    break
                try:
                    header = decode_header(raw, self._limits)
                except FrameError as exc:
                    rejection = self.tickets.refuse(None, "?", 0, RejectReason.MALFORMED_FRAME,
                                                    exc.message)
                    await self._reply(connection, _error_frame(
                        None, 0, 0, rejection.reason, rejection.detail))
                    break  # the stream cannot be trusted past a bad header
                if not await self._dispatch(connection, header):
                    break
        except (ConnectionError, OSError) as exc:
            logger.debug("KV connection lost: %s", exc)
        finally:
            for token in connection.tokens:
                if self._token_to_connection.get(token) is connection:
                    del self._token_to_connection[token]
                self.tickets.fail(token, "connection lost")
            io.close()

    async def _dispatch(self, connection: _Connection, header: FrameHeader) -> bool:
        """Handle one frame whose header is read; False ends the connection."""
        io = connection.io
        token = header.token
        if connection.is_silenced(token):
            await io.discard(header.block_ids_nbytes + header.payload_nbytes)
            return True
        block_ids = _NO_BLOCK_IDS
        if header.num_block_ids:
            raw_ids = await io.recv_exact(header.block_ids_nbytes)
            assert raw_ids is not None
            try:
                block_ids = connection.decode_block_ids(header, raw_ids, self._limits)
            except FrameError as exc:
                rejection = self.tickets.refuse(token, header.frame_type.name, header.layer,
                                                RejectReason.MALFORMED_FRAME, exc.message)
                await io.discard(header.payload_nbytes)
                await self._refused(connection, header, rejection)
                return True
        if header.frame_type in (FrameType.LAYER, FrameType.LAYERS):
            assert token is not None
            await self._on_layers(connection, header, token, block_ids)
            return True
        payload = await io.recv_exact(header.payload_nbytes)
        assert payload is not None
        match header.frame_type:
            case FrameType.HELLO:
                assert token is not None
                hello = HelloPayload.decode(payload)
                try:
                    self.tickets.admit_hello(token, block_ids, hello.num_layers,
                                             hello.block_size_tokens, hello.block_nbytes)
                except FrameRefusedError as exc:
                    if header.flags & FLAG_NO_ACK:
                        connection.silence(token)
                    await self._refused(connection, header, exc.rejection)
                    return True
                self._bind(connection, token)
                if header.version >= 2:
                    self._track_crc(token, block_ids, header.version)
                if not header.flags & FLAG_NO_ACK:
                    await self._reply(connection, _ack_frame(token, header))
            case FrameType.DONE:
                assert token is not None
                done = DonePayload.decode(payload, header.flags)
                crc = self._crcs.pop(token, None)
                landed = (await crc.result() if crc is not None and done.kv_crc32 is not None
                          and self.tickets.is_live(token) else None)
                try:
                    self.tickets.admit_done(token, done.first_token_id, done.prefill_compute_s,
                                            done.num_layers, frame_version=header.version,
                                            kv_crc32=done.kv_crc32, landed_kv_crc32=landed)
                except FrameRefusedError as exc:
                    await self._refused(connection, header, exc.rejection)
                    return True
                self._unbind(connection, token)
                await self._reply(connection, _ack_frame(token, header))
            case FrameType.ABORT:
                assert token is not None
                reason = bytes(payload).decode("utf-8", errors="replace")
                if token in connection.tokens:
                    self.tickets.fail(token, f"aborted by sender: {reason}")
                elif self.tickets.is_live(token):  # only the connection carrying it may abort it
                    self.tickets.refuse(None, "ABORT", 0, RejectReason.PROTOCOL,
                                        f"ABORT for {token} from a connection not carrying it")
                # else: the ticket has ended (or never was): nothing to abort
            case _:
                self.tickets.refuse(token, header.frame_type.name, 0, RejectReason.PROTOCOL,
                                    "senders do not send ACK or ERROR")
                return False
        return True

    async def _on_layers(self, connection: _Connection, header: FrameHeader, token: FencingToken,
                         block_ids: np.ndarray) -> None:
        """A LAYER or LAYERS frame: one admission for all its layers, then one scatter read."""
        num_layers = header.num_layers(self._limits.block_nbytes)
        try:
            admission = self.tickets.admit_layers(token, header.layer, num_layers, block_ids,
                                                  frame=header.frame_type.name)
        except FrameRefusedError as exc:
            await connection.io.discard(header.payload_nbytes)
            await self._refused(connection, header, exc.rejection)
            return
        self._bind(connection, token)
        views = layers_block_views(self.kv_cache, range(header.layer, header.layer + num_layers),
                                   block_ids, connection.block_runs(block_ids))
        if await connection.io.recv_into_views(views, admission.still_writable):
            self.tickets.layer_landed(admission, header.payload_nbytes)
            crc = self._crcs.get(token)
            if crc is not None:
                crc.add(header.layer, num_layers, block_ids)

    def _track_crc(self, token: FencingToken, block_ids: np.ndarray, version: int) -> None:
        """Checksum the ticket's layers as they land, in the algorithm of its frames' version."""
        self._drop_crc(token)
        while len(self._crcs) >= MAX_TRACKED_CRCS:
            self._crcs.popitem(last=False)[1].close()
        self._crcs[token] = LayerCrc(self.kv_cache, block_ids, kind=crc_kind_for(version))

    def _drop_crc(self, token: FencingToken) -> None:
        crc = self._crcs.pop(token, None)
        if crc is not None:
            crc.close()


