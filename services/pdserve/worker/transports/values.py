"""Values of the worker's KV data path that every transport and the agents share: where a ticket's
KV goes (``KvDestinationSpec``), what a transfer achieved (``TransferResult``), where it stands
(``TransferPoll``), and why a frame was refused (``RejectReason``, ``Rejection``).

The role interfaces are in ``transports.base``; the receiver-side rules in
``transports.receiver_tickets``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.api.v1 import common_pb2
from pdserve.common.errors import InvalidArgumentError, PdserveError, UnavailableError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvLayout

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
    CHECKSUM_MISMATCH = "checksum_mismatch"  # what landed differs from the sender's CRC-32
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
    ``frame_versions``: the versions of the transport's wire format the receiver reads (empty:
    a receiver older than the field, which reads version 1 only); the sender picks one.
    """

    kv_address: str
    block_ids: tuple[int, ...]
    transport: str
    layout: KvLayout
    metadata: bytes = b""
    decode_worker_id: str = ""
    frame_versions: tuple[int, ...] = ()

    @staticmethod
    def from_proto(message: common_pb2.KvDestination) -> KvDestinationSpec:
        """From a ``pdserve.api.v1.KvDestination``."""
        layout = message.kv_layout
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
            kv_address=message.kv_address,
            block_ids=tuple(int(b) for b in message.block_ids),
            transport=message.transport,
            layout=kv_layout,
            metadata=bytes(message.transport_metadata),
            decode_worker_id=message.decode_worker_id,
            frame_versions=tuple(int(v) for v in message.kv_frame_versions),
        )

    def to_proto(self) -> common_pb2.KvDestination:
        """As a ``pdserve.api.v1.KvDestination``."""
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
            kv_frame_versions=list(self.frame_versions),
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
    ``num_blocks`` = blocks per layer. ``frame_version``: the wire format version the ticket
    used (0: a transport without versioned frames). ``kv_crc32``: the ticket's KV checksum
    (``kv_checksum``) where the handoff computed one (frame version 2: the sender's, checked
    by the receiver), so an audit need not compute it again.
    """

    num_bytes: int
    num_layers: int
    num_blocks: int
    first_token_id: int
    prefill_compute_s: float
    started_s: float
    finished_s: float
    frame_version: int = 0
    kv_crc32: int | None = None

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

