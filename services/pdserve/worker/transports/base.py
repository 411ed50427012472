"""The worker's KV data path: role interfaces every transport implements, and the receiver-side
bookkeeping they all share.

Two roles, after the connector roles of SGLang's disaggregation (``base/conn.py``):

- ``KvReceiver`` on the decode worker, one per worker, serving every ticket. The agent
  ``expect``s a ticket once its allocator has picked the blocks and the owner table says the
  ticket's fencing token owns them; then it ``wait``s for the KV or ``cancel``s the ticket (lease
  lost, request cancelled) — after which nothing for that token can land.
- ``KvSender`` on the prefill worker, one per ticket: ``open`` towards the destination,
  ``offer_layer`` as each layer's KV is ready, ``finish`` with the first token.

The receiver decides what lands in its memory, whatever the transport:

- push (``tcp``, ``inproc``): ``offer_layer`` sends the bytes; the receiver validates every frame
  (``ReceiverTickets.admit_layer``) before writing a byte, and re-checks between partial reads.
- pull (a future ``nixl`` module, one-sided RDMA READ): ``offer_layer`` only *announces* the
  layer; the receiver runs the same ``admit_layer`` and, only if admitted, READs the layer into
  its own blocks and reports ``layer_landed``. ``KvReceiver.metadata`` (for example the NIXL
  agent's) travels to the sender in ``KvDestinationSpec.metadata``.

The same validation rules (``ReceiverTickets``) back every backend, so one contract test suite
covers them all. Everything here lives on one event loop; nothing is thread-safe.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.common.errors import (
    AlreadyExistsError,
    DeadlineError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    UnavailableError,
)
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_owner import BlockOwnerTable

logger = logging.getLogger(__name__)

MonotonicClock = Callable[[], float]
"""Seconds from an arbitrary origin (``time.perf_counter`` by default); only differences matter."""


class TransferPoll(enum.StrEnum):
    """Where one ticket's transfer stands, as either side sees it."""

    WAITING = "waiting"  # expected / opened, no KV moved yet
    TRANSFERRING = "transferring"  # some KV moved
    SUCCESS = "success"  # every layer landed and the sender said DONE
    FAILED = "failed"  # refused, aborted, cancelled, or the connection broke

    @property
    def is_terminal(self) -> bool:
        return self in (TransferPoll.SUCCESS, TransferPoll.FAILED)


class RejectReason(enum.StrEnum):
    """Why a receiver refused a frame (or the announcement of a layer)."""

    UNKNOWN_TICKET = "unknown_ticket"  # no such token expected
    STALE_ATTEMPT = "stale_attempt"  # the ticket is expected under another attempt
    CANCELLED = "cancelled"  # the ticket was cancelled or has failed
    ALREADY_DONE = "already_done"  # the ticket succeeded already
    FOREIGN_BLOCKS = "foreign_blocks"  # the token does not own every named block
    UNEXPECTED_BLOCKS = "unexpected_blocks"  # owned, but not this ticket's destination
    LAYER_OUT_OF_RANGE = "layer_out_of_range"
    DUPLICATE_LAYER = "duplicate_layer"  # that layer of those blocks arrived already
    LAYOUT_MISMATCH = "layout_mismatch"  # HELLO's shape differs from the receiver's
    INCOMPLETE = "incomplete"  # DONE before every layer landed
    OWNERSHIP_LOST = "ownership_lost"  # blocks released while the frame was arriving
    MALFORMED_FRAME = "malformed_frame"
    PROTOCOL = "protocol"  # a well-formed frame in the wrong place


