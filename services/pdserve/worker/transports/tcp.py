"""``tcp``: two-sided push of KV over TCP, landing directly in the destination blocks.

Design choice — raw non-blocking sockets driven by the event loop, not asyncio streams or a
``BufferedProtocol``:

- Zero copy on both sides needs *scatter/gather*: a layer's blocks are generally not contiguous
  (any block ids), and the payload must land in them without a bounce buffer. ``recvmsg_into``
  scatters one read over up to 1024 block views and ``sendmsg`` gathers the source blocks into
  one write; neither is reachable through a transport. (A ``BufferedProtocol`` gets one buffer
  per readiness event, so a layer of small non-contiguous blocks costs an event-loop round per
  block; ``StreamReader`` copies everything through its own buffer.)
- Reading a frame is a sequential coroutine: header (exact size, never past it), block ids,
  *validate*, then payload. So the decision to write is taken before the first payload byte is
  read, and re-taken (``LayerAdmission.still_writable``) before every later read of the frame: a
  ``cancel`` or a block release on the loop between two reads diverts the rest to a scratch
  buffer. Reads loop while data is there, without going back to the selector.
- Consecutive block ids are one contiguous run of memory and go as one buffer.

Senders hold one connection per ticket (HELLO -> LAYER* -> DONE, each HELLO/DONE answered by ACK
or ERROR). A connection can carry several tickets' frames, so pooling per destination can come
later without a wire change. ``socket_buffer_nbytes`` = 0 leaves kernel autotuning on (setting
SO_SNDBUF/SO_RCVBUF turns it off and is capped by net.core.[rw]mem_max).

TLS (``TcpTransportSettings.tls``, off by default: the data path runs in clear inside a trusted
fabric, as RDMA does). ``ssl.SSLSocket`` has no ``sendmsg``/``recvmsg_into``, so a TLS connection
drives an ``ssl.SSLObject`` through two memory BIOs over the same non-blocking socket
(``_TlsSocketIo``): ciphertext is read from the socket into the engine and the plaintext is
decrypted straight into the destination block views, so the receive side still needs no bounce
buffer for the payload (decryption is the one copy); the send side encrypts each block view in
chunks. Both ends present certificates of the cluster CA (mutual TLS), the sender checks the
receiver's host name, and each side requires the other's SPIFFE identity to be a worker
(``pdserve.common.certs``). Frames are validated exactly as in clear. ``bench/tls_cost.py``
measures what TLS costs in bandwidth.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.common.errors import IllegalTransitionError, InvalidArgumentError
from pdserve.state.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.base import (
    FrameRefusedError,
    KvDestinationSpec,
    KvReceiver,
    KvSender,
    MonotonicClock,
    Rejection,
    RejectReason,
    TransferPoll,
    TransferResult,
    layer_block_views,
)
from pdserve.worker.transports.frames import (
    HEADER_NBYTES,
    MAX_FRAME_NBYTES,
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
    layer_frame_prefix,
)

logger = logging.getLogger(__name__)

_IOV_MAX = 1024
_SCRATCH_NBYTES = 1 << 20


class KvTls:
    """Mutual TLS of the KV data path: this worker's certificate and key, the cluster CA, and
    the SPIFFE kinds a peer's certificate must have (workers only, by default).

    The SSL contexts are rebuilt when the files change (checked at most every
    ``poll_interval_s``, on new connections), so renewed certificates need no restart.
    """

    def __init__(self, cert_path: Path, key_path: Path, ca_path: Path, *,
                 peer_kinds: frozenset[str] = frozenset({"worker"}),
                 poll_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._paths = (cert_path, key_path, ca_path)
        self.peer_kinds = peer_kinds
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamps = self._read_stamps()
        self._server, self._client = self._build()
        self._next_check_s = clock() + poll_interval_s

    def _read_stamps(self) -> list[tuple[int, int]]:
        return [(p.stat().st_mtime_ns, p.stat().st_size) for p in self._paths]

    def _build(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        cert_path, key_path, ca_path = self._paths
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the host name by default
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(cert_path, key_path)
            context.load_verify_locations(cafile=ca_path)
            context.verify_mode = ssl.CERT_REQUIRED
        return server, client

    def contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """``(server, client)`` contexts, rebuilt first if the files changed."""
        with self._lock:
            now = self._clock()
            if now >= self._next_check_s:
                self._next_check_s = now + self._poll_interval_s
                try:
                    stamps = self._read_stamps()
                    if stamps != self._stamps:
                        self._server, self._client = self._build()
                        self._stamps = stamps
                        logger.info("KV TLS certificate reloaded from %s", self._paths[0])
                except (OSError, ssl.SSLError) as exc:
                    logger.warning("KV TLS files changed but cannot be loaded (keeping the old "
                                   "ones): %s", exc)
            return self._server, self._client

    def check_peer(self, tls: ssl.SSLObject) -> None:
        """Raise ``ssl.SSLError`` unless the peer's certificate names an allowed SPIFFE kind."""
        from pdserve.common.certs import parse_spiffe_id

        cert = tls.getpeercert() or {}
        for kind, value in cert.get("subjectAltName", ()):
            identity = parse_spiffe_id(value) if kind == "URI" else None
            if identity is not None and identity[0].value in self.peer_kinds:
                return
        raise ssl.SSLError(f"KV peer is not one of {sorted(self.peer_kinds)}")


