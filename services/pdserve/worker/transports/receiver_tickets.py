"""The receiver-side bookkeeping every transport shares: which tickets a receiver expects, and the
rules every frame (or layer announcement) must pass before a byte of it lands.

``ReceiverTickets`` checks, in order, that the ticket is expected and live, that the frame's
fencing token owns every named block now (``BlockOwnerTable``), that the blocks are the ticket's
destination, and that the layer has not arrived already; an admitted frame gets a
``LayerAdmission`` that the data path re-checks (``still_writable``) before every later write of
it. Push backends (``tcp``, ``inproc``) run it on each frame, the pull backend (``nixl``) on each
announced layer before it posts the READ. Everything here lives on one event loop; nothing is
thread-safe.
"""

from __future__ import annotations

import asyncio
import collections
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
)
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvLayout
from pdserve.worker.kv_checksums import CrcKind, crc_kind_for
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.values import (
    FrameRefusedError,
    MonotonicClock,
    Rejection,
    RejectReason,
    TransferFailedError,
    TransferPoll,
    TransferResult,
)

logger = logging.getLogger(__name__)


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
    frame_version: int = 0  # of the DONE frame (0: a transport without versioned frames)
    kv_crc32: int | None = None  # the sender's CRC-32 of the KV, checked against what landed
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
        kv_crc32_of: Callable[[np.ndarray, CrcKind], int] | None = None,
    ) -> None:
        """``kv_crc32_of(block_ids, kind)``: the checksum of every layer of those blocks as they
        are in the receiver's memory (``kv_checksum``); without it a DONE's CRC cannot be
        checked and is refused."""
        self.layout = layout
        self._kv_crc32_of = kv_crc32_of
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
                   num_layers: int, *, frame_version: int = 0,
                   kv_crc32: int | None = None, landed_kv_crc32: int | None = None) -> None:
        """The sender's DONE (push transports: every layer was sent before it). Raises
        ``FrameRefusedError`` unless the ticket is now SUCCESS. ``kv_crc32``: the sender's
        checksum of the KV it sent; the ticket fails (``checksum_mismatch``) unless what landed
        has the same (``landed_kv_crc32`` when the caller computed it as the layers landed)."""
        ticket = self._live_ticket(token, "DONE", 0)
        if num_layers != ticket.num_layers or not ticket.is_complete:
            missing = [layer for layer, n in enumerate(ticket.num_received)
                       if n != ticket.dst_block_ids.size]
            raise self._refusal(token, "DONE", 0, RejectReason.INCOMPLETE,
                                f"sender offered {num_layers} layers; "
                                f"layers missing blocks: {missing[:8]}")
        if kv_crc32 is not None:
            landed = landed_kv_crc32
            if landed is None:
                if self._kv_crc32_of is None:
                    raise self._refusal(token, "DONE", 0, RejectReason.PROTOCOL,
                                        "this receiver cannot check a KV checksum")
                landed = self._kv_crc32_of(ticket.dst_block_ids, crc_kind_for(frame_version))
            if landed != kv_crc32:
                raise self._refusal(token, "DONE", 0, RejectReason.CHECKSUM_MISMATCH,
                                    f"sender's KV {crc_kind_for(frame_version).name} "
                                    f"{kv_crc32:#010x}, landed "
                                    f"{landed:#010x}")
        ticket.frame_version, ticket.kv_crc32 = frame_version, kv_crc32
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
            frame_version=ticket.frame_version,
            kv_crc32=ticket.kv_crc32,
        )

