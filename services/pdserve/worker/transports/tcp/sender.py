"""Prefill side of ``tcp``: one shared connection per (sender process, destination), and the
per-ticket sender that writes its frames on it, source blocks gathered straight from the cache."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
import time
import weakref
from collections.abc import Sequence

import numpy as np

from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_checksums import LayerCrc, crc_kind_for
from pdserve.worker.transports.addresses import parse_address
from pdserve.worker.transports.base import KvSender
from pdserve.worker.transports.block_views import coalesce_block_runs, layers_block_views
from pdserve.worker.transports.frames import (
    FLAG_NO_ACK,
    HEADER_NBYTES,
    DonePayload,
    EncodedBlockIds,
    ErrorPayload,
    FrameError,
    FrameLimits,
    FrameType,
    HelloPayload,
    decode_header,
    encode_frame,
    layer_frame_prefix,
    negotiate_frame_version,
)
from pdserve.worker.transports.tcp.settings import DEFAULT_TCP_SETTINGS, TcpTransportSettings
from pdserve.worker.transports.tcp.socket_io import SocketIo, tune_socket
from pdserve.worker.transports.tcp.tls_io import TlsSocketIo
from pdserve.worker.transports.values import (
    KvDestinationSpec,
    MonotonicClock,
    TransferResult,
)


class _ConnectError(Exception):
    """Connecting (or the TLS handshake) failed; the message says so."""


_REPLY_LIMITS = FrameLimits(block_nbytes=1, num_blocks=1)
"""Replies (ACK, ERROR) name no blocks; anything else from a receiver ends the connection."""


class _SenderConnection:
    """One connection from this process to one receiver, shared by the tickets sent there.

    Frames of different tickets go out whole (``SocketIo.write``); one reader task routes the
    receiver's replies to the ticket they name. Unused for ``idle_close_s`` it closes; a broken
    or closed connection fails the tickets still on it and leaves the pool, so the next ticket
    connects anew.
    """

    def __init__(self, pool: _SenderPool, key: tuple[object, ...], io: SocketIo,
                 settings: TcpTransportSettings) -> None:
        self._pool = pool
        self._key = key
        self.io = io
        self._idle_close_s = settings.idle_close_s
        self._senders: dict[FencingToken, TcpKvSender] = {}
        self._idle_timer: asyncio.TimerHandle | None = None
        self.is_closed = False
        self._reader = asyncio.get_running_loop().create_task(
            self._read_replies(), name=f"kv-tcp-replies-{key[0]}")
        self._arm_idle_timer()

    @property
    def num_senders(self) -> int:
        return len(self._senders)

    def attach(self, token: FencingToken, sender: TcpKvSender) -> bool:
        """Route ``token``'s replies to ``sender``; False if another sender has that token."""
        if token in self._senders:
            return False
        self._senders[token] = sender
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        return True

    def detach(self, token: FencingToken, sender: TcpKvSender) -> None:
        if self._senders.get(token) is sender:
            del self._senders[token]
        if not self._senders:
            self._arm_idle_timer()

    def close(self) -> None:
        """Close now; tickets still on it fail."""
        self._reader.cancel()
        self._shut("connection closed by the sender")

    def _arm_idle_timer(self) -> None:
        if not self.is_closed and self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(
                self._idle_close_s, self._close_if_idle)

    def _close_if_idle(self) -> None:
        self._idle_timer = None
        if not self._senders:
            self.close()

    async def _read_replies(self) -> None:
        error = "connection closed by the receiver"
        try:
            while True:
                raw = await self.io.recv_exact(HEADER_NBYTES, is_eof_ok=True)
                if raw is None:
                    break
                header = decode_header(raw, _REPLY_LIMITS)
                if header.frame_type not in (FrameType.ACK, FrameType.ERROR):
                    error = f"receiver sent a {header.frame_type.name} frame"
                    break
                payload = await self.io.recv_exact(header.payload_nbytes)
                assert payload is not None
                if header.token is None:  # about no ticket: the receiver is closing on us
                    if header.frame_type is FrameType.ERROR:
                        refusal = ErrorPayload.decode(payload)
                        error = f"refused: {refusal.detail or refusal.reason}"
                        break
                    continue
                sender = self._senders.get(header.token)
                if sender is None:
                    continue  # a ticket that ended here already
                if header.frame_type is FrameType.ACK:
                    sender._on_ack(payload[0])
                else:
                    refusal = ErrorPayload.decode(payload)
                    sender._on_refused(f"refused: {refusal.detail or refusal.reason}")
        except (FrameError, ConnectionError, OSError) as exc:
            error = f"connection lost: {exc}"
        except asyncio.CancelledError:
            error = "connection closed by the sender"
            raise
        finally:
            self._shut(error)

    def _shut(self, error: str) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._pool.forget(self._key, self)
        self.io.close()
        senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender._on_connection_lost(error)


