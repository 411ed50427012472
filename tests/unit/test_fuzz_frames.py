"""Hostile byte streams against a live tcp KV receiver (hypothesis).

Each example opens a ticket that owns blocks ``DST`` of the receiver's cache, then a raw socket
sends either random bytes or a valid frame sequence for that ticket with mutations (bytes
flipped, header fields rewritten, bytes inserted, cut short). Whatever arrives:

- the receiver closes the connection (at once, with an ERROR frame, when the first header is
  malformed; otherwise at the latest when the sender stops);
- no byte lands outside the blocks the ticket owns;
- the receiver still serves a well-behaved sender afterwards, whose KV lands exactly.

The receiver runs on an event loop in a thread; hypothesis drives it with blocking sockets.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.addresses import parse_address
from pdserve.worker.transports.base import KvReceiver
from pdserve.worker.transports.frames import (
    HEADER_NBYTES,
    DonePayload,
    FrameError,
    FrameLimits,
    FrameType,
    HelloPayload,
    decode_header,
    encode_frame,
    layer_frame_prefix,
)
from pdserve.worker.transports.tcp.backend import TcpBackend
from pdserve.worker.transports.tcp.settings import TcpTransportSettings
from pdserve.worker.transports.values import KvDestinationSpec

T = TypeVar("T")
LAYOUT = KvLayout(num_layers=2, num_blocks=16, block_size_tokens=16, block_nbytes=64)
DST = [3, 4, 5, 9]
GOOD_DST = [12, 13]
IO_TIMEOUT_S = 5.0
LIMITS = FrameLimits(block_nbytes=LAYOUT.block_nbytes, num_blocks=LAYOUT.num_blocks,
                     max_block_ids=LAYOUT.num_blocks)


class LoopThread:
    """An event loop in a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        self.loop.close()


@dataclass
class Rig:
    loop: LoopThread
    backend: TcpBackend
    receiver: KvReceiver
    cache: KvCache
    source: KvCache
    owners: BlockOwnerTable
    address: str


def _random_cache(seed: int) -> KvCache:
    cache = KvCache(LAYOUT)
    rng = np.random.default_rng(seed)
    for buffer in cache.layer_buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
    return cache


def make_rig(backend: TcpBackend) -> Iterator[Rig]:
    loop = LoopThread()
    cache, source = _random_cache(1), _random_cache(2)
    owners = BlockOwnerTable(LAYOUT.num_blocks)

    async def start() -> tuple[KvReceiver, str]:
        receiver = backend.create_receiver(cache, owners)
        return receiver, await receiver.start("127.0.0.1", 0)

    receiver, address = loop.run(start())
    try:
        yield Rig(loop, backend, receiver, cache, source, owners, address)
    finally:
        loop.run(receiver.close())
        loop.close()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    yield from make_rig(TcpBackend())


def _snapshot(cache: KvCache) -> list[np.ndarray]:
    return [buffer.copy() for buffer in cache.layer_buffers]


def _changed_blocks(before: list[np.ndarray], cache: KvCache) -> set[int]:
    changed: set[int] = set()
    for old, new in zip(before, cache.layer_buffers, strict=True):
        changed |= {int(b) for b in np.flatnonzero((old != new).any(axis=1))}
    return changed


def valid_stream(token: FencingToken, source: KvCache) -> bytes:
    """HELLO, every layer of ``DST`` (from source blocks 0..3), DONE: one good transfer."""
    hello = HelloPayload(LAYOUT.num_layers, LAYOUT.block_size_tokens, LAYOUT.block_nbytes)
    parts = [encode_frame(FrameType.HELLO, token, block_ids=DST, payload=hello.encode())]
    for layer in range(LAYOUT.num_layers):
        ids = np.asarray(DST)
        parts.append(layer_frame_prefix(token, layer, ids, LAYOUT.block_nbytes))
        parts.append(source.layer_buffers[layer][: len(DST)].tobytes())
    parts.append(encode_frame(FrameType.DONE, token,
                              payload=DonePayload(7, 0.1, LAYOUT.num_layers).encode()))
    return b"".join(parts)


