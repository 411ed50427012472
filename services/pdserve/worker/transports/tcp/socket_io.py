"""``SocketIo``: a non-blocking socket read and written by coroutines, with scatter/gather I/O
straight from and into KV block views (``sendmsg``/``recvmsg_into``, no bounce buffer)."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Callable, Sequence

from pdserve.worker.transports.tcp.settings import TcpTransportSettings

logger = logging.getLogger(__name__)

_IOV_MAX = 1024
_SCRATCH_NBYTES = 1 << 20
_MAX_RCVLOWAT = 256 * 1024
_MIN_RCVLOWAT = 64 * 1024
"""Reads needing less than this wait for any byte (a frame that small arrives at once)."""
_SO_RCVLOWAT: int | None = getattr(socket, "SO_RCVLOWAT", None)


def tune_socket(sock: socket.socket, settings: TcpTransportSettings) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if settings.socket_buffer_nbytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.socket_buffer_nbytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, settings.socket_buffer_nbytes)


class SocketIo:
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

    async def _read_some(self, view: memoryview, wake_nbytes: int = 1) -> int:
        """Read what is there into ``view`` (waiting for at least one byte, woken once about
        ``wake_nbytes`` can be read); 0 when the peer has closed."""
        while True:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self._wait_readable(wake_nbytes)

    async def recv_exact(self, num_bytes: int, *, is_eof_ok: bool = False) -> bytearray | None:
        """Exactly ``num_bytes`` (never more). None if the peer closed before the first byte and
        ``is_eof_ok``; ``ConnectionResetError`` if it closed in the middle."""
        buffer = bytearray(num_bytes)
        view = memoryview(buffer)
        got = 0
        while got < num_bytes:
            n = await self._read_some(view[got:])
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
            n = await self._read_some(chunk, len(chunk))
            if n == 0:
                raise ConnectionResetError("peer closed in the middle of a refused frame")
            num_bytes -= n

    async def handshake(self, timeout_s: float) -> None:
        """Nothing to do in clear (``TlsSocketIo`` runs the TLS handshake here)."""

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


