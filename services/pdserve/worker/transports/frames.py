"""Wire format of the two-sided KV transports: versioned, length-prefixed binary frames.

A frame is a fixed header, then ``num_block_ids`` block ids, then ``payload_nbytes`` bytes::

    offset size field
         0    4 magic            b"PDKV"
         4    1 version          1, 2 or 3 (``FRAME_VERSIONS``; see "Versions" below)
         5    1 frame_type       FrameType
         6    2 flags            bit 0: block ids are uint64 (else uint32); bit 1: NO_ACK (HELLO
                                 only); bit 2: KV_CRC32 (DONE of version >= 2 only); other bits
                                 must be 0
         8   16 ticket_id        the ticket's UUID, 16 raw bytes
        24    4 attempt          fencing attempt (>= 1; 0 only in ACK/ERROR about no ticket)
        28    4 layer            LAYER: layer index; LAYERS: first layer; ERROR: layer of the
                                 refused frame; else 0
        32    4 num_block_ids    HELLO, LAYER, LAYERS: destination block ids that follow; else 0
        36    8 payload_nbytes   LAYER: num_block_ids x block_nbytes; LAYERS: a multiple >= 1 of
                                 that; others: small and fixed
    (44 bytes, little-endian, no padding)

Frames, by direction (P = prefill/sender, D = decode/receiver):

- ``HELLO`` P->D: the ticket's destination block ids; payload = (num_layers, block_size_tokens,
  block_nbytes) so D can refuse a ticket of the wrong shape before any KV moves. D answers ACK
  or ERROR; with flag ``NO_ACK`` only ERROR (the sender does not wait: it sends its first layers
  right behind the HELLO, and D drops, unanswered, the later frames of a ticket whose HELLO it
  refused on that connection).
- ``LAYER`` P->D: one layer of some destination blocks, the blocks' bytes back to back in the
  order of the ids.
- ``LAYERS`` P->D: consecutive layers ``layer``, ``layer + 1``, ... of the same destination
  blocks, layer after layer (each as in LAYER); the number of layers is
  ``payload_nbytes / (num_block_ids x block_nbytes)``. One frame, one admission, one scatter
  read for layers that were ready at once.
- ``DONE`` P->D: payload = (first_token_id, prefill_compute_s, num_layers), and with flag
  ``KV_CRC32`` (version 2) the sender's CRC-32 of the ticket's KV after it (``kv_checksum``: every
  layer of the destination blocks in sequence order, layer-major; version 3: its CRC-32C). D
  answers ACK when every layer has landed (and its own checksum of what landed equals the
  sender's), else ERROR
  (``checksum_mismatch`` for a CRC that differs).
- ``ABORT`` P->D: payload = reason (UTF-8). No answer.
- ``ACK`` D->P: payload = the answered frame type (1 byte).
- ``ERROR`` D->P: payload = the refused frame type (1 byte) + ``reason`` + NUL + detail (UTF-8).

One connection may carry frames of several tickets (whole frames, never interleaved bytes);
every frame names its ticket, and replies are matched to tickets by that name.

LAYERS and NO_ACK came after the first release of version 1: a receiver older than them refuses
such frames as malformed (the ticket fails and the request is retried); everything older senders
send is still accepted unchanged.

Versions. A receiver accepts every version in ``FRAME_VERSIONS`` and announces them in the
destination it hands out (``KvDestination.kv_frame_versions``); a sender writes every frame of a
ticket at ``negotiate_frame_version`` of that list: the highest version both speak, and 1 when the
list is empty (a receiver older than the list speaks version 1 only). A receiver answers a frame
at that frame's version; replies about no frame (a bad header, a ticket that failed meanwhile)
go at version 1, which every sender reads. Version 2 adds one thing, the ``KV_CRC32`` flag on
DONE: the KV's integrity checked at the handoff itself, where version 1 only lets an audit
compare both sides' checksums after the fact (``GetStatus``), when the tokens have been served.
Version 3 changes one thing, the algorithm of that checksum: CRC-32C, which the CPU computes in
hardware (~4x cheaper than zlib's CRC-32 here: milliseconds per request at a real model's KV
size, on both sides). A release speaks version 3 only where it has the hardware CRC-32C
(``kv_checksums.HAS_FAST_CRC32C``); a handoff between such releases uses it, one with an older
or a slower side stays at version 2.

The decoder is strict and works on the header alone (``decode_header``): anything malformed
raises ``FrameError`` before a receiver reads a single payload byte, so a bad header can never
make it write into cache memory. Layer *semantics* (is this ticket expected, does its token own
these blocks) are the receiver's job, not the decoder's.
"""