PLACEHOLDER = FencingToken("00000000-0000-4000-8000-00000000abcd", 1)
"""Token the mutated streams are drawn with; each example swaps in a fresh ticket's id, so the
data drawn never depends on a random token."""
_HELLO_NBYTES = HEADER_NBYTES + 4 * len(DST) + len(
    HelloPayload(0, 0, 0).encode())
_LAYER_NBYTES = HEADER_NBYTES + 4 * len(DST) + len(DST) * LAYOUT.block_nbytes
FRAME_OFFSETS = [0, *(_HELLO_NBYTES + i * _LAYER_NBYTES for i in range(LAYOUT.num_layers + 1))]
"""Where the frames of ``valid_stream`` start: HELLO, each LAYER, DONE."""

_HEADER_FIELDS = {  # name -> (offset, struct format)
    "version": (4, "<B"), "frame_type": (5, "<B"), "flags": (6, "<H"), "attempt": (24, "<I"),
    "layer": (28, "<I"), "num_block_ids": (32, "<I"), "payload_nbytes": (36, "<Q"),
}


@st.composite
def mutated(draw: st.DrawFn, stream: bytes) -> bytes:
    """``stream`` with a few hostile edits."""
    data = bytearray(stream)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "field", "insert", "truncate", "ids"]))
        if not data:
            break
        if kind == "flip":
            position = draw(st.integers(0, len(data) - 1))
            data[position] = draw(st.integers(0, 255))
        elif kind == "field":
            frame_start = draw(st.sampled_from(FRAME_OFFSETS))
            offset, fmt = _HEADER_FIELDS[draw(st.sampled_from(sorted(_HEADER_FIELDS)))]
            width = struct.calcsize(fmt)
            value = draw(st.integers(0, 2 ** (8 * width) - 1))
            if frame_start + offset + width <= len(data):
                data[frame_start + offset: frame_start + offset + width] = struct.pack(fmt, value)
        elif kind == "insert":
            position = draw(st.integers(0, len(data)))
            data[position:position] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "truncate":
            del data[draw(st.integers(0, len(data) - 1)):]
        else:  # block ids of the first frame: out of range, repeated, or another ticket's
            ids = draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(DST), max_size=len(DST)))
            if len(data) >= HEADER_NBYTES + 4 * len(DST):
                data[HEADER_NBYTES: HEADER_NBYTES + 4 * len(DST)] = struct.pack(
                    f"<{len(DST)}I", *ids)
    return bytes(data)


def _first_header_is_bad(data: bytes) -> bool:
    if len(data) < HEADER_NBYTES:
        return False
    try:
        decode_header(data[:HEADER_NBYTES], LIMITS)
    except FrameError:
        return True
    return False


def _send_and_wait_closed(address: str, data: bytes, *, half_close: bool) -> bytes:
    """Send ``data``; optionally stop sending; return what the receiver sent before closing.
    Fails the test if the receiver keeps the connection open for ``IO_TIMEOUT_S``."""
    host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=IO_TIMEOUT_S) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the receiver already hung up (reset, broken pipe, not connected): fine
        received = bytearray()
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                pytest.fail(f"receiver kept the connection open after {len(data)} hostile bytes")
            if not chunk:
                break
            received += chunk
    return bytes(received)


def _open_ticket(rig: Rig, block_ids: list[int]) -> FencingToken:
    token = FencingToken.new()

    async def open_() -> None:
        rig.owners.assign(token, block_ids)
        rig.receiver.expect(token, block_ids, LAYOUT.num_layers)

    rig.loop.run(open_())
    return token


def _close_ticket(rig: Rig, token: FencingToken) -> None:
    async def close_() -> None:
        rig.receiver.cancel(token, "example over")
        rig.owners.release(token)

    rig.loop.run(close_())