class TransferFailedError(UnavailableError):
    """A transfer did not complete; ``reason`` says why. The request may be retried elsewhere
    under a new ticket."""

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class FrameRefusedError(PdserveError):
    """Internal to transports: a frame was refused; ``rejection`` says what and why."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(f"{rejection.reason}: {rejection.detail}")
        self.rejection = rejection


@dataclass(frozen=True, slots=True)
class KvDestinationSpec:
    """Where one ticket's KV goes (the ``KvDestination`` proto as a value).

    ``block_ids[i]`` is the decode worker's physical block for logical block i of the sequence
    (the same id in every layer). ``layout`` is the decode worker's; the sender refuses to open
    towards an incompatible one. ``metadata`` is opaque to everyone but the transport.
    """

    kv_address: str
    block_ids: tuple[int, ...]
    transport: str
    layout: KvLayout
    metadata: bytes = b""
    decode_worker_id: str = ""

    @staticmethod
    def from_proto(message: object) -> KvDestinationSpec:
        """From a ``pdserve.api.v1.KvDestination``."""
        layout = message.kv_layout  # type: ignore[attr-defined]
        try:
            kv_layout = KvLayout(
                num_layers=layout.num_layers,
                num_blocks=layout.num_blocks,
                block_size_tokens=layout.block_size_tokens,
                block_nbytes=layout.block_nbytes,
            )
        except ValueError as exc:  # a peer's malformed message, not our bug
            raise InvalidArgumentError(f"destination.kv_layout: {exc}",
                                       field="destination.kv_layout") from None
        return KvDestinationSpec(
            kv_address=message.kv_address,  # type: ignore[attr-defined]
            block_ids=tuple(int(b) for b in message.block_ids),  # type: ignore[attr-defined]
            transport=message.transport,  # type: ignore[attr-defined]
            layout=kv_layout,
            metadata=bytes(message.transport_metadata),  # type: ignore[attr-defined]
            decode_worker_id=message.decode_worker_id,  # type: ignore[attr-defined]
        )

    def to_proto(self) -> object:
        """As a ``pdserve.api.v1.KvDestination``."""
        from pdserve.api.v1 import common_pb2

        return common_pb2.KvDestination(
            kv_address=self.kv_address,
            block_ids=list(self.block_ids),
            transport=self.transport,
            kv_layout=common_pb2.KvLayout(
                num_layers=self.layout.num_layers,
                num_blocks=self.layout.num_blocks,
                block_size_tokens=self.layout.block_size_tokens,
                block_nbytes=self.layout.block_nbytes,
            ),
            transport_metadata=self.metadata,
            decode_worker_id=self.decode_worker_id,
        )


@dataclass(frozen=True, slots=True)
class LayerOffer:
    """One layer of some blocks: source block ``src_block_ids[i]`` of the prefill worker goes to
    destination block ``dst_block_ids[i]`` of the decode worker, in layer ``layer``."""

    layer: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids) or not self.src_block_ids:
            raise InvalidArgumentError(
                f"a layer offer maps N >= 1 source blocks to N destination blocks, got "
                f"{len(self.src_block_ids)} -> {len(self.dst_block_ids)}"
            )


@dataclass(frozen=True, slots=True)
class TransferResult:
    """One completed ticket transfer, as the side that reports it measured it.

    Receiver: ``started_s`` = first layer frame admitted, ``finished_s`` = last layer landed.
    Sender: ``started_s`` = first ``offer_layer``, ``finished_s`` = the receiver's ACK of DONE.
    Both on that side's monotonic clock. ``num_bytes`` = KV bytes moved (all layers);
    ``num_blocks`` = blocks per layer.
    """

    num_bytes: int
    num_layers: int
    num_blocks: int
    first_token_id: int
    prefill_compute_s: float
    started_s: float
    finished_s: float

    @property
    def transfer_s(self) -> float:
        return self.finished_s - self.started_s

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.num_bytes / self.transfer_s if self.transfer_s > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refused frame. ``token`` is None when the frame was too malformed to name one."""

    token: FencingToken | None
    frame: str
    layer: int
    reason: RejectReason
    detail: str
    at_s: float


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
        self.tickets = ReceiverTickets(kv_cache.layout, owner_table, clock)

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

    def _raise_failed(self) -> None:
        raise TransferFailedError(
            f"transfer of {self._token} failed: {self._failure_reason}",
            reason=self._failure_reason,
        )

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


