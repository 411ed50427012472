"""``tcp`` beyond the contract suite: what keeps a ticket's fixed cost small must not cost safety.

- Tickets to one receiver share one connection; a refused ticket fails alone, and a connection
  that breaks fails only its own tickets while the next ticket connects anew.
- A sender cancelled in the middle of a frame leaves the shared stream whole.
- HELLO with NO_ACK: the layers follow without waiting; a refused HELLO silences the ticket's
  later frames on that connection (no bytes, no further replies), while an old-style HELLO is
  still acknowledged.
- LAYERS frames carry several layers under one admission, refused whole if any layer is wrong.
- A long frame that arrives slowly (the receiver's low-water mark) lands, and so does the small
  frame after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.frames import (
    FLAG_NO_ACK,
    HEADER_NBYTES,
    DonePayload,
    ErrorPayload,
    FrameLimits,
    FrameType,
    HelloPayload,
    decode_header,
    encode_frame,
    layer_frame_prefix,
)
from pdserve.worker.transports.tcp import sender as tcp_sender
from pdserve.worker.transports.tcp.backend import TcpBackend
from pdserve.worker.transports.tcp.receiver import TcpKvReceiver
from pdserve.worker.transports.tcp.settings import TcpTransportSettings
from pdserve.worker.transports.tcp.socket_io import SocketIo
from pdserve.worker.transports.values import (
    KvDestinationSpec,
    RejectReason,
    TransferFailedError,
    TransferPoll,
)

LAYOUT = KvLayout(num_layers=4, num_blocks=64, block_size_tokens=16, block_nbytes=4096)
WAIT_S = 10.0


def _random_cache(layout: KvLayout, seed: int) -> KvCache:
    cache = KvCache(layout)
    rng = np.random.default_rng(seed)
    for buffer in cache.layer_buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
    return cache


class Rig:
    """A tcp receiver over cache B; senders out of cache A."""

    def __init__(self, layout: KvLayout, settings: TcpTransportSettings) -> None:
        self.layout = layout
        self.backend = TcpBackend(settings)
        self.cache_a, self.cache_b = _random_cache(layout, 1), _random_cache(layout, 2)
        self.owners = BlockOwnerTable(layout.num_blocks)
        self.receiver: TcpKvReceiver = self.backend.create_receiver(self.cache_b, self.owners)
        self.address = ""

    async def start(self, port: int = 0) -> None:
        self.address = await self.receiver.start("127.0.0.1", port)

    def ticket(self, dst: list[int], num_layers: int | None = None) -> FencingToken:
        token = FencingToken.new()
        self.owners.assign(token, dst)
        self.receiver.expect(token, dst, num_layers or self.layout.num_layers)
        return token

    def spec(self, dst: list[int]) -> KvDestinationSpec:
        return KvDestinationSpec(self.address, tuple(dst), "tcp", self.layout)

    def snapshot(self, block_ids: list[int]) -> np.ndarray:
        return np.stack([buffer[block_ids].copy() for buffer in self.cache_b.layer_buffers])

    def assert_landed(self, src: list[int], dst: list[int]) -> None:
        for layer in range(self.layout.num_layers):
            assert np.array_equal(self.cache_b.layer_buffers[layer][dst],
                                  self.cache_a.layer_buffers[layer][src]), f"layer {layer}"

    def reasons(self, token: FencingToken) -> list[RejectReason]:
        return [r.reason for r in self.receiver.rejections if r.token == token]

    async def send(self, token: FencingToken, src: list[int], dst: list[int]) -> None:
        sender = self.backend.create_sender(self.cache_a)
        try:
            await sender.open(self.spec(dst), token)
            await sender.offer_layers(range(self.layout.num_layers), src)
            await sender.finish(0, 0.0)
        finally:
            await sender.close()


@contextlib.asynccontextmanager
async def _rig(layout: KvLayout = LAYOUT, **settings: object) -> AsyncIterator[Rig]:
    rig = Rig(layout, TcpTransportSettings(**settings))  # type: ignore[arg-type]
    await rig.start()
    try:
        yield rig
    finally:
        await rig.receiver.close()
        tcp_sender.close_sender_connections()


class _Trickle:
    """A socket whose first send takes one small piece of the frame and whose later sends find
    the buffer full until ``is_holding`` is cleared: a frame is caught half written whatever
    the kernel's socket buffers would have absorbed."""

    def __init__(self, sock: socket.socket, first_nbytes: int = 4096) -> None:
        self._sock = sock
        self._first_nbytes = first_nbytes
        self.num_bytes_sent = 0
        self.is_holding = True

    def sendmsg(self, buffers: list[memoryview]) -> int:
        if not self.is_holding:
            return self._sock.sendmsg(buffers)
        if self.num_bytes_sent:
            raise BlockingIOError
        sent = self._sock.sendmsg([memoryview(buffers[0]).cast("B")[: self._first_nbytes]])
        self.num_bytes_sent += sent
        return sent

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