from __future__ import annotations

import enum
import functools
import struct
import uuid
from dataclasses import dataclass

import numpy as np

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import FencingToken
from pdserve.worker.kv_checksums import CRC32C_FRAME_VERSION, HAS_FAST_CRC32C

MAGIC = b"PDKV"
FRAME_VERSIONS: tuple[int, ...] = (1, 2, CRC32C_FRAME_VERSION) if HAS_FAST_CRC32C else (1, 2)
"""Frame format versions this release reads and writes, oldest first."""
MIN_FRAME_VERSION = FRAME_VERSIONS[0]
MAX_FRAME_VERSION = FRAME_VERSIONS[-1]
FORMAT_VERSION = MIN_FRAME_VERSION
"""The version frames are encoded at unless a caller says otherwise (every receiver reads it)."""
FLAG_BLOCK_IDS_U64 = 0x1
FLAG_NO_ACK = 0x2
"""HELLO only: answer a refusal, not an acceptance."""
FLAG_KV_CRC32 = 0x4
"""DONE of version >= 2 only: the payload ends with the sender's checksum of the ticket's KV
(CRC-32; version 3: CRC-32C)."""
_KNOWN_FLAGS = FLAG_BLOCK_IDS_U64 | FLAG_NO_ACK | FLAG_KV_CRC32

_HEADER = struct.Struct("<4sBBH16sIIIQ")
HEADER_NBYTES = _HEADER.size
_HELLO = struct.Struct("<IIQ")
_DONE = struct.Struct("<qdI")
_DONE_CRC32 = struct.Struct("<qdII")

MAX_CONTROL_PAYLOAD_NBYTES = 64 * 1024
"""ABORT and ERROR payloads (a reason text) are at most this long."""
MAX_FRAME_NBYTES = 2 * 1024**3
"""Default bound on one whole frame (header + ids + payload), bytes."""
_MAX_U32 = 2**32 - 1


class FrameError(InvalidArgumentError):
    """Bytes that are not a well-formed frame. The stream they came from cannot be trusted."""


class NoCommonFrameVersionError(InvalidArgumentError):
    """Sender and receiver speak no frame version in common."""


def negotiate_frame_version(receiver_versions: tuple[int, ...] | list[int]) -> int:
    """The version a sender writes a ticket's frames at: the highest of ``receiver_versions``
    (what the destination announced) that this release speaks; 1 for an empty list (a receiver
    older than the announcement). Raises ``NoCommonFrameVersionError`` when there is none."""
    if not receiver_versions:
        return MIN_FRAME_VERSION
    common = set(receiver_versions) & set(FRAME_VERSIONS)
    if not common:
        raise NoCommonFrameVersionError(
            f"destination.kv_frame_versions: receiver speaks KV frame versions "
            f"{sorted(receiver_versions)}, this sender {list(FRAME_VERSIONS)}",
            field="destination.kv_frame_versions")
    return max(common)


class FrameType(enum.IntEnum):
    HELLO = 1
    LAYER = 2
    DONE = 3
    ABORT = 4
    ACK = 5
    ERROR = 6
    LAYERS = 7


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """What a decoder accepts. ``block_nbytes`` fixes a LAYER's payload size per block;
    block ids must be ``< num_blocks``; ``max_block_ids`` bounds ids per frame; a LAYERS frame
    ends at or before layer ``num_layers``."""

    block_nbytes: int
    num_blocks: int
    max_block_ids: int = 1 << 20
    num_layers: int = 1 << 16
    max_frame_nbytes: int = MAX_FRAME_NBYTES
    max_control_payload_nbytes: int = MAX_CONTROL_PAYLOAD_NBYTES


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A decoded header. ``token`` is None in ACK/ERROR frames that concern no ticket."""

    frame_type: FrameType
    token: FencingToken | None
    layer: int = 0
    num_block_ids: int = 0
    payload_nbytes: int = 0
    flags: int = 0
    version: int = FORMAT_VERSION

    @property
    def block_id_nbytes(self) -> int:
        return 8 if self.flags & FLAG_BLOCK_IDS_U64 else 4

    @property
    def block_ids_nbytes(self) -> int:
        """Bytes of the block-id array that follows the header."""
        return self.num_block_ids * self.block_id_nbytes

    @property
    def frame_nbytes(self) -> int:
        return HEADER_NBYTES + self.block_ids_nbytes + self.payload_nbytes

    def num_layers(self, block_nbytes: int) -> int:
        """Layers a LAYER (1) or LAYERS frame carries; 0 for other frames."""
        if self.frame_type is FrameType.LAYER:
            return 1
        if self.frame_type is FrameType.LAYERS:
            return self.payload_nbytes // (self.num_block_ids * block_nbytes)
        return 0


_NIL_UUID = bytes(16)


def _token_bytes(token: FencingToken | None) -> tuple[bytes, int]:
    if token is None:
        return _NIL_UUID, 0
    return _ticket_bytes(token)


@functools.lru_cache(maxsize=4096)
def _ticket_bytes(token: FencingToken) -> tuple[bytes, int]:
    """A ticket's wire form (cached: every frame of a ticket names it)."""
    try:
        ticket_uuid = uuid.UUID(token.ticket_id)
    except ValueError as exc:
        raise FrameError(f"ticket id {token.ticket_id!r} is not a UUID") from exc
    if not 1 <= token.attempt <= _MAX_U32:
        raise FrameError(f"attempt {token.attempt} not in [1, 2^32)")
    return ticket_uuid.bytes, token.attempt