class _SenderPool:
    """The connections of one event loop, by (address, settings, TLS context)."""

    def __init__(self) -> None:
        self._connections: dict[tuple[object, ...], _SenderConnection] = {}
        self._connecting: dict[tuple[object, ...], asyncio.Future[_SenderConnection]] = {}

    async def connection(self, address: str, settings: TcpTransportSettings) -> _SenderConnection:
        """A live connection to ``address``, opened if needed (concurrent callers share one
        attempt). Raises ``_ConnectError``."""
        tls = settings.tls
        context = tls.contexts()[1] if tls is not None else None
        key = (address, settings, context)  # a renewed certificate starts new connections
        connection = self._connections.get(key)
        if connection is not None and not connection.is_closed:
            return connection
        attempt = self._connecting.get(key)
        if attempt is None:
            attempt = asyncio.ensure_future(self._connect(key, address, settings, context))
            self._connecting[key] = attempt
            attempt.add_done_callback(lambda done: self._connect_done(key, done))
        return await asyncio.shield(attempt)

    def _connect_done(self, key: tuple[object, ...],
                      attempt: asyncio.Future[_SenderConnection]) -> None:
        if self._connecting.get(key) is attempt:
            del self._connecting[key]
        if not attempt.cancelled():
            attempt.exception()  # retrieved: every waiter may have been cancelled

    async def _connect(self, key: tuple[object, ...], address: str,
                       settings: TcpTransportSettings,
                       context: ssl.SSLContext | None) -> _SenderConnection:
        host, port = parse_address(address)
        try:
            sock = await asyncio.wait_for(_open_socket(host, port, settings),
                                          settings.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise _ConnectError(f"cannot connect to {address}: {exc or 'timeout'}") from None
        if context is None:
            io = SocketIo(sock, settings)
        else:
            assert settings.tls is not None
            io = TlsSocketIo(sock, settings, context, settings.tls, server_side=False,
                              server_hostname=host)
            try:
                await io.handshake(settings.connect_timeout_s)
            except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
                io.close()
                raise _ConnectError(
                    f"TLS handshake with {address} failed: {exc or 'timeout'}") from None
            except BaseException:
                io.close()
                raise
        connection = _SenderConnection(self, key, io, settings)
        self._connections[key] = connection
        return connection

    def forget(self, key: tuple[object, ...], connection: _SenderConnection) -> None:
        if self._connections.get(key) is connection:
            del self._connections[key]

    def close_all(self) -> None:
        for connection in list(self._connections.values()):
            connection.close()


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _SenderPool] = (
    weakref.WeakKeyDictionary())


def _pool() -> _SenderPool:
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = _SenderPool()
    return pool


def close_sender_connections() -> None:
    """Close every pooled sender connection of the running loop (tickets still on them fail)."""
    _pool().close_all()


