"""KV frame versions: what each version carries, how a sender picks one, and that a receiver of
this release serves senders of either version (a fleet mid-upgrade).

- ``negotiate_frame_version``: the highest common version; a destination that announces none
  (an older receiver) gets version 1; no common version is a clear error naming the field.
- Version 2's one addition, DONE's ``KV_CRC32`` flag: encoded and decoded; refused in a version 1
  frame and on any other frame type. Version 3's, that checksum as a CRC-32C (spoken where the
  CPU computes it in hardware): both sides compute it, a version 2 peer still gets CRC-32.
- Over real sockets: a sender writes every frame of a ticket at the negotiated version and the
  receiver answers at that version (raw bytes of a version 1 sender are served exactly as an
  older release's receiver would); at version 2 both sides agree on the KV's CRC-32, and KV that
  differs from what the sender checksummed (a byte changed on the way) is refused as
  ``checksum_mismatch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator

import crc32c
import numpy as np
import pytest

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_checksums import HAS_FAST_CRC32C, crc_kind_for, kv_checksum
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.frames import (
    FLAG_KV_CRC32,
    FLAG_NO_ACK,
    FRAME_VERSIONS,
    HEADER_NBYTES,
    DonePayload,
    ErrorPayload,
    FrameError,
    FrameLimits,
    FrameType,
    HelloPayload,
    NoCommonFrameVersionError,
    decode_header,
    encode_frame,
    layer_frame_prefix,
    negotiate_frame_version,
)
from pdserve.worker.transports.tcp import sender as tcp_sender
from pdserve.worker.transports.tcp.backend import TcpBackend
from pdserve.worker.transports.tcp.receiver import TcpKvReceiver
from pdserve.worker.transports.values import (
    KvDestinationSpec,
    RejectReason,
    TransferFailedError,
    TransferPoll,
)

CHECKED_VERSIONS = [(1, 2), pytest.param((1, 2, 3), marks=pytest.mark.skipif(
    not HAS_FAST_CRC32C, reason="no hardware CRC-32C here: version 3 is not spoken"))]
"""What destinations announce for a handoff checked at DONE: CRC-32 (2), CRC-32C (3)."""
LAYOUT = KvLayout(num_layers=3, num_blocks=32, block_size_tokens=16, block_nbytes=1024)
LIMITS = FrameLimits(block_nbytes=LAYOUT.block_nbytes, num_blocks=LAYOUT.num_blocks,
                     num_layers=LAYOUT.num_layers)
TOKEN = FencingToken("00000000-0000-4000-8000-000000000001", 2)
WAIT_S = 10.0


# ---- negotiation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("announced", "expected"), [
    ((), 1),  # a receiver older than the announcement reads version 1 only
    ((1,), 1),
    ((1, 2), 2),
    ((2,), 2),
    ((2, 1), 2),
    ((1, 2, 7), 2),  # a newer receiver: the highest version this sender speaks
    ((1, 2, 3), FRAME_VERSIONS[-1]),
    ((1, 2, 3, 7), FRAME_VERSIONS[-1]),
])
def test_a_sender_writes_the_highest_version_both_sides_speak(
        announced: tuple[int, ...], expected: int) -> None:
    assert negotiate_frame_version(announced) == expected


def test_no_common_version_is_an_error_naming_the_field() -> None:
    with pytest.raises(NoCommonFrameVersionError) as caught:
        negotiate_frame_version((7, 8))
    assert isinstance(caught.value, InvalidArgumentError)
    assert caught.value.field == "destination.kv_frame_versions"
    assert "[7, 8]" in caught.value.message


def test_this_release_reads_versions_1_2_and_3_where_crc32c_is_in_hardware() -> None:
    assert FRAME_VERSIONS == ((1, 2, 3) if HAS_FAST_CRC32C else (1, 2))
    assert TcpKvReceiver.frame_versions == FRAME_VERSIONS
    assert TcpBackend().frame_versions == FRAME_VERSIONS


# ---- the frames ----------------------------------------------------------------------------------


def test_a_version_2_done_carries_the_senders_crc32() -> None:
    done = DonePayload(first_token_id=9, prefill_compute_s=0.5, num_layers=3, kv_crc32=0xDEADBEEF)
    frame = encode_frame(FrameType.DONE, TOKEN, payload=done.encode(), flags=done.flags,
                         version=2)
    header = decode_header(frame[:HEADER_NBYTES], LIMITS)
    assert header.version == 2 and header.flags & FLAG_KV_CRC32
    assert DonePayload.decode(frame[HEADER_NBYTES:], header.flags) == done


def test_a_done_without_crc32_is_the_same_in_both_versions() -> None:
    done = DonePayload(first_token_id=9, prefill_compute_s=0.5, num_layers=3)
    assert done.flags == 0
    for version in (1, 2):
        frame = encode_frame(FrameType.DONE, TOKEN, payload=done.encode(), version=version)
        header = decode_header(frame[:HEADER_NBYTES], LIMITS)
        assert header.version == version
        assert DonePayload.decode(frame[HEADER_NBYTES:], header.flags) == done
        assert frame[HEADER_NBYTES:] == DonePayload(9, 0.5, 3).encode()


def test_kv_crc32_is_refused_in_version_1_and_on_other_frames() -> None:
    done = DonePayload(1, 0.0, 3, kv_crc32=5)
    v1_done = encode_frame(FrameType.DONE, TOKEN, payload=done.encode(), flags=done.flags,
                           version=1)
    with pytest.raises(FrameError, match="KV_CRC32 on a version 1 DONE"):
        decode_header(v1_done[:HEADER_NBYTES], LIMITS)
    abort = encode_frame(FrameType.ABORT, TOKEN, payload=b"x", flags=FLAG_KV_CRC32, version=2)
    with pytest.raises(FrameError, match="KV_CRC32 on a version 2 ABORT"):
        decode_header(abort[:HEADER_NBYTES], LIMITS)


def test_a_done_whose_crc32_flag_and_size_disagree_is_refused() -> None:
    short = encode_frame(FrameType.DONE, TOKEN, payload=DonePayload(1, 0.0, 3).encode(),
                         flags=FLAG_KV_CRC32, version=2)
    with pytest.raises(FrameError, match="DONE payload"):
        decode_header(short[:HEADER_NBYTES], LIMITS)


def test_layer_frames_name_their_version() -> None:
    for version in FRAME_VERSIONS:
        prefix = layer_frame_prefix(TOKEN, 1, np.array([3, 4]), LAYOUT.block_nbytes,
                                    version=version)
        assert decode_header(prefix[:HEADER_NBYTES], LIMITS).version == version


def test_an_unknown_version_is_refused() -> None:
    frame = bytearray(encode_frame(FrameType.ABORT, TOKEN, payload=b"x"))
    frame[4] = 4
    with pytest.raises(FrameError, match="version 4"):
        decode_header(bytes(frame[:HEADER_NBYTES]), LIMITS)


# ---- over sockets --------------------------------------------------------------------------------


def _random_cache(seed: int) -> KvCache:
    cache = KvCache(LAYOUT)
    rng = np.random.default_rng(seed)
    for buffer in cache.layer_buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
    return cache


class _Rig:
    """A tcp receiver over ``cache_b``; senders out of ``cache_a``."""

    def __init__(self) -> None:
        self.backend = TcpBackend()
        self.cache_a, self.cache_b = _random_cache(1), _random_cache(2)
        self.owners = BlockOwnerTable(LAYOUT.num_blocks)
        self.receiver = self.backend.create_receiver(self.cache_b, self.owners)
        self.address = ""

    def ticket(self, dst: list[int]) -> FencingToken:
        token = FencingToken.new()
        self.owners.assign(token, dst)
        self.receiver.expect(token, dst, LAYOUT.num_layers)
        return token

    def spec(self, dst: list[int], frame_versions: tuple[int, ...]) -> KvDestinationSpec:
        return KvDestinationSpec(self.address, tuple(dst), "tcp", LAYOUT,
                                 frame_versions=frame_versions)


@contextlib.asynccontextmanager
async def _rig() -> AsyncIterator[_Rig]:
    rig = _Rig()
    rig.address = await rig.receiver.start("127.0.0.1", 0)
    try:
        yield rig
    finally:
        await rig.receiver.close()
        tcp_sender.close_sender_connections()


@pytest.mark.parametrize(("announced", "version"), [
    ((), 1), ((1,), 1), ((1, 2), 2),
    pytest.param((1, 2, 3), 3, marks=pytest.mark.skipif(
        not HAS_FAST_CRC32C, reason="no hardware CRC-32C here: version 3 is not spoken"))])
async def test_a_handoff_runs_at_the_negotiated_version(announced: tuple[int, ...],
                                                        version: int) -> None:
    async with _rig() as rig:
        src, dst = [5, 1, 9], [20, 3, 11]
        token = rig.ticket(dst)
        sender = rig.backend.create_sender(rig.cache_a)
        await sender.open(rig.spec(dst, announced), token)
        assert sender.frame_version == version
        await sender.offer_layers(range(LAYOUT.num_layers), src)
        sent = await sender.finish(7, 0.1)
        await sender.close()
        landed = await rig.receiver.wait(token, WAIT_S)
        assert sent.frame_version == landed.frame_version == version
        kind = crc_kind_for(version)
        expected_crc32 = kv_checksum(rig.cache_a, src, kind)
        assert kv_checksum(rig.cache_b, dst, kind) == expected_crc32  # the KV itself arrived
        if version >= 2:  # checked at DONE, and handed to the audits on both sides
            assert sent.kv_crc32 == landed.kv_crc32 == expected_crc32
        else:
            assert sent.kv_crc32 is None and landed.kv_crc32 is None


@pytest.mark.parametrize("versions", CHECKED_VERSIONS)
async def test_chunked_offers_checksum_the_destination_in_sequence_order(
        versions: tuple[int, ...]) -> None:
    async with _rig() as rig:
        src, dst = [5, 1, 9, 14], [20, 3, 11, 0]
        token = rig.ticket(dst)
        sender = rig.backend.create_sender(rig.cache_a)
        await sender.open(rig.spec(dst, versions), token)
        for layer in range(LAYOUT.num_layers):  # second half first: order must not matter
            await sender.offer_layer(layer, src[2:], dst[2:])
            await sender.offer_layer(layer, src[:2], dst[:2])
        sent = await sender.finish(7, 0.1)
        await sender.close()
        landed = await rig.receiver.wait(token, WAIT_S)
        kind = crc_kind_for(versions[-1])
        assert sent.kv_crc32 == landed.kv_crc32 == kv_checksum(rig.cache_a, src, kind)


class _FlipsAByte:
    """A sender's socket that flips the last byte of the first write of at least ``min_nbytes``
    (a layer frame's, whose last byte is KV): bytes changed on the way, after the sender took
    its checksum of them."""

    def __init__(self, sock: object, min_nbytes: int) -> None:
        self._sock = sock
        self._min_nbytes = min_nbytes
        self.has_flipped = False

    def sendmsg(self, buffers: list[memoryview]) -> int:
        data = bytearray(b"".join(memoryview(b).cast("B") for b in buffers))
        if not self.has_flipped and len(data) >= self._min_nbytes:
            data[-1] ^= 0xFF
            self.has_flipped = True
        return int(self._sock.sendmsg([data]))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


async def _send_flipped(rig: _Rig, versions: tuple[int, ...], src: list[int], dst: list[int],
                        token: FencingToken) -> None:
    """One ticket whose first layer frame has a byte flipped on the wire; ``finish`` last."""
    sender = rig.backend.create_sender(rig.cache_a)
    try:
        await sender.open(rig.spec(dst, versions), token)
        io = sender._connection.io  # type: ignore[union-attr]  # noqa: SLF001
        flipper = _FlipsAByte(io.sock, LAYOUT.block_nbytes)
        io.sock = flipper  # type: ignore[assignment]
        try:
            await sender.offer_layers(range(LAYOUT.num_layers), src)
        finally:
            io.sock = flipper._sock  # type: ignore[assignment]  # noqa: SLF001
        assert flipper.has_flipped
        await sender.finish(7, 0.1)
    finally:
        await sender.close()


@pytest.mark.parametrize("versions", CHECKED_VERSIONS)
async def test_kv_that_differs_from_the_senders_is_refused_at_done(
        versions: tuple[int, ...]) -> None:
    async with _rig() as rig:
        src, dst = [2, 3], [30, 31]
        token = rig.ticket(dst)
        with pytest.raises(TransferFailedError, match="checksum_mismatch"):
            await _send_flipped(rig, versions, src, dst, token)
        assert rig.receiver.poll(token) is TransferPoll.FAILED
        assert [r.reason for r in rig.receiver.rejections if r.token == token] == [
            RejectReason.CHECKSUM_MISMATCH]
        with pytest.raises(TransferFailedError, match="checksum_mismatch"):
            await rig.receiver.wait(token, WAIT_S)


async def test_at_version_1_the_same_corruption_is_not_seen() -> None:
    """What version 2 adds: a version 1 handoff of the same changed bytes succeeds (only an
    audit comparing both sides' checksums later would see it)."""
    async with _rig() as rig:
        src, dst = [2, 3], [30, 31]
        token = rig.ticket(dst)
        await _send_flipped(rig, (), src, dst, token)
        await rig.receiver.wait(token, WAIT_S)
        assert kv_checksum(rig.cache_b, dst) != kv_checksum(rig.cache_a, src)


class _RawPeer:
    """A sender written by hand: the bytes an older release's sender puts on the wire."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @staticmethod
    async def connect(address: str) -> _RawPeer:
        host, _, port = address.rpartition(":")
        return _RawPeer(*await asyncio.open_connection(host, int(port)))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self) -> tuple[int, FrameType, bytes]:
        """(version byte, type, payload) of the receiver's next frame."""
        raw = await asyncio.wait_for(self.reader.readexactly(HEADER_NBYTES), WAIT_S)
        header = decode_header(raw, FrameLimits(block_nbytes=1, num_blocks=1))
        payload = await self.reader.readexactly(header.payload_nbytes)
        return raw[4], header.frame_type, payload

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionResetError):
            await self.writer.wait_closed()


def _hello(token: FencingToken, dst: list[int], version: int) -> bytes:
    payload = HelloPayload(LAYOUT.num_layers, LAYOUT.block_size_tokens, LAYOUT.block_nbytes)
    return encode_frame(FrameType.HELLO, token, block_ids=dst, payload=payload.encode(),
                        version=version)


def _all_layers(token: FencingToken, dst: list[int], value: int, version: int) -> bytes:
    prefix = layer_frame_prefix(token, 0, np.array(dst), LAYOUT.block_nbytes, LAYOUT.num_layers,
                                version)
    return prefix + bytes([value]) * (LAYOUT.num_layers * len(dst) * LAYOUT.block_nbytes)


@pytest.mark.parametrize("version", FRAME_VERSIONS)
async def test_the_receiver_answers_each_sender_at_its_own_version(version: int) -> None:
    async with _rig() as rig:
        dst = [6, 7]
        token = rig.ticket(dst)
        peer = await _RawPeer.connect(rig.address)
        try:
            await peer.send(_hello(token, dst, version))  # with an ACK: answered at its version
            assert await peer.reply() == (version, FrameType.ACK, bytes([FrameType.HELLO]))
            await peer.send(_all_layers(token, dst, 0x5A, version))
            # From version 2 DONE carries the KV's checksum in that version's algorithm
            # (CRC-32, then CRC-32C), taken here over the bytes sent, not by pdserve's code.
            sent = bytes([0x5A]) * (LAYOUT.num_layers * len(dst) * LAYOUT.block_nbytes)
            crc = (None if version < 2 else zlib.crc32(sent) if version == 2
                   else crc32c.crc32c(sent))
            done = DonePayload(0, 0.0, LAYOUT.num_layers, kv_crc32=crc)
            await peer.send(encode_frame(FrameType.DONE, token, version=version,
                                         payload=done.encode(), flags=done.flags))
            assert await peer.reply() == (version, FrameType.ACK, bytes([FrameType.DONE]))
            # A refusal, too, is written at the refused frame's version.
            await peer.send(_hello(FencingToken.new(), [1, 2], version))
            reply_version, kind, payload = await peer.reply()
            assert (reply_version, kind) == (version, FrameType.ERROR)
            assert ErrorPayload.decode(payload).reason == RejectReason.UNKNOWN_TICKET
        finally:
            await peer.close()
        result = await rig.receiver.wait(token, WAIT_S)
        assert (result.frame_version, result.kv_crc32) == (version, crc)
        assert all((rig.cache_b.layer_buffers[layer][dst] == 0x5A).all()
                   for layer in range(LAYOUT.num_layers))


async def test_a_version_1_sender_with_no_ack_is_served_as_before() -> None:
    """The exact frame sequence of the previous release's sender (HELLO with NO_ACK, LAYERS,
    DONE, all version 1): one ACK, of DONE, at version 1."""
    async with _rig() as rig:
        dst = [8, 9, 10]
        token = rig.ticket(dst)
        peer = await _RawPeer.connect(rig.address)
        try:
            payload = HelloPayload(LAYOUT.num_layers, LAYOUT.block_size_tokens,
                                   LAYOUT.block_nbytes)
            await peer.send(encode_frame(FrameType.HELLO, token, block_ids=dst,
                                         payload=payload.encode(), flags=FLAG_NO_ACK))
            await peer.send(_all_layers(token, dst, 0x11, 1))
            await peer.send(encode_frame(FrameType.DONE, token,
                                         payload=DonePayload(3, 0.2, LAYOUT.num_layers).encode()))
            assert await peer.reply() == (1, FrameType.ACK, bytes([FrameType.DONE]))
        finally:
            await peer.close()
        result = await rig.receiver.wait(token, WAIT_S)
        assert (result.frame_version, result.kv_crc32, result.first_token_id) == (1, None, 3)


# ---- the versions a process reports --------------------------------------------------------------


def test_the_software_version_starts_with_the_package_version() -> None:
    import importlib.metadata

    from pdserve.common.version import software_version

    version = software_version()
    assert version.startswith(importlib.metadata.version("pdserve"))
    assert software_version() is version  # computed once per process


def test_every_service_exports_its_build_info() -> None:
    from pdserve.common.metrics import REGISTRY
    from pdserve.common.runtime import set_build_info
    from pdserve.common.version import software_version

    set_build_info("kv-transfer")
    labels = {"service": "kv-transfer", "version": software_version()}
    assert REGISTRY.get_sample_value("pdserve_process_build_info", labels) == 1.0


def test_a_receiver_that_cannot_checksum_refuses_a_done_with_a_crc32() -> None:
    """``ReceiverTickets`` without ``kv_crc32_of`` (no view of the KV memory) cannot vouch for
    a sender's CRC-32: the DONE is refused, never accepted unchecked."""
    from pdserve.worker.transports.receiver_tickets import ReceiverTickets
    from pdserve.worker.transports.values import FrameRefusedError

    owners = BlockOwnerTable(LAYOUT.num_blocks)
    tickets = ReceiverTickets(LAYOUT, owners)
    token = FencingToken.new()
    owners.assign(token, [4, 5])
    tickets.expect(token, [4, 5], LAYOUT.num_layers)
    admission = tickets.admit_layers(token, 0, LAYOUT.num_layers, np.array([4, 5]))
    tickets.layer_landed(admission, 2 * LAYOUT.num_layers * LAYOUT.block_nbytes)
    with pytest.raises(FrameRefusedError) as caught:
        tickets.admit_done(token, 0, 0.0, LAYOUT.num_layers, frame_version=2, kv_crc32=1)
    assert caught.value.rejection.reason is RejectReason.PROTOCOL
    assert tickets.poll(token) is TransferPoll.FAILED
