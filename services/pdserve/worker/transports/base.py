"""The role interfaces of the worker's KV data path, which every transport implements.

Two roles, after the connector roles of SGLang's disaggregation (``base/conn.py``):

- ``KvReceiver`` on the decode worker, one per worker, serving every ticket. Its owner
  ``expect``s a ticket once the blocks are picked and the owner table says the ticket's fencing
  token owns them; then it ``wait``s for the KV or ``cancel``s the ticket (lease lost, request
  cancelled) — after which nothing for that token can land.
- ``KvSender`` on the prefill worker, one per ticket: ``open`` towards the destination,
  ``offer_layer`` as each layer's KV is ready, ``finish`` with the first token.

The receiver decides what lands in its memory, whatever the transport:

- push (``tcp``, ``inproc``): ``offer_layer`` sends the bytes; the receiver validates every frame
  (``ReceiverTickets.admit_layer``) before writing a byte, and re-checks between partial reads.
- pull (``nixl``, one-sided RDMA READ): ``offer_layer`` only *announces* the layer; the receiver
  runs the same ``admit_layer`` and, only if admitted, READs the layer into its own blocks and
  reports ``layer_landed``. ``KvReceiver.metadata`` travels to the sender in
  ``KvDestinationSpec.metadata``.

The same validation rules (``transports.receiver_tickets``) back every backend, so one contract
test suite covers them all. Everything here lives on one event loop; nothing is thread-safe.
"""

from __future__ import annotations

import abc
import asyncio
import functools
from collections.abc import Sequence
from typing import NoReturn

from pdserve.common.errors import IllegalTransitionError, InvalidArgumentError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_checksums import kv_checksum
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.receiver_tickets import ReceiverTickets
from pdserve.worker.transports.values import (
    KvDestinationSpec,
    LayerOffer,
    MonotonicClock,
    Rejection,
    TransferFailedError,
    TransferPoll,
    TransferResult,
)


class KvReceiver(abc.ABC):
    """Decode side: one per worker, receives KV for every ticket it was told to ``expect``.

    The ticket bookkeeping (``expect``, ``poll``, ``wait``, ``cancel``, ``rejections``) is shared
    by every backend through ``ReceiverTickets``; a backend adds the data path.
    """

    def __init__(self, kv_cache: KvCache, owner_table: BlockOwnerTable, clock: MonotonicClock):
        if owner_table.num_blocks != kv_cache.layout.num_blocks:
            raise InvalidArgumentError(
                f"owner table has {owner_table.num_blocks} blocks, "
                f"KV cache {kv_cache.layout.num_blocks}"
            )
        self.kv_cache = kv_cache
        self.owner_table = owner_table
        self.tickets = ReceiverTickets(kv_cache.layout, owner_table, clock,
                                       kv_crc32_of=functools.partial(kv_checksum, kv_cache))

    frame_versions: tuple[int, ...] = (1,)
    """Versions of the transport's wire format this receiver reads; announced in the
    destinations it hands out (``KvDestinationSpec.frame_versions``)."""

    @abc.abstractmethod
    async def start(self, host: str, port: int) -> str:
        """Start serving; returns the address senders use (``kv_address``). Port 0 = any."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving; tickets still in flight fail with reason "receiver closed"."""

    def metadata(self) -> bytes:
        """What a sender needs beyond the address (pull transports); empty for push ones."""
        return b""

    def expect(self, token: FencingToken, dst_block_ids: Sequence[int], num_layers: int) -> None:
        """Register a ticket whose KV will arrive into ``dst_block_ids`` (all of ``num_layers``).

        Precondition: the owner table says ``token`` owns every one of ``dst_block_ids``
        (raises ``ForeignBlockError`` otherwise). A token is expected at most once, ever.
        """
        self.tickets.expect(token, dst_block_ids, num_layers)

    def poll(self, token: FencingToken) -> TransferPoll:
        """Raises ``NotFoundError`` for a token never expected (or long forgotten)."""
        return self.tickets.poll(token)

    async def wait(self, token: FencingToken, timeout_s: float) -> TransferResult:
        """The ticket's result once it succeeded. Raises ``TransferFailedError`` if it failed,
        ``DeadlineError`` after ``timeout_s`` (the ticket stays as it is: cancel it or wait
        again). A collected ticket is forgotten except for its final ``poll`` state."""
        return await self.tickets.wait(token, timeout_s)

    def cancel(self, token: FencingToken, reason: str) -> None:
        """End the ticket: any frame for it from now on is refused and nothing more of it lands.
        Call before releasing its blocks in the owner table. Idempotent; no-op on unknown
        tokens (they are refused anyway)."""
        self.tickets.cancel(token, reason)

    @property
    def rejections(self) -> tuple[Rejection, ...]:
        """The most recent refused frames, oldest first (bounded)."""
        return tuple(self.tickets.rejections)

    @property
    def num_rejections(self) -> int:
        """Refused frames since start (not bounded)."""
        return self.tickets.num_rejections