async def _eventually(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(5000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


# ---- shared connections -----------------------------------------------------------------------


async def test_tickets_to_one_receiver_share_one_connection() -> None:
    async with _rig() as rig:
        jobs = [([i, i + 8], [40 + i, 20 + i]) for i in range(5)]
        tokens = [rig.ticket(dst) for _, dst in jobs]
        for token, (src, dst) in zip(tokens[:2], jobs[:2], strict=True):  # one after another
            await rig.send(token, src, dst)
        await asyncio.gather(*(rig.send(token, src, dst)  # and at once
                               for token, (src, dst) in zip(tokens[2:], jobs[2:], strict=True)))
        for token, (src, dst) in zip(tokens, jobs, strict=True):
            assert (await rig.receiver.wait(token, WAIT_S)).num_layers == LAYOUT.num_layers
            rig.assert_landed(src, dst)
        assert rig.receiver.num_accepted == 1
        assert rig.receiver.num_rejections == 0


async def test_a_refused_ticket_fails_alone_on_a_shared_connection() -> None:
    async with _rig() as rig:
        good = rig.ticket([40, 41])
        unknown = FencingToken.new()  # never expected: its HELLO is refused
        foreign = [10, 11]  # owned by nobody
        before = rig.snapshot(foreign)
        good_sender = rig.backend.create_sender(rig.cache_a)
        bad_sender = rig.backend.create_sender(rig.cache_a)
        await good_sender.open(rig.spec([40, 41]), good)
        await bad_sender.open(rig.spec(foreign), unknown)
        with pytest.raises(TransferFailedError):
            for layer in range(LAYOUT.num_layers):  # the two tickets' frames interleave
                await good_sender.offer_layer(layer, [0, 1])
                await bad_sender.offer_layer(layer, [2, 3])
            await bad_sender.finish(0, 0.0)
        await good_sender.finish(0, 0.0)
        await good_sender.close()
        await bad_sender.close()

        await rig.receiver.wait(good, WAIT_S)
        rig.assert_landed([0, 1], [40, 41])
        assert np.array_equal(rig.snapshot(foreign), before)
        # One refusal (the HELLO); the frames behind it were dropped unanswered.
        assert rig.reasons(unknown) == [RejectReason.UNKNOWN_TICKET]
        later = rig.ticket([50, 51])  # the connection still serves
        await rig.send(later, [4, 5], [50, 51])
        await rig.receiver.wait(later, WAIT_S)
        assert rig.receiver.num_accepted == 1


async def test_a_broken_connection_fails_its_tickets_and_the_next_ticket_reconnects() -> None:
    async with _rig() as rig:
        token = rig.ticket([40, 41])
        sender = rig.backend.create_sender(rig.cache_a)
        await sender.open(rig.spec([40, 41]), token)
        await sender.offer_layer(0, [0, 1])
        connection = sender._connection  # white box: a malformed frame on the wire
        assert connection is not None
        await connection.io.send_views([b"XXXX" + bytes(HEADER_NBYTES - 4)])
        with pytest.raises(TransferFailedError):
            await sender.finish(0, 0.0)
        await sender.close()
        with pytest.raises(TransferFailedError):
            await rig.receiver.wait(token, WAIT_S)
        assert RejectReason.MALFORMED_FRAME in [r.reason for r in rig.receiver.rejections]

        after = rig.ticket([50, 51])
        await rig.send(after, [4, 5], [50, 51])
        await rig.receiver.wait(after, WAIT_S)
        rig.assert_landed([4, 5], [50, 51])
        assert rig.receiver.num_accepted == 2


async def test_a_restarted_receiver_gets_a_fresh_connection() -> None:
    async with _rig() as rig:
        first = rig.ticket([40, 41])
        await rig.send(first, [0, 1], [40, 41])
        await rig.receiver.wait(first, WAIT_S)
        port = int(rig.address.rpartition(":")[2])
        await rig.receiver.close()  # closes the pooled connection from the receiver's side

        rig.receiver = rig.backend.create_receiver(rig.cache_b, rig.owners)
        await rig.start(port)
        second = rig.ticket([50, 51])
        for _ in range(50):  # the old connection may be picked before its close is read
            with contextlib.suppress(TransferFailedError):
                await rig.send(second, [4, 5], [50, 51])
                break
        await rig.receiver.wait(second, WAIT_S)
        rig.assert_landed([4, 5], [50, 51])


async def test_an_idle_connection_closes_and_the_next_ticket_reconnects() -> None:
    async with _rig(idle_close_s=0.02) as rig:
        first = rig.ticket([40, 41])
        await rig.send(first, [0, 1], [40, 41])
        await rig.receiver.wait(first, WAIT_S)
        await asyncio.sleep(0.1)
        second = rig.ticket([50, 51])
        await rig.send(second, [4, 5], [50, 51])
        await rig.receiver.wait(second, WAIT_S)
        assert rig.receiver.num_accepted == 2


async def test_a_sender_cancelled_mid_frame_leaves_the_shared_stream_whole() -> None:
    layout = KvLayout(num_layers=2, num_blocks=16, block_size_tokens=16, block_nbytes=1 << 20)
    async with _rig(layout) as rig:
        big_src, big_dst = list(range(8)), list(range(8, 16))
        big = rig.ticket(big_dst)
        small = FencingToken.new()
        rig.owners.assign(small, [0])
        rig.receiver.expect(small, [0], layout.num_layers)
        big_sender = rig.backend.create_sender(rig.cache_a)
        await big_sender.open(rig.spec(big_dst), big)
        io = big_sender._connection.io  # type: ignore[union-attr]
        trickle = _Trickle(io.sock)
        io.sock = trickle  # type: ignore[assignment]
        offer = asyncio.ensure_future(big_sender.offer_layer(0, big_src))  # 8 MiB
        await _eventually(lambda: io._is_writing and trickle.num_bytes_sent > 0,
                          "the frame is half written")
        offer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await offer
        assert 0 < trickle.num_bytes_sent < 8 << 20  # the cancel came mid-frame
        trickle.is_holding = False  # the rest of the frame may go now
        await big_sender.abort("cancelled")

        await rig.send(small, [15], [0])  # behind the rest of the big frame, on the same stream
        await rig.receiver.wait(small, WAIT_S)
        rig.assert_landed([15], [0])
        with pytest.raises(TransferFailedError, match="aborted"):
            await rig.receiver.wait(big, WAIT_S)
        assert rig.receiver.num_accepted == 1
        assert RejectReason.MALFORMED_FRAME not in [r.reason for r in rig.receiver.rejections]


@pytest.mark.parametrize("closed_by", ["peer", "sender"])
async def test_a_sender_waiting_to_write_fails_when_the_connection_closes(closed_by: str) -> None:
    """A peer that accepts and never reads: the sender's frame fills the buffers and waits for
    room. When the connection closes — the peer goes away, or this process closes it (another
    ticket's failed write, shutdown) — the wait ends in a failure instead of lasting forever."""
    layout = KvLayout(num_layers=1, num_blocks=16, block_size_tokens=16, block_nbytes=1 << 20)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    sender = TcpBackend().create_sender(_random_cache(layout, 1))
    accepted = asyncio.ensure_future(loop.sock_accept(listener))
    await sender.open(KvDestinationSpec(address, tuple(range(16)), "tcp", layout),
                      FencingToken.new())
    peer, _ = await accepted
    try:
        io = sender._connection.io  # type: ignore[union-attr]
        trickle = _Trickle(io.sock)  # the buffers stay full, however large the kernel's are
        io.sock = trickle  # type: ignore[assignment]
        offer = asyncio.ensure_future(sender.offer_layer(0, list(range(16))))  # 16 MiB
        await _eventually(lambda: io._is_writing and trickle.num_bytes_sent > 0,
                          "the sender waits for room")
        if closed_by == "peer":
            peer.close()
        else:
            tcp_sender.close_sender_connections()
        with pytest.raises(TransferFailedError):
            await asyncio.wait_for(offer, WAIT_S)
        assert sender.poll() is TransferPoll.FAILED
    finally:
        await sender.close()
        peer.close()
        listener.close()
        tcp_sender.close_sender_connections()


def test_closing_a_socket_fails_the_writes_queued_on_it() -> None:
    async def run() -> None:
        ours, theirs = socket.socketpair()
        io = SocketIo(ours, TcpTransportSettings())
        chunk = bytes(1 << 20)
        while io.write([chunk]) is None:  # until the kernel's buffer is full
            pass
        queued = io.write([b"next frame"])
        assert queued is not None and not queued.done()
        io.close()  # before the writer task ever ran
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(queued, WAIT_S)
        theirs.close()

    asyncio.run(run())


# ---- multi-layer frames --------------------------------------------------------------------------


async def test_layers_ready_together_go_as_one_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real_prefix = tcp_sender.layer_frame_prefix

    def recording_prefix(*args: object, **kwargs: object) -> bytes:
        sizes.append(int(args[4]) if len(args) > 4 else 1)  # type: ignore[call-overload]
        return real_prefix(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tcp_sender, "layer_frame_prefix", recording_prefix)
    async with _rig() as rig:
        src, dst = [0, 1, 2, 9], [40, 41, 7, 30]
        token = rig.ticket(dst)
        sender = rig.backend.create_sender(rig.cache_a)
        await sender.open(rig.spec(dst), token)
        await sender.offer_layers([0, 1, 2], src)
        await sender.offer_layers([3], src)
        result = await sender.finish(5, 0.0)
        await sender.close()
        assert sizes == [3, 1]
        assert result.num_layers == LAYOUT.num_layers
        landed = await rig.receiver.wait(token, WAIT_S)
        assert landed.num_bytes == LAYOUT.num_layers * len(dst) * LAYOUT.block_nbytes
        rig.assert_landed(src, dst)


async def test_a_layers_frame_with_one_duplicate_layer_is_refused_whole() -> None:
    async with _rig() as rig:
        src, dst = [0, 1], [40, 41]
        token = rig.ticket(dst)
        sender = rig.backend.create_sender(rig.cache_a)
        await sender.open(rig.spec(dst), token)
        await sender.offer_layer(1, src)
        await _eventually(lambda: rig.receiver.poll(token) is TransferPoll.TRANSFERRING, "layer 1")
        before = rig.snapshot(dst)
        with pytest.raises(TransferFailedError):
            await sender.offer_layers([0, 1, 2], src)
            await sender.finish(0, 0.0)
        await sender.close()
        assert np.array_equal(rig.snapshot(dst), before)  # layers 0 and 2 did not land either
        assert rig.reasons(token)[0] == RejectReason.DUPLICATE_LAYER


# ---- the wire, from a hand-driven peer -----------------------------------------------------------


class RawPeer:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.limits = FrameLimits(block_nbytes=LAYOUT.block_nbytes, num_blocks=LAYOUT.num_blocks)

    @staticmethod
    async def connect(address: str) -> RawPeer:
        host, _, port = address.rpartition(":")
        return RawPeer(*await asyncio.open_connection(host, int(port)))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self) -> tuple[FrameType, FencingToken | None, ErrorPayload | bytes]:
        header = decode_header(await self.reader.readexactly(HEADER_NBYTES), self.limits)
        payload = await self.reader.readexactly(header.payload_nbytes)
        if header.frame_type is FrameType.ERROR:
            return header.frame_type, header.token, ErrorPayload.decode(payload)
        return header.frame_type, header.token, payload

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionResetError):
            await self.writer.wait_closed()