def encode_header(header: FrameHeader) -> bytes:
    """The 44 header bytes. Callers build the header with ``layer_header`` etc. (or by hand in
    tests); nothing here checks frame-type rules — ``decode_header`` is the gatekeeper."""
    ticket_bytes, attempt = _token_bytes(header.token)
    return _HEADER.pack(
        MAGIC,
        header.version,
        int(header.frame_type),
        header.flags,
        ticket_bytes,
        attempt,
        header.layer,
        header.num_block_ids,
        header.payload_nbytes,
    )


def encode_block_ids(block_ids: np.ndarray | list[int] | tuple[int, ...]) -> tuple[bytes, int]:
    """``(bytes, flags)``: ids as little-endian uint32 when they all fit, else uint64."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and ids.min() < 0:
        raise FrameError("block ids must be >= 0")
    if ids.size == 0 or ids.max() <= _MAX_U32:
        return ids.astype("<u4").tobytes(), 0
    return ids.astype("<u8").tobytes(), FLAG_BLOCK_IDS_U64


@dataclass(frozen=True, slots=True)
class EncodedBlockIds:
    """Block ids in wire form, encoded once for the frames of a ticket that all name them."""

    data: bytes
    flags: int
    num_block_ids: int

    @staticmethod
    def of(block_ids: np.ndarray | list[int] | tuple[int, ...]) -> EncodedBlockIds:
        data, flags = encode_block_ids(block_ids)
        return EncodedBlockIds(data, flags, len(block_ids))


def layer_frame_prefix(
    token: FencingToken, layer: int, block_ids: np.ndarray | EncodedBlockIds, block_nbytes: int,
    num_layers: int = 1, version: int = FORMAT_VERSION,
) -> bytes:
    """Header and block ids of a LAYER frame (``num_layers`` 1) or of a LAYERS frame for layers
    ``layer .. layer + num_layers - 1``; the blocks' bytes follow (sent by the caller). LAYER
    and LAYERS are the same in every version."""
    if num_layers < 1:
        raise FrameError(f"a layer frame carries >= 1 layers, got {num_layers}")
    ids = block_ids if isinstance(block_ids, EncodedBlockIds) else EncodedBlockIds.of(block_ids)
    frame_type = FrameType.LAYER if num_layers == 1 else FrameType.LAYERS
    ticket_bytes, attempt = _token_bytes(token)
    return _HEADER.pack(
        MAGIC, version, int(frame_type), ids.flags, ticket_bytes, attempt, layer,
        ids.num_block_ids, num_layers * ids.num_block_ids * block_nbytes,
    ) + ids.data


def encode_frame(
    frame_type: FrameType,
    token: FencingToken | None,
    *,
    layer: int = 0,
    block_ids: np.ndarray | list[int] | tuple[int, ...] = (),
    payload: bytes = b"",
    flags: int = 0,
    version: int = FORMAT_VERSION,
) -> bytes:
    """A whole frame in one buffer (control frames; LAYER frames use ``layer_frame_prefix``).
    ``flags`` adds to the block-id width flag (e.g. ``FLAG_NO_ACK`` on a HELLO)."""
    ids_bytes, id_flags = encode_block_ids(block_ids)
    header = FrameHeader(frame_type, token, layer, len(block_ids), len(payload), flags | id_flags,
                         version)
    return encode_header(header) + ids_bytes + payload


def decode_header(data: bytes | bytearray | memoryview, limits: FrameLimits) -> FrameHeader:
    """Parse and check exactly ``HEADER_NBYTES`` bytes; raises ``FrameError`` on anything off.

    Pure: never reads more than the header, never allocates for the payload.
    """
    if len(data) != HEADER_NBYTES:
        raise FrameError(f"header must be {HEADER_NBYTES} bytes, got {len(data)}")
    magic, version, type_code, flags, ticket_bytes, attempt, layer, num_ids, payload_nbytes = (
        _HEADER.unpack(data)
    )
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version not in FRAME_VERSIONS:
        raise FrameError(f"unsupported frame format version {version} "
                         f"(this receiver reads {list(FRAME_VERSIONS)})")
    frame_type = _FRAME_TYPES.get(type_code)
    if frame_type is None:
        raise FrameError(f"unknown frame type {type_code}")
    if flags & ~_KNOWN_FLAGS:
        raise FrameError(f"unknown flags {flags:#x}")
    token = _decode_token(frame_type, ticket_bytes, attempt)
    header = FrameHeader(frame_type, token, layer, num_ids, payload_nbytes, flags, version)
    _check_shape(header, limits)
    return header


def _decode_token(frame_type: FrameType, ticket_bytes: bytes, attempt: int) -> FencingToken | None:
    is_reply = frame_type in (FrameType.ACK, FrameType.ERROR)
    if ticket_bytes == _NIL_UUID and attempt == 0 and is_reply:
        return None
    if attempt == 0:
        raise FrameError(f"{frame_type.name} frame with attempt 0")
    return _token_of(ticket_bytes, attempt)


@functools.lru_cache(maxsize=4096)
def _token_of(ticket_bytes: bytes, attempt: int) -> FencingToken:
    """The token a frame names (cached: every frame of a ticket names it; tokens are values)."""
    return FencingToken(ticket_id=str(uuid.UUID(bytes=ticket_bytes)), attempt=attempt)


def _check_shape(header: FrameHeader, limits: FrameLimits) -> None:
    frame_type = header.frame_type
    if header.flags & FLAG_NO_ACK and frame_type is not FrameType.HELLO:
        raise FrameError(f"flags: NO_ACK on a {frame_type.name} frame")
    if header.flags & FLAG_KV_CRC32 and (frame_type is not FrameType.DONE or header.version < 2):
        raise FrameError(f"flags: KV_CRC32 on a version {header.version} {frame_type.name} frame")
    has_ids = frame_type in _FRAMES_WITH_IDS
    if has_ids and not 1 <= header.num_block_ids <= limits.max_block_ids:
        raise FrameError(
            f"{frame_type.name} frame names {header.num_block_ids} blocks, "
            f"allowed 1..{limits.max_block_ids}"
        )
    if not has_ids and header.num_block_ids != 0:
        raise FrameError(f"{frame_type.name} frame carries {header.num_block_ids} block ids")
    if header.layer != 0 and frame_type not in (FrameType.LAYER, FrameType.LAYERS,
                                                 FrameType.ERROR):
        raise FrameError(f"{frame_type.name} frame with layer {header.layer}")
    if frame_type is FrameType.LAYERS:
        _check_layers(header, limits)
    expected = _expected_payload_nbytes(header, limits)
    if expected is not None and header.payload_nbytes != expected:
        raise FrameError(
            f"{frame_type.name} payload is {header.payload_nbytes} bytes, expected {expected}"
        )
    if frame_type in (FrameType.ABORT, FrameType.ERROR):
        if header.payload_nbytes > limits.max_control_payload_nbytes:
            raise FrameError(f"{frame_type.name} payload of {header.payload_nbytes} bytes too long")
        if frame_type is FrameType.ERROR and header.payload_nbytes < 1:
            raise FrameError("ERROR frame without the refused frame type")
    if header.frame_nbytes > limits.max_frame_nbytes:
        raise FrameError(f"frame of {header.frame_nbytes} bytes > {limits.max_frame_nbytes}")


_FRAMES_WITH_IDS = (FrameType.HELLO, FrameType.LAYER, FrameType.LAYERS)
_FRAME_TYPES = {int(t): t for t in FrameType}


def _check_layers(header: FrameHeader, limits: FrameLimits) -> None:
    """A LAYERS payload is a whole number >= 1 of layers, ending at or before the last layer."""
    layer_nbytes = header.num_block_ids * limits.block_nbytes
    num_layers, rest = divmod(header.payload_nbytes, layer_nbytes)
    if rest or num_layers < 1:
        raise FrameError(f"LAYERS payload is {header.payload_nbytes} bytes, not a multiple >= 1 "
                         f"of {layer_nbytes} (one layer of {header.num_block_ids} blocks)")
    if header.layer + num_layers > limits.num_layers:
        last_layer = header.layer + num_layers - 1
        raise FrameError(f"LAYERS frame covers layers {header.layer}..{last_layer}"
                         f", past layer {limits.num_layers - 1}")


def _expected_payload_nbytes(header: FrameHeader, limits: FrameLimits) -> int | None:
    match header.frame_type:
        case FrameType.LAYER:
            return header.num_block_ids * limits.block_nbytes
        case FrameType.HELLO:
            return _HELLO.size
        case FrameType.DONE:
            return _DONE_CRC32.size if header.flags & FLAG_KV_CRC32 else _DONE.size
        case FrameType.ACK:
            return 1
        case _:
            return None


def decode_block_ids(
    header: FrameHeader, data: bytes | bytearray | memoryview, limits: FrameLimits
) -> np.ndarray:
    """The ids that follow ``header`` as ``int64[num_block_ids]``; refuses ids
    ``>= limits.num_blocks`` and repeated ids (a frame may not write a block twice)."""
    if len(data) != header.block_ids_nbytes:
        raise FrameError(f"block ids are {len(data)} bytes, expected {header.block_ids_nbytes}")
    dtype = "<u8" if header.flags & FLAG_BLOCK_IDS_U64 else "<u4"
    raw = np.frombuffer(data, dtype=dtype)
    if raw.size and int(raw.max()) >= limits.num_blocks:
        raise FrameError(f"block id {int(raw.max())} >= {limits.num_blocks} blocks")
    ids = raw.astype(np.int64)
    if np.unique(ids).size != ids.size:
        raise FrameError("block ids repeat within one frame")
    return ids


@dataclass(frozen=True, slots=True)
class HelloPayload:
    """Shape of the transfer the sender will make: must match the receiver's layout."""

    num_layers: int
    block_size_tokens: int
    block_nbytes: int

    def encode(self) -> bytes:
        return _HELLO.pack(self.num_layers, self.block_size_tokens, self.block_nbytes)

    @staticmethod
    def decode(data: bytes | bytearray | memoryview) -> HelloPayload:
        if len(data) != _HELLO.size:
            raise FrameError(f"HELLO payload is {len(data)} bytes, expected {_HELLO.size}")
        return HelloPayload(*_HELLO.unpack(data))