# ---- shared receiver bookkeeping ------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Ticket:
    token: FencingToken
    dst_block_ids: np.ndarray  # int64[num_blocks], sequence order
    num_layers: int
    sorted_block_ids: np.ndarray  # for vectorised position lookup
    sorted_positions: np.ndarray
    received: np.ndarray  # bool[num_layers, num_blocks]
    num_received: list[int]  # per layer: blocks landed
    num_admitted: list[int]  # per layer: blocks admitted (landed or arriving)
    num_landed: int = 0  # sum of num_received
    checked_ids: np.ndarray | None = None  # the last block-id array _check_blocks passed ...
    checked_positions: np.ndarray | None = None  # ... their positions ...
    checked_epoch: int = -1  # ... and the owner table's release epoch at that check
    state: TransferPoll = TransferPoll.WAITING
    reason: str = ""
    num_bytes: int = 0
    first_byte_s: float | None = None
    last_layer_s: float | None = None
    done: tuple[int, float] | None = None  # (first_token_id, prefill_compute_s) from DONE
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_complete(self) -> bool:
        return self.num_landed == self.num_layers * self.dst_block_ids.size


class LayerAdmission:
    """Permission to write one layer (or ``num_layers`` consecutive layers from ``layer``) of
    some of a ticket's blocks, checked when admitted.

    ``still_writable()`` must be true right before every write into the blocks: it turns false
    as soon as the ticket is cancelled or failed, or if any of the blocks changed owner (checked
    again only when the owner table saw a release since the last check).
    """

    __slots__ = ("_epoch", "_is_revoked", "_tickets", "block_ids", "layer", "num_layers",
                 "positions", "ticket")

    def __init__(self, tickets: ReceiverTickets, ticket: _Ticket, layer: int,
                 block_ids: np.ndarray, positions: np.ndarray, num_layers: int = 1) -> None:
        self._tickets = tickets
        self.ticket = ticket
        self.layer = layer
        self.num_layers = num_layers
        self.block_ids = block_ids
        self.positions = positions
        self._epoch = tickets.owner_table.num_releases
        self._is_revoked = False

    @property
    def token(self) -> FencingToken:
        return self.ticket.token

    def still_writable(self) -> bool:
        if self.ticket.state.is_terminal:
            if not self._is_revoked:  # record once that the rest of the frame was dropped
                self._is_revoked = True
                self._tickets.refuse(self.ticket.token, "LAYER", self.layer,
                                     RejectReason.CANCELLED,
                                     f"ticket {self.ticket.state} while the layer was arriving")
            return False
        if not self.is_still_owned():
            self._is_revoked = True
            self._tickets.refuse(
                self.ticket.token, "LAYER", self.layer, RejectReason.OWNERSHIP_LOST,
                "blocks released while the layer was arriving",
            )
            return False
        return True

    def is_still_owned(self) -> bool:
        """The token still owns every block of the frame (re-checked only after a release)."""
        owner_table = self._tickets.owner_table
        if owner_table.num_releases != self._epoch:
            if not owner_table.owns_all(self.ticket.token, self.block_ids):
                return False
            self._epoch = owner_table.num_releases
        return True