def _hello(token: FencingToken, dst: list[int], flags: int) -> bytes:
    payload = HelloPayload(LAYOUT.num_layers, LAYOUT.block_size_tokens, LAYOUT.block_nbytes)
    return encode_frame(FrameType.HELLO, token, block_ids=dst, payload=payload.encode(),
                        flags=flags)


def _layers(token: FencingToken, first: int, num_layers: int, dst: list[int], value: int) -> bytes:
    prefix = layer_frame_prefix(token, first, np.array(dst), LAYOUT.block_nbytes, num_layers)
    return prefix + bytes([value]) * (num_layers * len(dst) * LAYOUT.block_nbytes)


def _done(token: FencingToken, num_layers: int) -> bytes:
    return encode_frame(FrameType.DONE, token, payload=DonePayload(0, 0.0, num_layers).encode())


async def test_a_refused_no_ack_hello_silences_the_tickets_later_frames() -> None:
    async with _rig() as rig:
        good = rig.ticket([40, 41])
        unknown = FencingToken.new()
        before = rig.snapshot([10, 11])
        peer = await RawPeer.connect(rig.address)
        await peer.send(_hello(good, [40, 41], FLAG_NO_ACK))
        await peer.send(_hello(unknown, [10, 11], FLAG_NO_ACK))
        await peer.send(_layers(unknown, 0, LAYOUT.num_layers, [10, 11], 0xAB))
        await peer.send(_done(unknown, LAYOUT.num_layers))
        await peer.send(_layers(good, 0, LAYOUT.num_layers, [40, 41], 0xCD))
        await peer.send(_done(good, LAYOUT.num_layers))
        # Replies: the refused HELLO's ERROR, then the good DONE's ACK; nothing in between.
        kind, token, error = await peer.reply()
        assert (kind, token) == (FrameType.ERROR, unknown)
        assert isinstance(error, ErrorPayload) and error.reason == RejectReason.UNKNOWN_TICKET
        kind, token, answered = await peer.reply()
        assert (kind, token, answered) == (FrameType.ACK, good, bytes([FrameType.DONE]))
        assert rig.reasons(unknown) == [RejectReason.UNKNOWN_TICKET]
        assert np.array_equal(rig.snapshot([10, 11]), before)
        await rig.receiver.wait(good, WAIT_S)
        assert (rig.cache_b.layer_buffers[3][[40, 41]] == 0xCD).all()
        await peer.close()


