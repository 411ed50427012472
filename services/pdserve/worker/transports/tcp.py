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
  buffer. Reads loop while data is there, without going back to the selector; while a long
  payload is still arriving, the socket's low-water mark (SO_RCVLOWAT) makes the loop wake for
  a good part of it rather than for every segment.
- Consecutive block ids are one contiguous run of memory and go as one buffer.

What a ticket costs beyond its bytes is kept small, because at small prompts it is most of the
handoff:

- One connection per (sender process, destination), kept open and shared by every ticket sent
  there (``_SenderConnection``; closed after ``idle_close_s`` unused, or when it breaks — the
  next ticket connects anew). Frames of different tickets never interleave on the wire: a
  frame is written whole, and one still being written when its sender is cancelled is finished
  by a writer task before anything else goes out. Replies name their ticket; one reader per
  connection routes them. A refusal fails its ticket only; a malformed frame makes the receiver
  close the connection, which fails the tickets on it (and only those).
- No round trip before the first layer: HELLO goes with flag NO_ACK and the layers follow at
  once. Every LAYER frame is validated on its own anyway; if the receiver refuses the HELLO it
  answers ERROR and drops the ticket's later frames on that connection unanswered. The sender
  learns of it at its next ``offer_layer`` or at ``finish`` (whose DONE is still answered).
- Layers that are ready together (the agent offers every layer it finds finished) go as one
  LAYERS frame per run of consecutive layers: one header, one admission, one scatter read.
