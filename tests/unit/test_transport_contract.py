"""One contract suite run over every registered KV transport backend, then tcp at the wire level.

Cache A (prefill) and cache B (decode) hold random bytes; a ticket's layers go from some blocks
of A into a *different* set of blocks of B. The receiver must land exactly the admitted bytes
and nothing else: blocks it refused keep their old bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from pdserve.common.errors import (
    AlreadyExistsError,
    DeadlineError,
    InvalidArgumentError,
    NotFoundError,
)
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_owner import BlockOwnerTable, ForeignBlockError
from pdserve.worker.transports import registry
from pdserve.worker.transports.addresses import format_address, parse_address
from pdserve.worker.transports.base import KvReceiver, KvSender
from pdserve.worker.transports.block_views import coalesce_block_runs
from pdserve.worker.transports.frames import (
    HEADER_NBYTES,
    ErrorPayload,
    FrameLimits,
    FrameType,
    decode_header,
    encode_frame,
    layer_frame_prefix,
)
from pdserve.worker.transports.values import (
    KvDestinationSpec,
    RejectReason,
    TransferFailedError,
    TransferPoll,
)

LAYOUT = KvLayout(num_layers=4, num_blocks=64, block_size_tokens=16, block_nbytes=4096)
NUM_TICKET_BLOCKS = 12
WAIT_S = 10.0


class Rig:
    """A prefill cache A, a decode cache B with its owner table and started receiver."""

    def __init__(self, backend_name: str, receiver: KvReceiver, address: str,
                 cache_a: KvCache, cache_b: KvCache, owners: BlockOwnerTable) -> None:
        self.backend_name = backend_name
        self.backend = registry.get_backend(backend_name)
        self.receiver = receiver
        self.address = address
        self.cache_a = cache_a
        self.cache_b = cache_b
        self.owners = owners
        self._rng = np.random.default_rng(11)

    def spec(self, dst_block_ids: list[int]) -> KvDestinationSpec:
        return KvDestinationSpec(self.address, tuple(dst_block_ids), self.backend_name, LAYOUT)

    def sender(self) -> KvSender:
        return self.backend.create_sender(self.cache_a)

    def ticket(self, dst_block_ids: list[int], token: FencingToken | None = None) -> FencingToken:
        """Assign blocks to a fresh token and expect its KV, as the decode agent does."""
        token = token or FencingToken.new()
        self.owners.assign(token, dst_block_ids)
        self.receiver.expect(token, dst_block_ids, LAYOUT.num_layers)
        return token

    def snapshot(self, block_ids: list[int]) -> np.ndarray:
        return np.stack([buffer[block_ids].copy() for buffer in self.cache_b.layer_buffers])

    def assert_landed(self, src: list[int], dst: list[int], layers: range | None = None) -> None:
        for layer in layers or range(LAYOUT.num_layers):
            for s, d in zip(src, dst, strict=True):
                assert np.array_equal(
                    self.cache_b.layer_buffers[layer][d], self.cache_a.layer_buffers[layer][s]
                ), f"layer {layer}: dst block {d} != src block {s}"

    def assert_unchanged(self, block_ids: list[int], before: np.ndarray) -> None:
        assert np.array_equal(self.snapshot(block_ids), before), "refused bytes were written"

    def fill_b(self, block_ids: list[int]) -> None:
        for buffer in self.cache_b.layer_buffers:
            buffer[block_ids] = self._rng.integers(0, 256, (len(block_ids), LAYOUT.block_nbytes),
                                                   dtype=np.uint8)


async def send_all(sender: KvSender, src: list[int], layers: range | None = None) -> None:
    for layer in layers or range(LAYOUT.num_layers):
        await sender.offer_layer(layer, src)


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``predicate`` holds (a sync point, not a timing assertion)."""
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


def _random_cache(seed: int) -> KvCache:
    cache = KvCache(LAYOUT)
    rng = np.random.default_rng(seed)
    for buffer in cache.layer_buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
    return cache


@pytest.fixture(params=registry.registered_backends())
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    name = request.param
    if name not in registry.available_backends():
        pytest.skip(f"{name}: {registry.backend_status()[name]}")
    cache_a, cache_b = _random_cache(1), _random_cache(2)
    owners = BlockOwnerTable(LAYOUT.num_blocks)
    receiver = registry.get_backend(name).create_receiver(cache_b, owners)
    address = await receiver.start("127.0.0.1", 0)
    yield Rig(name, receiver, address, cache_a, cache_b, owners)
    await receiver.close()