async def test_a_hello_without_no_ack_is_still_acknowledged() -> None:
    async with _rig() as rig:
        token = rig.ticket([40, 41])
        peer = await RawPeer.connect(rig.address)
        await peer.send(_hello(token, [40, 41], 0))
        assert await peer.reply() == (FrameType.ACK, token, bytes([FrameType.HELLO]))
        await peer.close()


async def test_a_layers_frame_past_the_tickets_layers_is_refused() -> None:
    async with _rig() as rig:
        token = rig.ticket([40, 41], num_layers=2)  # the layout has 4
        before = rig.snapshot([40, 41])
        peer = await RawPeer.connect(rig.address)
        await peer.send(_layers(token, 1, 3, [40, 41], 0xEE))
        kind, _, error = await peer.reply()
        assert kind is FrameType.ERROR and isinstance(error, ErrorPayload)
        assert error.reason == RejectReason.LAYER_OUT_OF_RANGE
        assert error.refused_type == FrameType.LAYERS
        assert np.array_equal(rig.snapshot([40, 41]), before)
        await peer.close()


async def test_a_long_frame_arriving_slowly_lands_and_so_does_the_frame_after_it() -> None:
    layout = KvLayout(num_layers=1, num_blocks=8, block_size_tokens=16, block_nbytes=128 * 1024)
    async with _rig(layout) as rig:
        dst = [1, 2, 3, 4]  # 512 KiB: above the low-water-mark threshold
        token = rig.ticket(dst)
        peer = await RawPeer.connect(rig.address)
        frame = (layer_frame_prefix(token, 0, np.array(dst), layout.block_nbytes)
                 + bytes(range(256)) * (len(dst) * layout.block_nbytes // 256))
        for start in range(0, len(frame), 100_000):  # pieces below the mark, with pauses
            await peer.send(frame[start : start + 100_000])
            await asyncio.sleep(0.01)
        await peer.send(_done(token, 1))  # a short read after a long one: the mark is reset
        kind, _, answered = await asyncio.wait_for(peer.reply(), WAIT_S)
        assert (kind, answered) == (FrameType.ACK, bytes([FrameType.DONE]))
        landed = rig.cache_b.layer_buffers[0][dst].reshape(-1)
        assert landed.tobytes() == frame[-len(dst) * layout.block_nbytes :]
        await peer.close()