class KvSender(abc.ABC):
    """Prefill side: moves one ticket's KV from the local ``kv_cache`` to a destination.

    One coroutine drives a sender: ``open``, then ``offer_layer`` per layer (in any order, each
    layer once per destination block), then ``finish``; or ``abort`` at any point. Source blocks
    must not change until ``finish`` returns (a pull transport reads them late).
    """

    def __init__(self, kv_cache: KvCache, clock: MonotonicClock) -> None:
        self.kv_cache = kv_cache
        self._clock = clock
        self._state = TransferPoll.WAITING
        self._failure_reason = ""
        self._dest: KvDestinationSpec | None = None
        self._token: FencingToken | None = None
        self._num_bytes = 0
        self._offered_layers: set[int] = set()
        self._started_s: float | None = None

    @abc.abstractmethod
    async def open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        """Connect to the destination and introduce the ticket. Raises ``TransferFailedError`` if
        the destination is unreachable, ``InvalidArgumentError`` if ``dest`` does not fit the
        local layout. A receiver's refusal of the ticket (unknown, stale, cancelled, wrong shape)
        raises ``TransferFailedError`` here, or — on a backend that does not wait for the
        receiver's answer (``tcp``) — from a later ``offer_layer`` or at the latest ``finish``;
        nothing of a refused ticket lands either way."""

    @abc.abstractmethod
    async def offer_layer(
        self, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int] | None = None
    ) -> None:
        """Make layer ``layer`` of ``src_block_ids`` available to the receiver.

        Destination defaults to ``dest.block_ids`` (so ``src_block_ids`` is the sequence's block
        table on this worker); pass ``dst_block_ids`` to send a chunk. Push transports send the
        bytes now (returns once the kernel has them); pull transports announce the layer and the
        receiver READs it. Raises ``TransferFailedError`` if the transfer is known to have
        failed; a refusal the receiver reports later surfaces in ``finish``.
        """

    async def offer_layers(
        self, layers: Sequence[int], src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        """``offer_layer`` for several layers that are ready at once (same blocks), in order.
        A backend may move them together (``tcp``: one frame per run of consecutive layers)."""
        for layer in layers:
            await self.offer_layer(layer, src_block_ids, dst_block_ids)

    @abc.abstractmethod
    async def finish(self, first_token_id: int, prefill_compute_s: float) -> TransferResult:
        """Tell the receiver every layer was offered; returns once it has them all. Raises
        ``TransferFailedError`` if the receiver refused anything or the link broke."""

    @abc.abstractmethod
    async def abort(self, reason: str) -> None:
        """Give up; the receiver marks the ticket FAILED with ``reason``. Closes the sender."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection. A sender closed before ``finish`` returned has FAILED."""

    def poll(self) -> TransferPoll:
        return self._state

    @property
    def failure_reason(self) -> str:
        return self._failure_reason

    # ---- helpers for backends -------------------------------------------------------------

    def _check_open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        if self._dest is not None:
            raise IllegalTransitionError("sender is already open")
        local = self.kv_cache.layout
        remote = dest.layout
        if (local.num_layers, local.block_size_tokens, local.block_nbytes) != (
            remote.num_layers,
            remote.block_size_tokens,
            remote.block_nbytes,
        ):
            raise InvalidArgumentError(
                f"destination layout {remote} does not fit local layout {local}", field="layout"
            )
        if not dest.block_ids:
            raise InvalidArgumentError("destination has no blocks", field="block_ids")
        self._dest = dest
        self._token = token

    def _make_offer(
        self, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int] | None
    ) -> LayerOffer:
        if self._state.is_terminal:
            raise TransferFailedError(
                f"transfer of {self._token} already {self._state}: {self._failure_reason}",
                reason=self._failure_reason,
            )
        if self._dest is None:
            raise IllegalTransitionError("offer_layer before open")
        if not 0 <= layer < self.kv_cache.layout.num_layers:
            raise InvalidArgumentError(f"layer {layer} out of range", field="layer")
        dst = (self._dest.block_ids if dst_block_ids is None
               else tuple(map(int, dst_block_ids)))
        offer = LayerOffer(layer, tuple(map(int, src_block_ids)), dst)
        num_blocks = self.kv_cache.layout.num_blocks
        if min(offer.src_block_ids) < 0 or max(offer.src_block_ids) >= num_blocks:
            raise InvalidArgumentError(f"source block ids must be in [0, {num_blocks})")
        if self._started_s is None:
            self._started_s = self._clock()
        self._state = TransferPoll.TRANSFERRING
        return offer

    def _make_offers(
        self, layers: Sequence[int], src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int] | None,
    ) -> list[LayerOffer]:
        """``_make_offer`` for several layers of the same blocks (the blocks checked once)."""
        if not layers:
            return []
        first = self._make_offer(layers[0], src_block_ids, dst_block_ids)
        offers = [first]
        num_layers = self.kv_cache.layout.num_layers
        for layer in layers[1:]:
            if not 0 <= layer < num_layers:
                raise InvalidArgumentError(f"layer {layer} out of range", field="layer")
            offers.append(LayerOffer(layer, first.src_block_ids, first.dst_block_ids))
        return offers

    def _offered(self, offer: LayerOffer) -> None:
        self._num_bytes += len(offer.src_block_ids) * self.kv_cache.layout.block_nbytes
        self._offered_layers.add(offer.layer)

    def _fail(self, reason: str) -> None:
        if not self._state.is_terminal:
            self._state = TransferPoll.FAILED
            self._failure_reason = reason

    def _raise_failed(self) -> NoReturn:
        raise TransferFailedError(
            f"transfer of {self._token} failed: {self._failure_reason}",
            reason=self._failure_reason,
        )

    async def _await_reply(self, reply: asyncio.Future[str | None], timeout_s: float) -> None:
        """Wait for the receiver's answer to a frame (None: accepted, else why not); a refusal,
        a broken link or no answer within ``timeout_s`` fails the transfer and raises."""
        try:
            error = await asyncio.wait_for(asyncio.shield(reply), timeout_s)
        except TimeoutError:
            self._fail(f"no reply from the receiver within {timeout_s} s")
            self._raise_failed()
        if error is not None:
            self._fail(error)
            self._raise_failed()

    def _succeeded(self, first_token_id: int, prefill_compute_s: float) -> TransferResult:
        self._state = TransferPoll.SUCCESS
        now = self._clock()
        assert self._dest is not None
        return TransferResult(
            num_bytes=self._num_bytes,
            num_layers=len(self._offered_layers),
            num_blocks=len(self._dest.block_ids),
            first_token_id=first_token_id,
            prefill_compute_s=prefill_compute_s,
            started_s=now if self._started_s is None else self._started_s,
            finished_s=now,
        )