async def _open_socket(host: str, port: int, settings: TcpTransportSettings) -> socket.socket:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        tune_socket(sock, settings)
        await loop.sock_connect(sock, sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


def _layer_runs(layers: Sequence[int], layer_nbytes: int, max_frame_nbytes: int
                ) -> list[tuple[int, int]]:
    """``[(first_layer, num_layers), ...]``: runs of consecutive layers in offer order, each at
    most ``max_frame_nbytes`` of payload unless it is a single layer."""
    runs: list[list[int]] = []
    for layer in layers:
        if (runs and runs[-1][0] + runs[-1][1] == layer
                and (runs[-1][1] + 1) * layer_nbytes <= max_frame_nbytes):
            runs[-1][1] += 1
        else:
            runs.append([layer, 1])
    return [(first, count) for first, count in runs]


class TcpKvSender(KvSender):
    """Prefill side of ``tcp``: frames of one ticket on this process's shared connection to the
    receiver, source blocks gathered straight from the cache.

    ``open`` sends HELLO and returns without waiting for an answer (NO_ACK): the layers follow
    at once. A refusal arrives as an ERROR; from then on ``offer_layer`` and ``finish`` raise.
    Every frame of the ticket goes at the version negotiated with the destination's
    ``frame_versions``; at version 2 DONE carries the CRC-32 of the KV sent, at version 3 its
    CRC-32C.
    """

    def __init__(self, kv_cache: KvCache, clock: MonotonicClock = time.perf_counter,
                 settings: TcpTransportSettings = DEFAULT_TCP_SETTINGS) -> None:
        super().__init__(kv_cache, clock)
        self._settings = settings
        self._connection: _SenderConnection | None = None
        self._done_reply: asyncio.Future[str | None] | None = None
        self._is_settled = False
        """The receiver told this ticket's outcome (ACK of DONE, ERROR) or the link is gone."""
        self._dst_ids: np.ndarray | None = None
        self._dst_wire: EncodedBlockIds | None = None
        self._src_key: tuple[int, ...] = ()
        self._src_ids: np.ndarray | None = None
        self._src_runs: list[tuple[int, int]] = []
        self._version = 1
        self._src_of_dst: dict[int, int] = {}
        """Destination block id -> the source block offered for it (for DONE's CRC-32)."""
        self._mapped: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._crc: LayerCrc | None = None
        """DONE's CRC-32 (version 2), computed as the layers go (when each names every block)."""

    @property
    def frame_version(self) -> int:
        """The version this ticket's frames are written at (known once ``open`` ran)."""
        return self._version

    async def open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        self._check_open(dest, token)
        self._version = negotiate_frame_version(dest.frame_versions)
        try:
            connection = await _pool().connection(dest.kv_address, self._settings)
        except _ConnectError as exc:
            self._fail(str(exc))
            self._raise_failed()
        if not connection.attach(token, self):
            self._fail(f"{token} is being sent to {dest.kv_address} already")
            self._raise_failed()
        self._connection = connection
        self._done_reply = asyncio.get_running_loop().create_future()
        self._dst_ids = np.asarray(dest.block_ids, dtype=np.int64)
        self._dst_wire = EncodedBlockIds.of(self._dst_ids)
        layout = self.kv_cache.layout
        hello = HelloPayload(layout.num_layers, layout.block_size_tokens, layout.block_nbytes)
        await self._send([encode_frame(FrameType.HELLO, token, block_ids=self._dst_ids,
                                       payload=hello.encode(), flags=FLAG_NO_ACK,
                                       version=self._version)])

    async def offer_layer(
        self, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int] | None = None
    ) -> None:
        await self.offer_layers((layer,), src_block_ids, dst_block_ids)

    async def offer_layers(
        self, layers: Sequence[int], src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        """One write for all of ``layers``: a LAYERS frame per run of consecutive layers (at most
        ``multi_layer_frame_nbytes`` each), a LAYER frame for a lone layer."""
        offers = self._make_offers(layers, src_block_ids, dst_block_ids)
        if not offers:
            return
        assert self._token is not None
        dst_wire = (self._dst_wire if dst_block_ids is None
                    else EncodedBlockIds.of(offers[0].dst_block_ids))
        assert dst_wire is not None
        if offers[0].src_block_ids != self._src_key:  # the same blocks, layer after layer
            self._src_key = offers[0].src_block_ids
            self._src_ids = np.asarray(self._src_key, dtype=np.int64)
            self._src_runs = coalesce_block_runs(self._src_ids)
        src_ids = self._src_ids
        assert src_ids is not None
        runs = _layer_runs(layers, len(src_ids) * self.kv_cache.layout.block_nbytes,
                           self._settings.multi_layer_frame_nbytes)
        if self._version >= 2:
            self._map_blocks(offers[0].src_block_ids, offers[0].dst_block_ids)
            assert self._dest is not None
            if self._crc is None:
                self._crc = LayerCrc(self.kv_cache, src_ids, kind=crc_kind_for(self._version))
            is_whole = offers[0].dst_block_ids == tuple(self._dest.block_ids)
            for first, count in runs:
                # Source blocks in destination order, as kv_checksum takes them; else the CRC
                # is computed whole at DONE.
                self._crc.add(first, count, src_ids if is_whole else ())
        block_nbytes = self.kv_cache.layout.block_nbytes
        views: list[bytes | memoryview] = []
        for first, count in runs:
            views.append(layer_frame_prefix(self._token, first, dst_wire, block_nbytes, count,
                                            self._version))
            views.extend(layers_block_views(self.kv_cache, range(first, first + count), src_ids,
                                            self._src_runs))
        await self._send(views)
        for offer in offers:
            self._offered(offer)

    def _map_blocks(self, src_block_ids: tuple[int, ...], dst_block_ids: tuple[int, ...]) -> None:
        """Remember which source block went to which destination block (once per distinct
        pair of lists: every layer of a ticket names the same ones)."""
        if self._mapped != (src_block_ids, dst_block_ids):
            self._mapped = (src_block_ids, dst_block_ids)
            self._src_of_dst.update(zip(dst_block_ids, src_block_ids, strict=True))

    async def _sent_kv_crc32(self) -> int | None:
        """``kv_checksum`` of the source blocks in destination order; None unless every
        destination block was offered (the receiver refuses such a DONE anyway)."""
        assert self._dest is not None
        try:
            src_ids = [self._src_of_dst[block_id] for block_id in self._dest.block_ids]
        except KeyError:
            return None
        crc = self._crc or LayerCrc(self.kv_cache, src_ids, kind=crc_kind_for(self._version))
        self._crc = None
        return await crc.result(src_ids)

    async def finish(self, first_token_id: int, prefill_compute_s: float) -> TransferResult:
        if self._state.is_terminal or self._done_reply is None:
            self._raise_failed()
        kv_crc32 = await self._sent_kv_crc32() if self._version >= 2 else None
        if self._state.is_terminal:  # failed (an ERROR, the link) while the CRC was computed
            self._raise_failed()
        done = DonePayload(first_token_id, prefill_compute_s, len(self._offered_layers), kv_crc32)
        await self._send([encode_frame(FrameType.DONE, self._token, payload=done.encode(),
                                       flags=done.flags, version=self._version)])
        assert self._done_reply is not None
        await self._await_reply(self._done_reply, self._settings.reply_timeout_s)
        result = self._succeeded(first_token_id, prefill_compute_s)
        return dataclasses.replace(result, frame_version=self._version, kv_crc32=kv_crc32)

    async def abort(self, reason: str) -> None:
        if not self._state.is_terminal:
            self._fail(f"aborted: {reason}")
            self._send_abort(reason)
        await self.close()

    async def close(self) -> None:
        if self._crc is not None:
            self._crc.close()
            self._crc = None
        self._fail("closed before finish")
        self._send_abort("sender closed before finish")
        connection, self._connection = self._connection, None
        if connection is not None:
            assert self._token is not None
            connection.detach(self._token, self)

    def _send_abort(self, reason: str) -> None:
        """Tell the receiver, unless it knows already (ABORT goes behind this ticket's frames)."""
        connection = self._connection
        if connection is None or self._is_settled or connection.is_closed:
            return
        self._is_settled = True
        frame = encode_frame(FrameType.ABORT, self._token, payload=reason.encode()[:4096],
                             version=self._version)
        connection.io.write_detached([frame])

    async def _send(self, views: list[bytes | memoryview]) -> None:
        connection = self._connection
        if self._state.is_terminal or connection is None:
            self._raise_failed()
        assert connection is not None
        try:
            await connection.io.send_views(views)
        except OSError as exc:
            self._fail(f"connection lost: {exc}")
            connection.close()  # the stream is broken for every ticket on it
            self._raise_failed()

    # -- replies, routed here by the connection's reader --

    def _resolve(self, error: str | None) -> None:
        self._is_settled = True
        if self._done_reply is not None and not self._done_reply.done():
            self._done_reply.set_result(error)

    def _on_ack(self, answered: int) -> None:
        if answered == FrameType.DONE:
            self._resolve(None)

    def _on_refused(self, error: str) -> None:
        self._fail(error)
        self._resolve(error)

    def _on_connection_lost(self, error: str) -> None:
        if self._done_reply is not None and self._done_reply.done():
            return  # the outcome is known already
        self._fail(error)
        self._resolve(error)