@dataclass(frozen=True, slots=True)
class TcpTransportSettings:
    """Knobs of the ``tcp`` backend. Timeouts are seconds; 0 buffer size = kernel autotuning."""

    socket_buffer_nbytes: int = 0
    connect_timeout_s: float = 5.0
    reply_timeout_s: float = 30.0
    max_frame_nbytes: int = MAX_FRAME_NBYTES
    yield_every_nbytes: int = 64 * 1024 * 1024
    """A receiver reading a long frame yields to the loop after this many bytes (fairness)."""
    tls: KvTls | None = field(default=None, compare=False)
    """Mutual TLS on the data path; None = clear (trusted fabric)."""


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6host]:port`` -> (host, port); ``InvalidArgumentError`` otherwise."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidArgumentError(f"KV address {address!r} is not host:port", field="kv_address")
    return host.removeprefix("[").removesuffix("]"), int(port_text)


def _tune(sock: socket.socket, settings: TcpTransportSettings) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if settings.socket_buffer_nbytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.socket_buffer_nbytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, settings.socket_buffer_nbytes)


class _SocketIo:
    """A non-blocking socket read and written by coroutines, woken by the loop's selector.

    One coroutine reads and one writes at a time (the receiver serialises its replies).
    """

    def __init__(self, sock: socket.socket, settings: TcpTransportSettings) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._yield_every_nbytes = settings.yield_every_nbytes
        self._scratch: memoryview | None = None
        self._write_lock = asyncio.Lock()

    async def _wait(self, is_read: bool) -> None:
        future = self._loop.create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        if is_read:
            self._loop.add_reader(self._fd, wake)
        else:
            self._loop.add_writer(self._fd, wake)
        try:
            await future
        finally:
            if is_read:
                self._loop.remove_reader(self._fd)
            else:
                self._loop.remove_writer(self._fd)

    async def recv_exact(self, num_bytes: int, *, is_eof_ok: bool = False) -> bytearray | None:
        """Exactly ``num_bytes`` (never more). None if the peer closed before the first byte and
        ``is_eof_ok``; ``ConnectionResetError`` if it closed in the middle."""
        buffer = bytearray(num_bytes)
        view = memoryview(buffer)
        got = 0
        while got < num_bytes:
            try:
                n = self.sock.recv_into(view[got:])
            except (BlockingIOError, InterruptedError):
                await self._wait(is_read=True)
                continue
            if n == 0:
                if got == 0 and is_eof_ok:
                    return None
                raise ConnectionResetError(f"peer closed after {got} of {num_bytes} bytes")
            got += n
        return buffer

    async def recv_into_views(
        self, views: Sequence[memoryview], still_writable: Callable[[], bool]
    ) -> bool:
        """Fill ``views`` in order from the socket. ``still_writable()`` is asked before every
        read; once it says no, the rest of the frame is read into scratch and dropped and this
        returns False. True when every byte landed in ``views``."""
        index, offset, since_yield = 0, 0, 0
        while index < len(views):
            if not still_writable():
                remaining = sum(len(v) for v in views[index:]) - offset
                await self.discard(remaining)
                return False
            batch = [views[index][offset:], *views[index + 1 : index + _IOV_MAX]]
            try:
                n = self.sock.recvmsg_into(batch)[0]
            except (BlockingIOError, InterruptedError):
                await self._wait(is_read=True)
                continue
            if n == 0:
                raise ConnectionResetError("peer closed in the middle of a layer")
            since_yield += n
            while n:
                step = min(n, len(views[index]) - offset)
                n -= step
                offset += step
                if offset == len(views[index]):
                    index, offset = index + 1, 0
            if since_yield >= self._yield_every_nbytes:
                since_yield = 0
                await asyncio.sleep(0)
        return True

    async def discard(self, num_bytes: int) -> None:
        """Read and drop ``num_bytes`` (a refused payload) through a reused scratch buffer."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(min(_SCRATCH_NBYTES, max(num_bytes, 1))))
        while num_bytes > 0:
            chunk = self._scratch[: min(num_bytes, len(self._scratch))]
            try:
                n = self.sock.recv_into(chunk)
            except (BlockingIOError, InterruptedError):
                await self._wait(is_read=True)
                continue
            if n == 0:
                raise ConnectionResetError("peer closed in the middle of a refused frame")
            num_bytes -= n

    async def send_views(self, views: Sequence[bytes | memoryview]) -> None:
        """Write every byte of ``views`` in order (gathered: one ``sendmsg`` per <= 1024)."""
        async with self._write_lock:
            views = [memoryview(v).cast("B") for v in views]
            index, offset = 0, 0
            while index < len(views):
                first = views[index][offset:] if offset else views[index]
                batch = [first, *views[index + 1 : index + _IOV_MAX]]
                try:
                    n = self.sock.sendmsg(batch)
                except (BlockingIOError, InterruptedError):
                    await self._wait(is_read=False)
                    continue
                while n:
                    step = min(n, len(views[index]) - offset)
                    n -= step
                    offset += step
                    if offset == len(views[index]):
                        index, offset = index + 1, 0
                while index < len(views) and len(views[index]) == 0:
                    index += 1

    async def handshake(self, timeout_s: float) -> None:
        """Nothing to do in clear (``_TlsSocketIo`` runs the TLS handshake here)."""

    def close(self) -> None:
        self.sock.close()


class _TlsSocketIo(_SocketIo):
    """``_SocketIo`` over TLS: an ``ssl.SSLObject`` pumped through memory BIOs on the same
    non-blocking socket. Reads decrypt into the caller's buffers (the destination blocks);
    writes encrypt in ``_CHUNK_NBYTES`` pieces so buffered ciphertext stays bounded."""

    _RECV_NBYTES = 256 * 1024
    _CHUNK_NBYTES = 256 * 1024

    def __init__(self, sock: socket.socket, settings: TcpTransportSettings,
                 context: ssl.SSLContext, checker: KvTls, *, server_side: bool,
                 server_hostname: str | None = None) -> None:
        super().__init__(sock, settings)
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=server_hostname)
        self._checker = checker
        self._flush_lock = asyncio.Lock()
        self._is_eof = False

    async def handshake(self, timeout_s: float) -> None:
        """TLS handshake and peer check; raises ``ssl.SSLError``/``OSError``/``TimeoutError``."""
        async def run() -> None:
            while True:
                try:
                    self._tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._flush()
                    if not await self._fill():
                        raise ConnectionResetError("peer closed during the TLS handshake")
            await self._flush()
            self._checker.check_peer(self._tls)

        await asyncio.wait_for(run(), timeout_s)

    async def _flush(self) -> None:
        """Send every pending ciphertext byte, in order (one flusher at a time)."""
        async with self._flush_lock:
            while self._outgoing.pending:
                data = memoryview(self._outgoing.read())
                while data:
                    try:
                        n = self.sock.send(data)
                    except (BlockingIOError, InterruptedError):
                        await self._wait(is_read=False)
                        continue
                    data = data[n:]

    async def _fill(self) -> bool:
        """Move what the socket has into the TLS engine; False at end of stream."""
        if self._is_eof:
            return False
        while True:
            try:
                data = self.sock.recv(self._RECV_NBYTES)
            except (BlockingIOError, InterruptedError):
                await self._wait(is_read=True)
                continue
            if not data:
                self._is_eof = True
                self._incoming.write_eof()
                return False
            self._incoming.write(data)
            return True

    async def _read_into(self, view: memoryview) -> int:
        """Decrypt up to ``len(view)`` bytes into ``view``; 0 when the peer has closed."""
        while True:
            try:
                return self._tls.read(len(view), view)
            except ssl.SSLWantReadError:
                await self._flush()  # e.g. a TLS 1.3 key update wants an answer
                if not await self._fill():
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    async def recv_exact(self, num_bytes: int, *, is_eof_ok: bool = False) -> bytearray | None:
        buffer = bytearray(num_bytes)
        view = memoryview(buffer)
        got = 0
        while got < num_bytes:
            n = await self._read_into(view[got:])
            if n == 0:
                if got == 0 and is_eof_ok:
                    return None
                raise ConnectionResetError(f"peer closed after {got} of {num_bytes} bytes")
            got += n
        return buffer

    async def recv_into_views(
        self, views: Sequence[memoryview], still_writable: Callable[[], bool]
    ) -> bool:
        since_yield = 0
        for index, view in enumerate(views):
            view = view.cast("B") if view.format != "B" else view
            offset = 0
            while offset < len(view):
                if not still_writable():
                    remaining = len(view) - offset + sum(len(v) for v in views[index + 1:])
                    await self.discard(remaining)
                    return False
                # Decrypt straight into the blocks only with no await between the check above
                # and the write: waiting for ciphertext happens before the check, never after
                # (the ticket may end, and its blocks change owner, during a wait).
                try:
                    n = self._tls.read(len(view) - offset, view[offset:])
                except ssl.SSLWantReadError:
                    await self._flush()  # e.g. a TLS 1.3 key update wants an answer
                    if not await self._fill():
                        raise ConnectionResetError("peer closed in the middle of a layer") from None
                    continue
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    n = 0
                if n == 0:
                    raise ConnectionResetError("peer closed in the middle of a layer")
                offset += n
                since_yield += n
                if since_yield >= self._yield_every_nbytes:
                    since_yield = 0
                    await asyncio.sleep(0)
        return True

    async def discard(self, num_bytes: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(min(_SCRATCH_NBYTES, max(num_bytes, 1))))
        while num_bytes > 0:
            n = await self._read_into(self._scratch[: min(num_bytes, len(self._scratch))])
            if n == 0:
                raise ConnectionResetError("peer closed in the middle of a refused frame")
            num_bytes -= n

    async def send_views(self, views: Sequence[bytes | memoryview]) -> None:
        async with self._write_lock:
            for view in views:
                data = memoryview(view).cast("B")
                for start in range(0, len(data), self._CHUNK_NBYTES):
                    self._tls.write(data[start : start + self._CHUNK_NBYTES])
                    await self._flush()


def _error_frame(token: FencingToken | None, refused: FrameType | int, layer: int,
                 reason: str, detail: str) -> bytes:
    payload = ErrorPayload(int(refused), reason, detail).encode()
    return encode_frame(FrameType.ERROR, token, layer=layer, payload=payload)


def _ack_frame(token: FencingToken, answered: FrameType) -> bytes:
    return encode_frame(FrameType.ACK, token, payload=bytes([int(answered)]))


class _Connection:
    """One accepted connection and the tickets whose frames it carried."""

    def __init__(self, io: _SocketIo) -> None:
        self.io = io
        self.tokens: set[FencingToken] = set()


class TcpKvReceiver(KvReceiver):
    """Decode side of ``tcp``: accepts senders and lands admitted layers in the KV cache."""

    def __init__(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                 clock: MonotonicClock = time.perf_counter,
                 settings: TcpTransportSettings = TcpTransportSettings()) -> None:
        super().__init__(kv_cache, owner_table, clock)
        layout = kv_cache.layout
        self._settings = settings
        self._limits = FrameLimits(
            block_nbytes=layout.block_nbytes,
            num_blocks=layout.num_blocks,
            max_block_ids=layout.num_blocks,
            max_frame_nbytes=settings.max_frame_nbytes,
        )
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._accept_task: asyncio.Task[None] | None = None
        self._token_to_connection: dict[FencingToken, _Connection] = {}
        self._address = ""
        self.tickets.on_failed = self._on_ticket_failed

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
            _tune(listener, self._settings)  # accepted sockets inherit the buffer sizes
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
            _tune(sock, self._settings)
            if tls is None:
                io = _SocketIo(sock, self._settings)
            else:
                io = _TlsSocketIo(sock, self._settings, tls.contexts()[0], tls, server_side=True)
            self._spawn(self._serve(_Connection(io)))

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_ticket_failed(self, token: FencingToken, reason: str) -> None:
        """Tell the sender at once (it may stop sending); best effort."""
        connection = self._token_to_connection.get(token)
        if connection is not None:
            frame = _error_frame(token, 0, 0, reason.partition(":")[0], reason)
            self._spawn(self._reply(connection, frame))

    async def _reply(self, connection: _Connection, frame: bytes) -> None:
        try:
            await connection.io.send_views([frame])
        except OSError as exc:
            logger.debug("KV reply lost: %s", exc)

    async def _refused(self, connection: _Connection, header: FrameHeader,
                       rejection: Rejection) -> None:
        await self._reply(connection, _error_frame(
            header.token, header.frame_type, header.layer, rejection.reason, rejection.detail))

    def _bind(self, connection: _Connection, token: FencingToken) -> None:
        connection.tokens.add(token)
        self._token_to_connection[token] = connection

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
        block_ids = np.zeros(0, dtype=np.int64)
        if header.num_block_ids:
            raw_ids = await io.recv_exact(header.block_ids_nbytes)
            assert raw_ids is not None
            try:
                block_ids = decode_block_ids(header, raw_ids, self._limits)
            except FrameError as exc:
                rejection = self.tickets.refuse(token, header.frame_type.name, header.layer,
                                                RejectReason.MALFORMED_FRAME, exc.message)
                await io.discard(header.payload_nbytes)
                await self._refused(connection, header, rejection)
                return True
        if header.frame_type is FrameType.LAYER:
            assert token is not None
            await self._on_layer(connection, header, token, block_ids)
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
                    await self._refused(connection, header, exc.rejection)
                    return True
                self._bind(connection, token)
                await self._reply(connection, _ack_frame(token, FrameType.HELLO))
            case FrameType.DONE:
                assert token is not None
                done = DonePayload.decode(payload)
                try:
                    self.tickets.admit_done(token, done.first_token_id, done.prefill_compute_s,
                                            done.num_layers)
                except FrameRefusedError as exc:
                    await self._refused(connection, header, exc.rejection)
                    return True
                await self._reply(connection, _ack_frame(token, FrameType.DONE))
            case FrameType.ABORT:
                assert token is not None
                reason = bytes(payload).decode("utf-8", errors="replace")
                if token in connection.tokens:
                    self.tickets.fail(token, f"aborted by sender: {reason}")
                else:  # only the connection that introduced a ticket may abort it
                    self.tickets.refuse(None, "ABORT", 0, RejectReason.PROTOCOL,
                                        f"ABORT for {token} from a connection not carrying it")
            case _:
                self.tickets.refuse(token, header.frame_type.name, 0, RejectReason.PROTOCOL,
                                    "senders do not send ACK or ERROR")
                return False
        return True

    async def _on_layer(self, connection: _Connection, header: FrameHeader, token: FencingToken,
                        block_ids: np.ndarray) -> None:
        try:
            admission = self.tickets.admit_layer(token, header.layer, block_ids)
        except FrameRefusedError as exc:
            await connection.io.discard(header.payload_nbytes)
            await self._refused(connection, header, exc.rejection)
            return
        self._bind(connection, token)
        views = layer_block_views(self.kv_cache, header.layer, block_ids)
        if await connection.io.recv_into_views(views, admission.still_writable):
            self.tickets.layer_landed(admission, header.payload_nbytes)


class TcpKvSender(KvSender):
    """Prefill side of ``tcp``: one connection, source blocks gathered straight from the cache."""

    def __init__(self, kv_cache: KvCache, clock: MonotonicClock = time.perf_counter,
                 settings: TcpTransportSettings = TcpTransportSettings()) -> None:
        super().__init__(kv_cache, clock)
        self._settings = settings
        self._io: _SocketIo | None = None
        self._reader: asyncio.Task[None] | None = None
        self._hello_reply: asyncio.Future[str | None] | None = None
        self._done_reply: asyncio.Future[str | None] | None = None
        self._dst_ids: np.ndarray | None = None

    async def open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        self._check_open(dest, token)
        host, port = parse_address(dest.kv_address)
        loop = asyncio.get_running_loop()
        try:
            sock = await asyncio.wait_for(self._connect(host, port),
                                          self._settings.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            self._fail(f"cannot connect to {dest.kv_address}: {exc or 'timeout'}")
            self._raise_failed()
        tls = self._settings.tls
        if tls is None:
            self._io = _SocketIo(sock, self._settings)
        else:
            self._io = _TlsSocketIo(sock, self._settings, tls.contexts()[1], tls,
                                    server_side=False, server_hostname=host)
            try:
                await self._io.handshake(self._settings.connect_timeout_s)
            except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
                self._io.close()
                self._io = None
                self._fail(f"TLS handshake with {dest.kv_address} failed: {exc or 'timeout'}")
                self._raise_failed()
        self._hello_reply = loop.create_future()
        self._done_reply = loop.create_future()
        self._reader = asyncio.create_task(self._read_replies(), name=f"kv-tcp-replies-{token}")
        self._dst_ids = np.asarray(dest.block_ids, dtype=np.int64)
        layout = self.kv_cache.layout
        hello = HelloPayload(layout.num_layers, layout.block_size_tokens, layout.block_nbytes)
        await self._send([encode_frame(FrameType.HELLO, token, block_ids=self._dst_ids,
                                       payload=hello.encode())])
        await self._await_reply(self._hello_reply)

    async def _connect(self, host: str, port: int) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            _tune(sock, self._settings)
            await loop.sock_connect(sock, sockaddr)
        except BaseException:
            sock.close()
            raise
        return sock

    async def offer_layer(
        self, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int] | None = None
    ) -> None:
        offer = self._make_offer(layer, src_block_ids, dst_block_ids)
        assert self._token is not None
        dst_ids = (self._dst_ids if dst_block_ids is None
                   else np.asarray(offer.dst_block_ids, dtype=np.int64))
        assert dst_ids is not None
        src_ids = np.asarray(offer.src_block_ids, dtype=np.int64)
        prefix = layer_frame_prefix(self._token, layer, dst_ids, self.kv_cache.layout.block_nbytes)
        await self._send([prefix, *layer_block_views(self.kv_cache, layer, src_ids)])
        self._offered(offer)

    async def finish(self, first_token_id: int, prefill_compute_s: float) -> TransferResult:
        if self._state.is_terminal or self._done_reply is None:
            self._raise_failed()
        done = DonePayload(first_token_id, prefill_compute_s, len(self._offered_layers))
        await self._send([encode_frame(FrameType.DONE, self._token, payload=done.encode())])
        assert self._done_reply is not None
        await self._await_reply(self._done_reply)
        return self._succeeded(first_token_id, prefill_compute_s)

    async def abort(self, reason: str) -> None:
        if not self._state.is_terminal and self._io is not None:
            frame = encode_frame(FrameType.ABORT, self._token, payload=reason.encode()[:4096])
            try:
                await asyncio.wait_for(self._io.send_views([frame]),
                                       self._settings.connect_timeout_s)
            except (OSError, TimeoutError) as exc:
                logger.debug("ABORT not delivered: %s", exc)
        self._fail(f"aborted: {reason}")
        await self.close()

    async def close(self) -> None:
        self._fail("closed before finish")
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._io is not None:
            self._io.close()
            self._io = None

    async def _send(self, views: list[bytes | memoryview]) -> None:
        if self._io is None:
            self._raise_failed()
        assert self._io is not None
        try:
            await self._io.send_views(views)
        except OSError as exc:
            self._fail(f"connection lost: {exc}")
            self._raise_failed()

    async def _await_reply(self, reply: asyncio.Future[str | None]) -> None:
        try:
            error = await asyncio.wait_for(asyncio.shield(reply), self._settings.reply_timeout_s)
        except TimeoutError:
            self._fail(f"no reply from the receiver within {self._settings.reply_timeout_s} s")
            self._raise_failed()
        if error is not None:
            self._fail(error)
            self._raise_failed()

    def _resolve(self, reply: asyncio.Future[str | None] | None, error: str | None) -> None:
        if reply is not None and not reply.done():
            reply.set_result(error)

    async def _read_replies(self) -> None:
        assert self._io is not None
        limits = FrameLimits(block_nbytes=self.kv_cache.layout.block_nbytes, num_blocks=1)
        error = "connection closed by the receiver"
        try:
            while True:
                raw = await self._io.recv_exact(HEADER_NBYTES, is_eof_ok=True)
                if raw is None:
                    break
                header = decode_header(raw, limits)
                if header.frame_type not in (FrameType.ACK, FrameType.ERROR):
                    error = f"receiver sent a {header.frame_type.name} frame"
                    break
                payload = await self._io.recv_exact(header.payload_nbytes)
                assert payload is not None
                if header.token is not None and header.token != self._token:
                    continue
                if header.frame_type is FrameType.ACK:
                    answered = payload[0]
                    if answered == FrameType.HELLO:
                        self._resolve(self._hello_reply, None)
                    elif answered == FrameType.DONE:
                        self._resolve(self._done_reply, None)
                    continue
                refusal = ErrorPayload.decode(payload)
                error = f"refused: {refusal.detail or refusal.reason}"
                self._fail(error)
                break
        except (FrameError, ConnectionError, OSError) as exc:
            error = f"connection lost: {exc}"
        is_done = self._done_reply is not None and self._done_reply.done()
        if not (is_done and self._done_reply.result() is None):  # type: ignore[union-attr]
            self._fail(error)
        self._resolve(self._hello_reply, error)
        self._resolve(self._done_reply, error)


class TcpBackend:
    """The ``tcp`` backend (always available where there are sockets)."""

    name = "tcp"
    is_pull = False

    def __init__(self, settings: TcpTransportSettings = TcpTransportSettings()) -> None:
        self.settings = settings

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def create_receiver(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                        *, clock: MonotonicClock = time.perf_counter) -> TcpKvReceiver:
        return TcpKvReceiver(kv_cache, owner_table, clock, self.settings)

    def create_sender(self, kv_cache: KvCache,
                      *, clock: MonotonicClock = time.perf_counter) -> TcpKvSender:
        return TcpKvSender(kv_cache, clock, self.settings)


BACKEND = TcpBackend()


__all__ = [
    "BACKEND",
    "KvTls",
    "TcpBackend",
    "TcpKvReceiver",
    "TcpKvSender",
    "TcpTransportSettings",
    "TransferPoll",
    "format_address",
    "parse_address",
]