class ReceiverTickets:
    """Tickets a receiver expects and the rules every frame must pass before a byte lands.

    Keeps at most ``max_finished`` finished tickets' final state (for ``poll`` and to name the
    reason a late frame is refused) and the last ``max_rejections`` rejections.
    """

    def __init__(
        self,
        layout: KvLayout,
        owner_table: BlockOwnerTable,
        clock: MonotonicClock = time.perf_counter,
        *,
        max_finished: int = 4096,
        max_rejections: int = 1024,
    ) -> None:
        self.layout = layout
        self.owner_table = owner_table
        self._clock = clock
        self._active: dict[FencingToken, _Ticket] = {}
        self._attempt_by_ticket_id: dict[str, int] = {}
        self._finished: collections.OrderedDict[FencingToken, tuple[TransferPoll, str]] = (
            collections.OrderedDict()
        )
        self._max_finished = max_finished
        self.rejections: collections.deque[Rejection] = collections.deque(maxlen=max_rejections)
        self.num_rejections = 0
        self.num_late_writes_accepted = 0
        """Frames that landed after their ticket ended or its blocks changed owner (must be 0)."""
        self.on_failed: Callable[[FencingToken, str], None] | None = None
        """Called once when an active ticket fails (a push backend tells its sender)."""

    # -- the agent's side --

    def expect(self, token: FencingToken, dst_block_ids: Sequence[int], num_layers: int) -> None:
        if token in self._active or token in self._finished:
            raise AlreadyExistsError(f"{token} was expected already")
        if not 1 <= num_layers <= self.layout.num_layers:
            raise InvalidArgumentError(
                f"num_layers {num_layers} not in [1, {self.layout.num_layers}]", field="num_layers"
            )
        ids = np.asarray(list(dst_block_ids), dtype=np.int64)
        if ids.size == 0 or np.unique(ids).size != ids.size:
            raise InvalidArgumentError("dst_block_ids must be non-empty and distinct")
        self.owner_table.check(token, ids)
        order = np.argsort(ids, kind="stable")
        self._active[token] = _Ticket(
            token=token,
            dst_block_ids=ids,
            num_layers=num_layers,
            sorted_block_ids=ids[order],
            sorted_positions=order,
            received=np.zeros((num_layers, ids.size), dtype=bool),
            num_received=[0] * num_layers,
            num_admitted=[0] * num_layers,
        )
        self._attempt_by_ticket_id[token.ticket_id] = token.attempt

    def poll(self, token: FencingToken) -> TransferPoll:
        ticket = self._active.get(token)
        if ticket is not None:
            return ticket.state
        if token in self._finished:
            return self._finished[token][0]
        raise NotFoundError(f"{token} is not known to this receiver")

    async def wait(self, token: FencingToken, timeout_s: float) -> TransferResult:
        ticket = self._active.get(token)
        if ticket is None:
            if token in self._finished:
                state, reason = self._finished[token]
                if state is TransferPoll.FAILED:
                    raise TransferFailedError(
                        f"transfer of {token} failed: {reason}", reason=reason
                    )
                raise IllegalTransitionError(f"result of {token} was collected already")
            raise NotFoundError(f"{token} is not known to this receiver")
        try:
            await asyncio.wait_for(ticket.finished.wait(), timeout_s)
        except TimeoutError:
            raise DeadlineError(
                f"{token}: {ticket.num_landed} of "
                f"{ticket.num_layers * ticket.dst_block_ids.size} layer-blocks after {timeout_s} s"
            ) from None
        self._retire(ticket)
        if ticket.state is TransferPoll.FAILED:
            raise TransferFailedError(
                f"transfer of {token} failed: {ticket.reason}", reason=ticket.reason
            )
        return self._result(ticket)

    def cancel(self, token: FencingToken, reason: str) -> None:
        ticket = self._active.get(token)
        if ticket is None:
            return
        self._fail(ticket, f"{RejectReason.CANCELLED}: {reason}")
        self._retire(ticket)

    def fail(self, token: FencingToken, reason: str) -> None:
        """Fail an active ticket (sender abort, broken connection, receiver closing)."""
        ticket = self._active.get(token)
        if ticket is not None:
            self._fail(ticket, reason)

    def active_tokens(self) -> list[FencingToken]:
        return list(self._active)

    def is_live(self, token: FencingToken) -> bool:
        """The ticket is expected and has not ended."""
        ticket = self._active.get(token)
        return ticket is not None and not ticket.state.is_terminal

    # -- the data path's side: every rule a frame must pass --

    def admit_hello(self, token: FencingToken, dst_block_ids: np.ndarray, num_layers: int,
                    block_size_tokens: int, block_nbytes: int) -> None:
        """Early check of a sender's ticket; raises ``FrameRefusedError``."""
        ticket = self._live_ticket(token, "HELLO", 0)
        shape = (num_layers, block_size_tokens, block_nbytes)
        expected = (ticket.num_layers, self.layout.block_size_tokens, self.layout.block_nbytes)
        if shape != expected:
            raise self._refusal(token, "HELLO", 0, RejectReason.LAYOUT_MISMATCH,
                                f"(layers, block tokens, block bytes) {shape} != {expected}")
        self._check_blocks(ticket, "HELLO", 0, dst_block_ids)

    def admit_layer(self, token: FencingToken, layer: int, dst_block_ids: np.ndarray
                    ) -> LayerAdmission:
        """Check one layer of ``dst_block_ids`` (int64, distinct) before any byte is written.

        Raises ``FrameRefusedError`` (and fails the ticket if the token is the expected one but
        the frame is wrong). On success the blocks count as received for that layer: a second
        frame for them is a duplicate.
        """
        return self.admit_layers(token, layer, 1, dst_block_ids)

    def admit_layers(self, token: FencingToken, first_layer: int, num_layers: int,
                     dst_block_ids: np.ndarray, *, frame: str = "LAYER") -> LayerAdmission:
        """``admit_layer`` for layers ``first_layer .. first_layer + num_layers - 1`` of the same
        blocks at once: every rule holds for every one of those layers, or the whole frame is
        refused (nothing of it is written)."""
        ticket = self._live_ticket(token, frame, first_layer)
        last_layer = first_layer + num_layers - 1
        if num_layers < 1 or not 0 <= first_layer <= last_layer < ticket.num_layers:
            raise self._refusal(token, frame, first_layer, RejectReason.LAYER_OUT_OF_RANGE,
                                f"layers {first_layer}..{last_layer}: ticket has "
                                f"{ticket.num_layers} layers")
        positions = self._check_blocks(ticket, frame, first_layer, dst_block_ids)
        num_admitted = ticket.num_admitted
        received = ticket.received[first_layer : last_layer + 1]
        if positions.size == ticket.dst_block_ids.size:  # every block: no per-block look
            is_duplicate = any(num_admitted[first_layer : last_layer + 1])
        else:
            is_duplicate = bool(received[:, positions].any())
        if is_duplicate:
            raise self._refusal(token, frame, first_layer, RejectReason.DUPLICATE_LAYER,
                                "some of these blocks arrived already for this layer")
        if positions.size == ticket.dst_block_ids.size:
            received[:] = True
        else:
            received[:, positions] = True
        for layer in range(first_layer, last_layer + 1):
            num_admitted[layer] += positions.size
        if ticket.state is TransferPoll.WAITING:
            ticket.state = TransferPoll.TRANSFERRING
            ticket.first_byte_s = self._clock()
        return LayerAdmission(self, ticket, first_layer, dst_block_ids, positions, num_layers)

    def layer_landed(self, admission: LayerAdmission, num_bytes: int) -> None:
        """Every byte of an admitted frame is in place."""
        ticket = admission.ticket
        if ticket.state.is_terminal or not admission.is_still_owned():
            # A fencing violation (the data path wrote after the ticket ended or its blocks
            # changed owner): counted for audits, never expected.
            self.num_late_writes_accepted += 1
            logger.error("KV frame of %s layer %d landed after its ticket ended or its blocks "
                         "changed owner", ticket.token, admission.layer)
            return
        num_blocks = admission.positions.size
        num_received = ticket.num_received
        for layer in range(admission.layer, admission.layer + admission.num_layers):
            num_received[layer] += num_blocks
        ticket.num_landed += admission.num_layers * num_blocks
        ticket.num_bytes += num_bytes
        if ticket.is_complete:
            ticket.last_layer_s = self._clock()
            self._maybe_succeed(ticket)

    def admit_done(self, token: FencingToken, first_token_id: int, prefill_compute_s: float,
                   num_layers: int) -> None:
        """The sender's DONE (push transports: every layer was sent before it). Raises
        ``FrameRefusedError`` unless the ticket is now SUCCESS."""
        ticket = self._live_ticket(token, "DONE", 0)
        if num_layers != ticket.num_layers or not ticket.is_complete:
            missing = [layer for layer, n in enumerate(ticket.num_received)
                       if n != ticket.dst_block_ids.size]
            raise self._refusal(token, "DONE", 0, RejectReason.INCOMPLETE,
                                f"sender offered {num_layers} layers; "
                                f"layers missing blocks: {missing[:8]}")
        ticket.done = (first_token_id, prefill_compute_s)
        self._maybe_succeed(ticket)

    def refuse(self, token: FencingToken | None, frame: str, layer: int, reason: RejectReason,
               detail: str) -> Rejection:
        """Record a rejection; if it concerns an active ticket's own token, the ticket fails."""
        rejection = Rejection(token, frame, layer, reason, detail, self._clock())
        self.rejections.append(rejection)
        self.num_rejections += 1
        ticket = self._active.get(token) if token is not None else None
        if ticket is not None and not ticket.state.is_terminal:
            self._fail(ticket, f"{reason}: {detail}")
        return rejection

    # -- internals --

    def _refusal(self, token: FencingToken | None, frame: str, layer: int, reason: RejectReason,
                 detail: str) -> FrameRefusedError:
        return FrameRefusedError(self.refuse(token, frame, layer, reason, detail))

    def _live_ticket(self, token: FencingToken, frame: str, layer: int) -> _Ticket:
        ticket = self._active.get(token)
        if ticket is not None and not ticket.state.is_terminal:
            return ticket
        if ticket is not None or token in self._finished:
            state = ticket.state if ticket is not None else self._finished[token][0]
            reason = (RejectReason.ALREADY_DONE if state is TransferPoll.SUCCESS
                      else RejectReason.CANCELLED)
            rejection = Rejection(token, frame, layer, reason, f"ticket is {state}", self._clock())
        else:
            attempt = self._attempt_by_ticket_id.get(token.ticket_id)
            if attempt is not None and attempt != token.attempt:
                rejection = Rejection(token, frame, layer, RejectReason.STALE_ATTEMPT,
                                      f"this receiver knows attempt {attempt}", self._clock())
            else:
                rejection = Rejection(token, frame, layer, RejectReason.UNKNOWN_TICKET,
                                      "no such ticket expected", self._clock())
        # A frame that is not the live ticket's own must not fail anything: record only.
        self.rejections.append(rejection)
        self.num_rejections += 1
        raise FrameRefusedError(rejection)

    def _check_blocks(self, ticket: _Ticket, frame: str, layer: int,
                      dst_block_ids: np.ndarray) -> np.ndarray:
        """Ownership first (the security property), then membership; returns positions.

        The same (read-only) id array as the last check, with no block released anywhere since,
        passes without a second look: blocks change owner only through a release
        (``BlockOwnerTable.num_releases``), and a ticket's destination never changes. A data
        path that decodes each distinct id list once (``tcp``) pays the full check once per
        ticket instead of once per frame.
        """
        epoch = self.owner_table.num_releases
        if (dst_block_ids is ticket.checked_ids and epoch == ticket.checked_epoch
                and ticket.checked_positions is not None):
            return ticket.checked_positions
        positions = self._check_blocks_fully(ticket, frame, layer, dst_block_ids)
        if not dst_block_ids.flags.writeable and dst_block_ids.base is None:  # immutable
            ticket.checked_ids, ticket.checked_positions = dst_block_ids, positions
            ticket.checked_epoch = epoch
        return positions

    def _check_blocks_fully(self, ticket: _Ticket, frame: str, layer: int,
                            dst_block_ids: np.ndarray) -> np.ndarray:
        if not self.owner_table.owns_all(ticket.token, dst_block_ids):
            raise self._refusal(ticket.token, frame, layer, RejectReason.FOREIGN_BLOCKS,
                                "the token does not own every named block")
        idx = np.searchsorted(ticket.sorted_block_ids, dst_block_ids)
        idx_clipped = np.minimum(idx, ticket.sorted_block_ids.size - 1)
        if (ticket.sorted_block_ids[idx_clipped] != dst_block_ids).any():
            raise self._refusal(ticket.token, frame, layer, RejectReason.UNEXPECTED_BLOCKS,
                                "blocks are not this ticket's destination")
        return ticket.sorted_positions[idx_clipped]

    def _maybe_succeed(self, ticket: _Ticket) -> None:
        if ticket.done is not None and ticket.is_complete and not ticket.state.is_terminal:
            ticket.state = TransferPoll.SUCCESS
            ticket.finished.set()

    def _fail(self, ticket: _Ticket, reason: str) -> None:
        if ticket.state.is_terminal:
            return
        ticket.state = TransferPoll.FAILED
        ticket.reason = reason
        ticket.finished.set()
        if self.on_failed is not None:
            self.on_failed(ticket.token, reason)

    def _retire(self, ticket: _Ticket) -> None:
        if self._active.pop(ticket.token, None) is None:
            return
        if self._attempt_by_ticket_id.get(ticket.token.ticket_id) == ticket.token.attempt:
            del self._attempt_by_ticket_id[ticket.token.ticket_id]
        self._finished[ticket.token] = (ticket.state, ticket.reason)
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)

    def _result(self, ticket: _Ticket) -> TransferResult:
        assert ticket.done is not None
        first_token_id, prefill_compute_s = ticket.done
        assert ticket.first_byte_s is not None and ticket.last_layer_s is not None
        return TransferResult(
            num_bytes=ticket.num_bytes,
            num_layers=ticket.num_layers,
            num_blocks=int(ticket.dst_block_ids.size),
            first_token_id=first_token_id,
            prefill_compute_s=prefill_compute_s,
            started_s=ticket.first_byte_s,
            finished_s=ticket.last_layer_s,
        )