- Per-ticket work on the receiver is done once, not per frame: a connection decodes a block-id
  list once for all the frames that repeat it, and the ownership check of an unchanged,
  read-only id list is reused until a block is released anywhere (the owner table's epoch).

``socket_buffer_nbytes`` = 0 leaves kernel autotuning on (setting SO_SNDBUF/SO_RCVBUF turns it
off and is capped by net.core.[rw]mem_max).

TLS (``TcpTransportSettings.tls``, off by default: the data path runs in clear inside a trusted
fabric, as RDMA does). ``ssl.SSLSocket`` has no ``sendmsg``/``recvmsg_into``, so a TLS connection
drives an ``ssl.SSLObject`` through two memory BIOs over the same non-blocking socket
(``_TlsSocketIo``): ciphertext is read from the socket into the engine and the plaintext is
decrypted straight into the destination block views, so the receive side still needs no bounce
buffer for the payload (decryption is the one copy); the send side encrypts each block view in
chunks. Both ends present certificates of the cluster CA (mutual TLS), the sender checks the
receiver's host name, and each side requires the other's SPIFFE identity to be a worker
(``pdserve.common.certs``). Frames are validated exactly as in clear. A pooled connection keeps
the certificate it was opened with: once the files are renewed, tickets go on new connections
and the old ones idle out. With TLS 1.3 the receiver judges the sender's certificate after the
sender's handshake has completed, so a refused sender finds out at its first reply (``finish``
at the latest). ``bench/tls_cost.py`` measures what TLS costs in bandwidth.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.common.errors import IllegalTransitionError, InvalidArgumentError
from pdserve.common.types import FencingToken
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
    coalesce_block_runs,
    layers_block_views,
)
from pdserve.worker.transports.frames import (
    FLAG_BLOCK_IDS_U64,
    FLAG_NO_ACK,
    HEADER_NBYTES,
    MAX_FRAME_NBYTES,
    DonePayload,
    EncodedBlockIds,
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
_MAX_SILENCED = 1024
_MAX_RCVLOWAT = 256 * 1024
_MIN_RCVLOWAT = 64 * 1024
"""Reads needing less than this wait for any byte (a frame that small arrives at once)."""
_SO_RCVLOWAT: int | None = getattr(socket, "SO_RCVLOWAT", None)
_NO_BLOCK_IDS = np.zeros(0, dtype=np.int64)
_NO_BLOCK_IDS.flags.writeable = False


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
    multi_layer_frame_nbytes: int = 16 * 1024 * 1024
    """A sender puts layers that are ready together in one LAYERS frame up to this payload (a
    bound on how long another ticket's frames wait behind it on a shared connection)."""
    idle_close_s: float = 60.0
    """A sender's pooled connection unused this long is closed."""
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

    One coroutine reads at a time. Writes (``write``/``send_views``) may come from several
    coroutines — the tickets sharing a connection, the receiver's replies — and go out whole and
    in call order: a write the kernel does not take at once is queued, and one writer task sends
    the queue. A unit once started is always finished (or the connection closed), even if its
    caller is cancelled, so the stream never holds half a frame followed by another frame.
    """

    def __init__(self, sock: socket.socket, settings: TcpTransportSettings) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._yield_every_nbytes = settings.yield_every_nbytes
        self._scratch: memoryview | None = None
        self._pending: collections.deque[tuple[list[memoryview], asyncio.Future[None]]] = (
            collections.deque())
        self._writer: asyncio.Task[None] | None = None
        self._is_writing = False  # a send_views is writing its unit in the caller's task
        self._write_error = ""
        self.is_closed = False
        self._rcvlowat = 1
        self._waiters: set[asyncio.Future[None]] = set()

    async def _wait(self, is_read: bool) -> None:
        """Until the socket is readable (writable); ``ConnectionResetError`` if it is closed
        meanwhile (by another task: a reader that saw the end, a writer that failed)."""
        if self.is_closed:
            raise ConnectionResetError("connection closed")
        future = self._loop.create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        if is_read:
            self._loop.add_reader(self._fd, wake)
        else:
            self._loop.add_writer(self._fd, wake)
        self._waiters.add(future)
        try:
            await future
        finally:
            self._waiters.discard(future)
            if not self.is_closed:  # close() unregistered the fd (whose number may be reused)
                if is_read:
                    self._loop.remove_reader(self._fd)
                else:
                    self._loop.remove_writer(self._fd)

    async def _wait_readable(self, num_bytes: int) -> None:
        """Wait until ``min(num_bytes, _MAX_RCVLOWAT)`` bytes can be read (or the peer closed):
        the socket's low-water mark follows what the current read still needs, so a long
        frame wakes the loop a few times instead of once per arriving segment. The kernel
        caps the mark by the receive buffer and wakes early under memory pressure. Short reads
        (headers, small frames) wait for any byte."""
        # A power of two <= what is needed: the mark changes a few times per frame, not per wait.
        wanted = (1 << (min(num_bytes, _MAX_RCVLOWAT).bit_length() - 1)
                  if num_bytes >= _MIN_RCVLOWAT else 1)
        if wanted != self._rcvlowat and _SO_RCVLOWAT is not None:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, _SO_RCVLOWAT, wanted)
                self._rcvlowat = wanted
            except OSError:
                pass
        await self._wait(is_read=True)

    # -- writing --

    def write(self, views: Sequence[bytes | memoryview]) -> asyncio.Future[None] | None:
        """Send ``views`` as one unit after every unit written before. None when the kernel took
        every byte at once; else a future done when it has (``ConnectionResetError`` if the
        connection broke first). Raises ``ConnectionResetError`` on a connection that broke."""
        if self._write_error:
            raise ConnectionResetError(self._write_error)
        items = [memoryview(v).cast("B") for v in views]
        if self._writer is None and not self._is_writing:  # nothing queued: try at once
            try:
                items = self._send_now(items)
            except OSError as exc:
                self._write_error = f"write failed: {exc}"
                raise
            if not items:
                return None
        future = self._loop.create_future()
        self._pending.append((items, future))
        if self._writer is None and not self._is_writing:
            self._writer = self._loop.create_task(self._write_pending())
        return future

    def write_detached(self, views: Sequence[bytes | memoryview]) -> None:
        """``write`` for a unit nobody waits for (best effort, e.g. an ABORT)."""
        try:
            future = self.write(views)
        except OSError as exc:
            logger.debug("KV frame not sent: %s", exc)
            return
        if future is not None:
            future.add_done_callback(_consume_result)

    _can_write_inline = True

    async def send_views(self, views: Sequence[bytes | memoryview]) -> None:
        """``write`` and wait until the kernel has every byte. With nothing queued, the caller's
        task writes (and waits for room) itself; if it is cancelled half-way, the rest of the
        unit goes to the writer task, ahead of anything queued meanwhile."""
        if self._writer is not None or self._is_writing or not self._can_write_inline:
            future = self.write(views)
            if future is not None:
                await future
            return
        if self._write_error:
            raise ConnectionResetError(self._write_error)
        items = [memoryview(v).cast("B") for v in views]
        self._is_writing = True
        try:
            items = self._send_now(items)
            while items:
                await self._wait(is_read=False)
                items = self._send_now(items)
        except asyncio.CancelledError:
            if items and not self._write_error:
                future = self._loop.create_future()
                future.add_done_callback(_consume_result)
                self._pending.appendleft((items, future))
            raise
        except OSError as exc:
            self._write_error = f"write failed: {exc}"
            raise
        finally:
            self._is_writing = False
            if self._write_error:
                self._fail_pending()
            elif self._pending and self._writer is None:
                self._writer = self._loop.create_task(self._write_pending())

    def _fail_pending(self) -> None:
        while self._pending:
            _, future = self._pending.popleft()
            if not future.done():
                future.set_exception(ConnectionResetError(self._write_error))

    def _send_now(self, items: list[memoryview]) -> list[memoryview]:
        """Send what the kernel takes without waiting; returns what is left (empty: all sent)."""
        index = 0
        while index < len(items):
            try:
                n = self.sock.sendmsg(items[index : index + _IOV_MAX])
            except (BlockingIOError, InterruptedError):
                break
            if n == 0 and len(items[index]):
                break
            while index < len(items) and n >= len(items[index]):
                n -= len(items[index])
                index += 1
            if n:
                items[index] = items[index][n:]
        return items[index:]

    async def _write_out(self, items: list[memoryview]) -> None:
        while True:
            items = self._send_now(items)
            if not items:
                return
            await self._wait(is_read=False)

    async def _write_pending(self) -> None:
        try:
            while self._pending:
                items, future = self._pending[0]
                await self._write_out(items)
                self._pending.popleft()
                if not future.done():
                    future.set_result(None)
        except BaseException as exc:
            self._write_error = (f"write failed: {exc}" if isinstance(exc, OSError)
                                 else "connection closed")
            self._fail_pending()
            if not isinstance(exc, (OSError, asyncio.CancelledError)):
                raise
        finally:
            self._writer = None

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
                await self._wait_readable(1)
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
        remaining = sum(len(v) for v in views)
        while index < len(views):
            if not still_writable():
                await self.discard(remaining)
                return False
            batch = [views[index][offset:], *views[index + 1 : index + _IOV_MAX]]
            try:
                n = self.sock.recvmsg_into(batch)[0]
            except (BlockingIOError, InterruptedError):
                await self._wait_readable(remaining)
                continue
            if n == 0:
                raise ConnectionResetError("peer closed in the middle of a layer")
            remaining -= n
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
                await self._wait_readable(len(chunk))
                continue
            if n == 0:
                raise ConnectionResetError("peer closed in the middle of a refused frame")
            num_bytes -= n

    async def handshake(self, timeout_s: float) -> None:
        """Nothing to do in clear (``_TlsSocketIo`` runs the TLS handshake here)."""

    def close(self) -> None:
        """Close the socket now; queued writes fail. Idempotent."""
        if self.is_closed:
            return
        self.is_closed = True
        self._write_error = self._write_error or "connection closed"
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        if self._writer is not None:
            self._writer.cancel()  # a task cancelled before its first step runs no handler:
        self._fail_pending()  # its waiters are failed here
        for waiter in self._waiters:  # tasks waiting for the socket (it will never be ready)
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("connection closed"))
        self.sock.close()


def _consume_result(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.debug("KV frame not sent: %s", future.exception())


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

    _can_write_inline = False  # encrypting and flushing may wait: always the writer task's job

    def _send_now(self, items: list[memoryview]) -> list[memoryview]:
        return items

    async def _write_out(self, items: list[memoryview]) -> None:
        for data in items:
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
    """One accepted connection: the live tickets whose frames it carried (only this connection
    may abort them), and tickets whose NO_ACK HELLO was refused on it (their later frames are
    dropped unanswered: the sender has its ERROR and sent them before reading it)."""

    def __init__(self, io: _SocketIo) -> None:
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
            self.num_accepted += 1
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
            header.token, header.frame_type, header.layer, rejection.reason, rejection.detail))

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
                if not header.flags & FLAG_NO_ACK:
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
                self._unbind(connection, token)
                await self._reply(connection, _ack_frame(token, FrameType.DONE))
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


class _ConnectError(Exception):
    """Connecting (or the TLS handshake) failed; the message says so."""


_REPLY_LIMITS = FrameLimits(block_nbytes=1, num_blocks=1)
"""Replies (ACK, ERROR) name no blocks; anything else from a receiver ends the connection."""


class _SenderConnection:
    """One connection from this process to one receiver, shared by the tickets sent there.

    Frames of different tickets go out whole (``_SocketIo.write``); one reader task routes the
    receiver's replies to the ticket they name. Unused for ``idle_close_s`` it closes; a broken
    or closed connection fails the tickets still on it and leaves the pool, so the next ticket
    connects anew.
    """

    def __init__(self, pool: _SenderPool, key: tuple[object, ...], io: _SocketIo,
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
            io = _SocketIo(sock, settings)
        else:
            assert settings.tls is not None
            io = _TlsSocketIo(sock, settings, context, settings.tls, server_side=False,
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
        _tune(sock, settings)
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
    """

    def __init__(self, kv_cache: KvCache, clock: MonotonicClock = time.perf_counter,
                 settings: TcpTransportSettings = TcpTransportSettings()) -> None:
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

    async def open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        self._check_open(dest, token)
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
                                       payload=hello.encode(), flags=FLAG_NO_ACK)])

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
        block_nbytes = self.kv_cache.layout.block_nbytes
        views: list[bytes | memoryview] = []
        for first, count in _layer_runs(layers, len(src_ids) * block_nbytes,
                                        self._settings.multi_layer_frame_nbytes):
            views.append(layer_frame_prefix(self._token, first, dst_wire, block_nbytes, count))
            views.extend(layers_block_views(self.kv_cache, range(first, first + count), src_ids,
                                            self._src_runs))
        await self._send(views)
        for offer in offers:
            self._offered(offer)

    async def finish(self, first_token_id: int, prefill_compute_s: float) -> TransferResult:
        if self._state.is_terminal or self._done_reply is None:
            self._raise_failed()
        done = DonePayload(first_token_id, prefill_compute_s, len(self._offered_layers))
        await self._send([encode_frame(FrameType.DONE, self._token, payload=done.encode())])
        assert self._done_reply is not None
        try:
            error = await asyncio.wait_for(asyncio.shield(self._done_reply),
                                           self._settings.reply_timeout_s)
        except TimeoutError:
            self._fail(f"no reply from the receiver within {self._settings.reply_timeout_s} s")
            self._raise_failed()
        if error is not None:
            self._fail(error)
            self._raise_failed()
        return self._succeeded(first_token_id, prefill_compute_s)

    async def abort(self, reason: str) -> None:
        if not self._state.is_terminal:
            self._fail(f"aborted: {reason}")
            self._send_abort(reason)
        await self.close()

    async def close(self) -> None:
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
        frame = encode_frame(FrameType.ABORT, self._token, payload=reason.encode()[:4096])
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
    "close_sender_connections",
    "format_address",
    "parse_address",
]