# Source blocks (on A) and destination blocks (on B): different ids, with runs and gaps.
SRC = [0, 1, 2, 3, 10, 11, 20, 33, 34, 35, 50, 63]
DST = [40, 41, 42, 7, 8, 30, 5, 6, 60, 61, 62, 13]


async def test_layers_land_in_other_blocks(rig: Rig) -> None:
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in DST]
    before = rig.snapshot(untouched)
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    await send_all(sender, SRC)
    sent = await sender.finish(first_token_id=1234, prefill_compute_s=0.5)
    landed = await rig.receiver.wait(token, WAIT_S)
    await sender.close()

    rig.assert_landed(SRC, DST)
    rig.assert_unchanged(untouched, before)
    num_bytes = LAYOUT.num_layers * len(DST) * LAYOUT.block_nbytes
    for result in (sent, landed):
        assert (result.num_bytes, result.num_layers, result.num_blocks) == (
            num_bytes, LAYOUT.num_layers, len(DST))
        assert (result.first_token_id, result.prefill_compute_s) == (1234, 0.5)
        assert result.transfer_s >= 0
    assert rig.receiver.num_rejections == 0


async def test_poll_goes_waiting_transferring_success(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    assert rig.receiver.poll(token) is TransferPoll.WAITING
    await sender.open(rig.spec(DST), token)
    assert sender.poll() is TransferPoll.WAITING
    assert rig.receiver.poll(token) is TransferPoll.WAITING

    await sender.offer_layer(0, SRC)
    assert sender.poll() is TransferPoll.TRANSFERRING
    await eventually(lambda: rig.receiver.poll(token) is TransferPoll.TRANSFERRING,
                     "receiver saw the first layer")
    await send_all(sender, SRC, range(1, LAYOUT.num_layers))
    await sender.finish(7, 0.1)
    assert sender.poll() is TransferPoll.SUCCESS
    assert rig.receiver.poll(token) is TransferPoll.SUCCESS
    await rig.receiver.wait(token, WAIT_S)
    assert rig.receiver.poll(token) is TransferPoll.SUCCESS  # still known once collected
    await sender.close()


async def test_chunks_of_a_layer_may_come_separately(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    for layer in range(LAYOUT.num_layers):
        await sender.offer_layer(layer, SRC[:5], DST[:5])
        await sender.offer_layer(layer, SRC[5:], DST[5:])
    await sender.finish(1, 0.0)
    await rig.receiver.wait(token, WAIT_S)
    await sender.close()
    rig.assert_landed(SRC, DST)


async def test_concurrent_tickets_to_one_receiver(rig: Rig) -> None:
    rng = np.random.default_rng(5)
    src_perm, dst_perm = rng.permutation(64).tolist(), rng.permutation(64).tolist()
    jobs = [(src_perm[i * 16 : (i + 1) * 16], dst_perm[i * 16 : (i + 1) * 16]) for i in range(4)]
    tokens = [rig.ticket(dst) for _, dst in jobs]

    async def one(token: FencingToken, src: list[int], dst: list[int]) -> None:
        sender = rig.sender()
        await sender.open(rig.spec(dst), token)
        await send_all(sender, src)
        await sender.finish(0, 0.0)
        await sender.close()

    results = await asyncio.gather(
        *(one(token, src, dst) for token, (src, dst) in zip(tokens, jobs, strict=True)),
        *(rig.receiver.wait(token, WAIT_S) for token in tokens),
    )
    for token, (src, dst), result in zip(tokens, jobs, results[len(jobs):], strict=True):
        rig.assert_landed(src, dst)
        assert result.num_bytes == LAYOUT.num_layers * len(dst) * LAYOUT.block_nbytes
        assert rig.receiver.poll(token) is TransferPoll.SUCCESS


def _rejections_of(rig: Rig, token: FencingToken) -> list[RejectReason]:
    return [r.reason for r in rig.receiver.rejections if r.token == token]


def assert_refused(rig: Rig, token: FencingToken, reason: RejectReason) -> None:
    """The first refusal for ``token`` names ``reason``; later frames of the (now failed)
    ticket that were already on their way are refused as CANCELLED."""
    reasons = _rejections_of(rig, token)
    assert reasons and reasons[0] == reason, reasons
    assert set(reasons[1:]) <= {RejectReason.CANCELLED}, reasons


async def test_frame_for_blocks_the_token_does_not_own_is_refused(rig: Rig) -> None:
    token = rig.ticket(DST)
    other = rig.ticket([20, 21, 22])
    foreign = [20, 21, 22, 23]  # three owned by another ticket, one by nobody
    before = rig.snapshot(foreign)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    with pytest.raises(TransferFailedError):
        await sender.offer_layer(0, SRC[:4], foreign)
        await sender.finish(0, 0.0)
    await sender.close()

    rig.assert_unchanged(foreign, before)
    assert_refused(rig, token, RejectReason.FOREIGN_BLOCKS)
    assert rig.receiver.poll(token) is TransferPoll.FAILED
    assert rig.receiver.poll(other) is TransferPoll.WAITING  # the owner is unaffected
    with pytest.raises(TransferFailedError, match="foreign_blocks"):
        await rig.receiver.wait(token, WAIT_S)


async def test_blocks_the_token_owns_but_were_not_expected_are_refused(rig: Rig) -> None:
    token = FencingToken.new()
    rig.owners.assign(token, [*DST, 25])
    rig.receiver.expect(token, DST, LAYOUT.num_layers)
    before = rig.snapshot([25])
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    with pytest.raises(TransferFailedError):
        await sender.offer_layer(0, [0], [25])
        await sender.finish(0, 0.0)
    await sender.close()
    rig.assert_unchanged([25], before)
    assert_refused(rig, token, RejectReason.UNEXPECTED_BLOCKS)


async def test_late_frame_after_cancel_never_lands_in_reassigned_blocks(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    await sender.offer_layer(0, SRC)
    await eventually(lambda: rig.receiver.poll(token) is TransferPoll.TRANSFERRING, "layer 0")

    # The lease lapsed: the decode agent cancels, releases and hands the blocks to a new ticket.
    rig.receiver.cancel(token, "lease expired")
    rig.owners.release(token)
    successor = rig.ticket(DST)
    rig.fill_b(DST)
    before = rig.snapshot(DST)

    with pytest.raises(TransferFailedError):
        await send_all(sender, SRC, range(1, LAYOUT.num_layers))
        await sender.finish(0, 0.0)
    await sender.close()

    rig.assert_unchanged(DST, before)
    reasons = _rejections_of(rig, token)
    assert reasons and set(reasons) == {RejectReason.CANCELLED}
    assert rig.receiver.poll(token) is TransferPoll.FAILED
    assert rig.receiver.poll(successor) is TransferPoll.WAITING


async def test_other_attempt_of_the_ticket_is_refused(rig: Rig) -> None:
    current = FencingToken.new()
    stale = FencingToken(current.ticket_id, current.attempt)
    current = FencingToken(current.ticket_id, 2)
    rig.ticket(DST, current)
    before = rig.snapshot(DST)
    stale_sender = rig.sender()
    with pytest.raises(TransferFailedError):  # at open, or later where open does not wait
        await stale_sender.open(rig.spec(DST), stale)
        await send_all(stale_sender, SRC)
        await stale_sender.finish(0, 0.0)
    await stale_sender.close()
    rig.assert_unchanged(DST, before)
    assert_refused(rig, stale, RejectReason.STALE_ATTEMPT)
    assert rig.receiver.poll(current) is TransferPoll.WAITING

    sender = rig.sender()  # the current attempt still goes through
    await sender.open(rig.spec(DST), current)
    await send_all(sender, SRC)
    await sender.finish(0, 0.0)
    await rig.receiver.wait(current, WAIT_S)
    await sender.close()
    rig.assert_landed(SRC, DST)


async def test_unknown_ticket_is_refused(rig: Rig) -> None:
    token = FencingToken.new()
    before = rig.snapshot(DST)
    sender = rig.sender()
    with pytest.raises(TransferFailedError):  # at open, or later where open does not wait
        await sender.open(rig.spec(DST), token)
        await send_all(sender, SRC)
        await sender.finish(0, 0.0)
    assert sender.poll() is TransferPoll.FAILED
    rig.assert_unchanged(DST, before)
    await sender.close()
    assert_refused(rig, token, RejectReason.UNKNOWN_TICKET)


async def test_wait_times_out_cleanly_when_a_layer_never_comes(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    await send_all(sender, SRC, range(LAYOUT.num_layers - 1))
    with pytest.raises(DeadlineError):
        await rig.receiver.wait(token, 0.05)
    assert rig.receiver.poll(token) is TransferPoll.TRANSFERRING  # untouched by the timeout
    rig.receiver.cancel(token, "gave up")
    assert rig.receiver.poll(token) is TransferPoll.FAILED
    with pytest.raises(TransferFailedError):
        await sender.offer_layer(LAYOUT.num_layers - 1, SRC)
        await sender.finish(0, 0.0)
    await sender.close()


async def test_done_before_every_layer_fails_the_ticket(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    await send_all(sender, SRC, range(2))
    with pytest.raises(TransferFailedError):
        await sender.finish(0, 0.0)
    await sender.close()
    assert_refused(rig, token, RejectReason.INCOMPLETE)
    with pytest.raises(TransferFailedError):
        await rig.receiver.wait(token, WAIT_S)


async def test_duplicate_layer_is_refused(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    await sender.offer_layer(0, SRC)
    with pytest.raises(TransferFailedError):
        await sender.offer_layer(0, SRC[:2], DST[:2])
        await sender.finish(0, 0.0)
    await sender.close()
    assert_refused(rig, token, RejectReason.DUPLICATE_LAYER)


async def test_sender_abort_fails_the_receiver_ticket(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    await sender.offer_layer(0, SRC)
    await sender.abort("prefill worker draining")
    assert sender.poll() is TransferPoll.FAILED
    with pytest.raises(TransferFailedError, match="prefill worker draining"):
        await rig.receiver.wait(token, WAIT_S)
    assert rig.receiver.poll(token) is TransferPoll.FAILED


async def test_sender_closed_before_finish_fails_the_ticket(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    await send_all(sender, SRC)
    await sender.close()
    with pytest.raises(TransferFailedError, match="connection lost|closed before finish"):
        await rig.receiver.wait(token, WAIT_S)


async def test_expect_requires_ownership_and_happens_once(rig: Rig) -> None:
    token = FencingToken.new()
    rig.owners.assign(token, DST[:-1])
    with pytest.raises(ForeignBlockError):
        rig.receiver.expect(token, DST, LAYOUT.num_layers)
    rig.owners.assign(token, DST[-1:])
    rig.receiver.expect(token, DST, LAYOUT.num_layers)
    with pytest.raises(AlreadyExistsError):
        rig.receiver.expect(token, DST, LAYOUT.num_layers)
    rig.receiver.cancel(token, "test")
    with pytest.raises(AlreadyExistsError):  # a fencing token is never revived
        rig.receiver.expect(token, DST, LAYOUT.num_layers)
    with pytest.raises(NotFoundError):
        rig.receiver.poll(FencingToken.new())


async def test_incompatible_destination_layout_is_refused_locally(rig: Rig) -> None:
    token = rig.ticket(DST)
    other = KvLayout(num_layers=4, num_blocks=64, block_size_tokens=16, block_nbytes=2048)
    sender = rig.sender()
    with pytest.raises(InvalidArgumentError):
        await sender.open(KvDestinationSpec(rig.address, tuple(DST), rig.backend_name, other),
                          token)
    await sender.close()


async def test_receiver_close_fails_tickets_in_flight(rig: Rig) -> None:
    token = rig.ticket(DST)
    sender = rig.sender()
    await sender.open(rig.spec(DST), token)
    await sender.offer_layer(0, SRC)
    await rig.receiver.close()
    with pytest.raises(TransferFailedError):
        await rig.receiver.wait(token, WAIT_S)
    await sender.close()


# ---- registry --------------------------------------------------------------------------------


def test_registry_knows_tcp_and_inproc_and_names_them_on_a_typo() -> None:
    assert {"tcp", "inproc"} <= set(registry.available_backends())
    assert registry.get_backend("tcp").name == "tcp"
    with pytest.raises(InvalidArgumentError, match=r"inproc.*tcp"):
        registry.get_backend("tpc")


def test_coalesce_block_runs() -> None:
    ids = np.array([4, 5, 6, 9, 3, 4, 10])
    assert coalesce_block_runs(ids) == [(4, 3), (9, 1), (3, 2), (10, 1)]
    assert coalesce_block_runs(np.array([], dtype=np.int64)) == []


def test_tcp_addresses() -> None:
    assert parse_address("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert parse_address(format_address("::1", 7001)) == ("::1", 7001)
    for bad in ("10.0.0.1", ":7000", "host:port"):
        with pytest.raises(InvalidArgumentError):
            parse_address(bad)


def test_destination_spec_proto_round_trip() -> None:
    spec = KvDestinationSpec("10.0.0.1:7000", (5, 1, 9), "tcp", LAYOUT, b"meta", "d-1")
    assert KvDestinationSpec.from_proto(spec.to_proto()) == spec


# ---- tcp at the wire level: a peer that does not follow the protocol ---------------------------


@pytest.fixture
async def tcp_rig() -> AsyncIterator[Rig]:
    cache_a, cache_b = _random_cache(1), _random_cache(2)
    owners = BlockOwnerTable(LAYOUT.num_blocks)
    receiver = registry.get_backend("tcp").create_receiver(cache_b, owners)
    address = await receiver.start("127.0.0.1", 0)
    yield Rig("tcp", receiver, address, cache_a, cache_b, owners)
    await receiver.close()


class RawPeer:
    """A hand-driven TCP peer speaking frames directly (no HELLO unless it sends one)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.limits = FrameLimits(block_nbytes=LAYOUT.block_nbytes, num_blocks=LAYOUT.num_blocks)

    @staticmethod
    async def connect(address: str) -> RawPeer:
        host, _, port = address.rpartition(":")
        return RawPeer(*await asyncio.open_connection(host, int(port)))

    def layer_frame(self, token: FencingToken, layer: int, dst: list[int], payload: bytes
                    ) -> bytes:
        ids = np.array(dst, dtype=np.int64)
        return layer_frame_prefix(token, layer, ids, LAYOUT.block_nbytes) + payload

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self) -> tuple[FrameType, ErrorPayload | None]:
        header = decode_header(await self.reader.readexactly(HEADER_NBYTES), self.limits)
        payload = await self.reader.readexactly(header.payload_nbytes)
        if header.frame_type is FrameType.ERROR:
            return header.frame_type, ErrorPayload.decode(payload)
        return header.frame_type, None

    async def is_cut_off(self) -> bool:
        """The receiver closed the connection (a reset if our bytes were left unread)."""
        try:
            return await self.reader.read() == b""
        except ConnectionResetError:
            return True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionResetError):
            await self.writer.wait_closed()


def _payload(num_blocks: int, value: int) -> bytes:
    return bytes([value]) * (num_blocks * LAYOUT.block_nbytes)


async def test_tcp_layer_without_hello_is_still_validated(tcp_rig: Rig) -> None:
    token = tcp_rig.ticket(DST)
    other = tcp_rig.ticket([20, 21])
    before = tcp_rig.snapshot([20, 21])
    peer = await RawPeer.connect(tcp_rig.address)
    await peer.send(peer.layer_frame(token, 0, [20, 21], _payload(2, 0xAB)))
    kind, error = await peer.reply()
    assert kind is FrameType.ERROR and error is not None
    assert error.reason == RejectReason.FOREIGN_BLOCKS and error.refused_type == FrameType.LAYER
    tcp_rig.assert_unchanged([20, 21], before)
    assert tcp_rig.receiver.poll(other) is TransferPoll.WAITING

    # The connection stays usable: a frame of an unrelated, stale attempt is refused too...
    stale = FencingToken(other.ticket_id, 2)
    await peer.send(peer.layer_frame(stale, 0, [20, 21], _payload(2, 0xCD)))
    assert (await peer.reply())[1].reason == RejectReason.STALE_ATTEMPT  # type: ignore[union-attr]
    tcp_rig.assert_unchanged([20, 21], before)
    # ... and a valid frame of the rightful owner lands.
    await peer.send(peer.layer_frame(other, 1, [21], _payload(1, 0xEF)))
    await eventually(lambda: bool((tcp_rig.cache_b.layer_buffers[1][21] == 0xEF).all()),
                     "owner's layer landed")
    await peer.close()


async def test_tcp_late_frame_after_cancel_is_refused(tcp_rig: Rig) -> None:
    token = tcp_rig.ticket(DST)
    tcp_rig.receiver.cancel(token, "lease expired")
    tcp_rig.owners.release(token)
    tcp_rig.ticket(DST)
    before = tcp_rig.snapshot(DST)
    peer = await RawPeer.connect(tcp_rig.address)
    await peer.send(peer.layer_frame(token, 1, DST, _payload(len(DST), 0x11)))
    kind, error = await peer.reply()
    assert kind is FrameType.ERROR and error is not None and error.reason == RejectReason.CANCELLED
    tcp_rig.assert_unchanged(DST, before)
    await peer.close()


@pytest.mark.parametrize("with_cancel", [True, False])
async def test_tcp_blocks_released_mid_frame_get_no_more_bytes(tcp_rig: Rig,
                                                               with_cancel: bool) -> None:
    """The rest of a frame whose blocks change owner while it arrives goes to scratch."""
    token = tcp_rig.ticket(DST)
    peer = await RawPeer.connect(tcp_rig.address)
    frame = peer.layer_frame(token, 0, DST, _payload(len(DST), 0x22))
    half = HEADER_NBYTES + 4 * len(DST) + (len(DST) // 2) * LAYOUT.block_nbytes
    await peer.send(frame[:half])
    await eventually(lambda: tcp_rig.receiver.poll(token) is TransferPoll.TRANSFERRING,
                     "frame admitted")
    if with_cancel:
        tcp_rig.receiver.cancel(token, "lease expired")
    tcp_rig.owners.release(token)
    successor = tcp_rig.ticket([b for b in range(LAYOUT.num_blocks) if b not in SRC][:20])
    tcp_rig.fill_b(DST)
    before = tcp_rig.snapshot(DST)
    await peer.send(frame[half:])
    kind, error = await peer.reply()
    assert kind is FrameType.ERROR and error is not None
    tcp_rig.assert_unchanged(DST, before)
    expected = RejectReason.CANCELLED if with_cancel else RejectReason.OWNERSHIP_LOST
    # The ERROR of the cancel can reach the peer before the receiver reads the rest.
    await eventually(lambda: expected in _rejections_of(tcp_rig, token), "rest refused")
    tcp_rig.assert_unchanged(DST, before)
    assert tcp_rig.receiver.poll(token) is TransferPoll.FAILED
    assert tcp_rig.receiver.poll(successor) is TransferPoll.WAITING
    await peer.close()


async def test_tcp_malformed_header_closes_the_connection_and_writes_nothing(
    tcp_rig: Rig,
) -> None:
    token = tcp_rig.ticket(DST)
    before = tcp_rig.snapshot(DST)
    peer = await RawPeer.connect(tcp_rig.address)
    frame = bytearray(peer.layer_frame(token, 0, DST, _payload(len(DST), 0x33)))
    frame[0:4] = b"XXXX"
    await peer.send(bytes(frame))
    kind, error = await peer.reply()
    assert kind is FrameType.ERROR and error is not None
    assert error.reason == RejectReason.MALFORMED_FRAME
    assert await peer.is_cut_off()
    tcp_rig.assert_unchanged(DST, before)
    assert tcp_rig.receiver.poll(token) is TransferPoll.WAITING  # nobody's ticket was named
    await peer.close()


async def test_tcp_peer_sending_replies_is_cut_off(tcp_rig: Rig) -> None:
    peer = await RawPeer.connect(tcp_rig.address)
    await peer.send(encode_frame(FrameType.ACK, None, payload=bytes([FrameType.HELLO])))
    assert await peer.is_cut_off()
    assert tcp_rig.receiver.rejections[-1].reason == RejectReason.PROTOCOL
    await peer.close()


async def test_tcp_unreachable_destination_fails_open() -> None:
    sender = registry.get_backend("tcp").create_sender(_random_cache(1))
    spec = KvDestinationSpec("127.0.0.1:1", tuple(DST), "tcp", LAYOUT)
    with pytest.raises(TransferFailedError, match="cannot connect"):
        await sender.open(spec, FencingToken.new())
    await sender.close()