def coalesce_block_runs(block_ids: np.ndarray) -> list[tuple[int, int]]:
    """``[(first_block_id, num_blocks), ...]`` of maximal runs of consecutive ids, in order.

    Consecutive blocks of one layer are contiguous in memory, so a run is one buffer: one
    ``sendmsg``/``recvmsg_into`` entry instead of one per block.
    """
    # A plain loop: a prompt has tens of blocks, where numpy's per-call overhead dominates.
    runs: list[list[int]] = []
    for block_id in block_ids.tolist():
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return [(first, count) for first, count in runs]


def layer_block_views(kv_cache: KvCache, layer: int, block_ids: np.ndarray) -> list[memoryview]:
    """Flat byte views (no copy) of ``block_ids`` of one layer, runs of consecutive ids merged;
    their concatenation is the blocks' bytes in the order of ``block_ids``."""
    buffer = kv_cache.layer_buffers[layer]
    return [
        memoryview(buffer[first : first + count].reshape(-1))
        for first, count in coalesce_block_runs(block_ids)
    ]



def layers_block_views(kv_cache: KvCache, layers: Sequence[int], block_ids: np.ndarray,
                       runs: list[tuple[int, int]] | None = None) -> list[memoryview]:
    """``layer_block_views`` of several layers, layer after layer: the byte order of a LAYERS
    frame. ``runs`` = ``coalesce_block_runs(block_ids)`` if the caller has it already."""
    runs = coalesce_block_runs(block_ids) if runs is None else runs
    views: list[memoryview] = []
    block_nbytes = kv_cache.layout.block_nbytes
    for layer in layers:
        buffer = kv_cache.layer_buffers[layer]
        if buffer.flags.c_contiguous:
            flat = memoryview(buffer).cast("B")
            views.extend(flat[first * block_nbytes : (first + count) * block_nbytes]
                         for first, count in runs)
        else:  # a run of rows of a non-contiguous buffer would be copied by reshape: refuse
            raise InvalidArgumentError(f"KV layer buffer {layer} is not contiguous")
    return views