def _good_sender_round_trip(rig: Rig) -> None:
    """A well-behaved sender still gets its KV in, exactly."""
    token = _open_ticket(rig, GOOD_DST)
    src = [6, 7]

    async def transfer() -> None:
        sender = rig.backend.create_sender(rig.source)
        try:
            await sender.open(KvDestinationSpec(rig.address, tuple(GOOD_DST), "tcp", LAYOUT),
                              token)
            for layer in range(LAYOUT.num_layers):
                await sender.offer_layer(layer, src)
            await sender.finish(1, 0.0)
            await rig.receiver.wait(token, IO_TIMEOUT_S)
        finally:
            await sender.close()

    try:
        rig.loop.run(transfer())
        for layer in range(LAYOUT.num_layers):
            assert np.array_equal(rig.cache.layer_buffers[layer][GOOD_DST],
                                  rig.source.layer_buffers[layer][src])
    finally:
        _close_ticket(rig, token)


def _check_stream(rig: Rig, data: bytes, token: FencingToken) -> None:
    before = _snapshot(rig.cache)
    is_bad_header = _first_header_is_bad(data)
    try:
        # A malformed first header must end the connection without the sender's help.
        reply = _send_and_wait_closed(rig.address, data, half_close=not is_bad_header)
    finally:
        _close_ticket(rig, token)
    if is_bad_header:
        assert len(reply) >= HEADER_NBYTES
        assert decode_header(reply[:HEADER_NBYTES], LIMITS).frame_type is FrameType.ERROR
    changed = rig.loop.run(asyncio.to_thread(_changed_blocks, before, rig.cache))
    assert changed <= set(DST), f"bytes landed outside the ticket's blocks: {changed - set(DST)}"
    _good_sender_round_trip(rig)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(data=st.binary(max_size=2048))
def test_random_bytes_are_refused(rig: Rig, data: bytes) -> None:
    token = _open_ticket(rig, DST)
    _check_stream(rig, data, token)


@FUZZ
@given(data=st.data())
def test_mutated_transfers_never_write_outside_their_blocks(rig: Rig, data: st.DataObject) -> None:
    stream = data.draw(mutated(valid_stream(PLACEHOLDER, rig.source)))
    token = _open_ticket(rig, DST)
    placeholder_id = uuid.UUID(PLACEHOLDER.ticket_id).bytes
    _check_stream(rig, stream.replace(placeholder_id, uuid.UUID(token.ticket_id).bytes), token)


def test_bad_magic_gets_an_error_and_a_closed_connection(rig: Rig) -> None:
    token = _open_ticket(rig, DST)
    before = rig.receiver.num_rejections
    _check_stream(rig, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64), token)
    assert rig.receiver.num_rejections > before


def test_unmutated_stream_lands(rig: Rig) -> None:
    """The baseline the mutations start from really is a good transfer (else the mutation test
    would only ever exercise refusals)."""
    token = _open_ticket(rig, DST)
    _send_and_wait_closed(rig.address, valid_stream(token, rig.source), half_close=True)
    for layer in range(LAYOUT.num_layers):
        assert np.array_equal(rig.cache.layer_buffers[layer][DST],
                              rig.source.layer_buffers[layer][: len(DST)])
    _close_ticket(rig, token)


@pytest.fixture(scope="module")
def tls_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    pytest.importorskip("cryptography", reason="pdserve certs needs 'cryptography'")
    from pdserve.common.certs import make_dev_certs
    from pdserve.worker.transports.tcp.settings import KvTls

    directory = tmp_path_factory.mktemp("kv-tls")
    cert = make_dev_certs(directory, ["worker"])[0]
    tls = KvTls(cert.cert_path, cert.key_path, directory / "ca.pem")
    yield from make_rig(TcpBackend(TcpTransportSettings(tls=tls, connect_timeout_s=2.0)))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=1024),
                      st.binary(max_size=64).map(lambda tail: b"\x16\x03\x01\x02\x00" + tail)))
def test_tls_receiver_refuses_garbage_handshakes(tls_rig: Rig, data: bytes) -> None:
    token = _open_ticket(tls_rig, DST)
    before = _snapshot(tls_rig.cache)
    _send_and_wait_closed(tls_rig.address, data, half_close=True)
    _close_ticket(tls_rig, token)
    assert _changed_blocks(before, tls_rig.cache) == set()
    _good_sender_round_trip(tls_rig)