@dataclass(frozen=True, slots=True)
class DonePayload:
    """End of a ticket's KV: the first token prefill produced and what prefill cost, and (frame
    version >= 2, flag ``KV_CRC32``) the sender's checksum of the KV it sent (``kv_checksum``:
    CRC-32, or CRC-32C at version 3)."""

    first_token_id: int
    prefill_compute_s: float
    num_layers: int
    kv_crc32: int | None = None

    @property
    def flags(self) -> int:
        """The header flags this payload needs."""
        return 0 if self.kv_crc32 is None else FLAG_KV_CRC32

    def encode(self) -> bytes:
        if self.kv_crc32 is None:
            return _DONE.pack(self.first_token_id, self.prefill_compute_s, self.num_layers)
        return _DONE_CRC32.pack(self.first_token_id, self.prefill_compute_s, self.num_layers,
                                self.kv_crc32)

    @staticmethod
    def decode(data: bytes | bytearray | memoryview, flags: int = 0) -> DonePayload:
        """``flags``: the header's (``KV_CRC32`` says the CRC follows)."""
        layout = _DONE_CRC32 if flags & FLAG_KV_CRC32 else _DONE
        if len(data) != layout.size:
            raise FrameError(f"DONE payload is {len(data)} bytes, expected {layout.size}")
        return DonePayload(*layout.unpack(data))


@dataclass(frozen=True, slots=True)
class ErrorPayload:
    """Why the receiver refused a frame. ``reason`` is a ``RejectReason`` value."""

    refused_type: int
    reason: str
    detail: str = ""

    def encode(self) -> bytes:
        text = f"{self.reason}\0{self.detail}".encode()[: MAX_CONTROL_PAYLOAD_NBYTES - 1]
        return bytes([self.refused_type & 0xFF]) + text

    @staticmethod
    def decode(data: bytes | bytearray | memoryview) -> ErrorPayload:
        if len(data) < 1:
            raise FrameError("empty ERROR payload")
        reason, _, detail = bytes(data[1:]).decode("utf-8", errors="replace").partition("\0")
        return ErrorPayload(data[0], reason, detail)
