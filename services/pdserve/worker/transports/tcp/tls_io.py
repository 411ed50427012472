"""``TlsSocketIo``: ``SocketIo`` over mutual TLS, without giving up zero-copy receive.

``ssl.SSLSocket`` has no ``sendmsg``/``recvmsg_into``, so a TLS connection drives an
``ssl.SSLObject`` through two memory BIOs over the same non-blocking socket: ciphertext is read
from the socket into the engine and the plaintext is decrypted straight into the destination
block views (decryption is the one copy); the send side encrypts each block view in chunks.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import cast

from pdserve.worker.transports.tcp.settings import KvTls, TcpTransportSettings
from pdserve.worker.transports.tcp.socket_io import SocketIo


class TlsSocketIo(SocketIo):
    """``SocketIo`` over TLS: an ``ssl.SSLObject`` pumped through memory BIOs on the same
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
        # ``SSLObject.read(n, buffer)`` decrypts into ``buffer`` and returns the byte count;
        # typeshed types only the form without a buffer (which returns bytes).
        self._decrypt_into = cast(Callable[[int, memoryview], int], self._tls.read)
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
                        raise ConnectionResetError("peer closed during the TLS handshake") from None
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

    async def _read_some(self, view: memoryview, wake_nbytes: int = 1) -> int:
        """Decrypt up to ``len(view)`` bytes into ``view``; 0 when the peer has closed."""
        while True:
            try:
                return self._decrypt_into(len(view), view)
            except ssl.SSLWantReadError:
                await self._flush()  # e.g. a TLS 1.3 key update wants an answer
                if not await self._fill():
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

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
                    n = self._decrypt_into(len(view) - offset, view[offset:])
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

    _can_write_inline = False  # encrypting and flushing may wait: always the writer task's job

    def _send_now(self, items: list[memoryview]) -> list[memoryview]:
        return items

    async def _write_out(self, items: list[memoryview]) -> None:
        for data in items:
            for start in range(0, len(data), self._CHUNK_NBYTES):
                self._tls.write(data[start : start + self._CHUNK_NBYTES])
                await self._flush()


