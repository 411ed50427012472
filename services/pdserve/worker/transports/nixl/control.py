"""The ``nixl`` control socket's messages: versioned, length-prefixed, little-endian.

Header (``HEADER_NBYTES`` = 32 bytes)::

    magic b"PDNX" | version u8 | kind u8 | flags u16 (0) | ticket uuid 16 B | attempt u32 |
    body_nbytes u32

Bodies: HELLO ``<IIQQIIH`` (num_layers, block_size_tokens, block_nbytes, src_num_blocks,
num_dst_blocks, metadata_nbytes, name_nbytes) + dst ids u64[] + layer base addresses u64[] +
agent name + metadata [+ memory ``<II`` (NIXL memory type: 1 DRAM, 2 VRAM; device id), only
when the sender's layers are not in host memory: a DRAM HELLO is byte for byte what receivers
before it read, and one on a GPU is refused by them as the wrong length]; LAYER ``<II``
(layer, n) + dst ids u64[n] + src ids u64[n]; DONE ``<qdI``
(first_token_id, prefill_compute_s, num_layers); ABORT reason (UTF-8); ACK answered kind (u8);
ERROR refused kind (u8) + reason NUL detail. Decoders raise ``ControlError`` on anything off;
the connection then ends.
"""

from __future__ import annotations

import asyncio
import enum
import struct
import uuid
from dataclasses import dataclass

import numpy as np

from pdserve.common.types import FencingToken

MAGIC = b"PDNX"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBH16sII")
HEADER_NBYTES = _HEADER.size
_HELLO = struct.Struct("<IIQQIIH")
_LAYER = struct.Struct("<II")
_DONE = struct.Struct("<qdI")
_MEMORY = struct.Struct("<II")
MEMORY_KINDS = ("DRAM", "VRAM")
"""NIXL memory types a HELLO names, by their code - 1."""
MAX_TEXT_NBYTES = 4096
_MAX_METADATA_NBYTES = 16 * 1024 * 1024
_MAX_NAME_NBYTES = 1024


class Kind(enum.IntEnum):
    """Control message kinds (one byte on the wire)."""

    HELLO = 1
    LAYER = 2
    DONE = 3
    ABORT = 4
    ACK = 5
    ERROR = 6


class ControlError(ValueError):
    """Bytes on the control socket that are not a well-formed message; the connection ends."""


def encode_message(kind: int, token: FencingToken | None, body: bytes = b"") -> bytes:
    ticket = uuid.UUID(token.ticket_id).bytes if token is not None else bytes(16)
    attempt = token.attempt if token is not None else 0
    return _HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, ticket, attempt, len(body)) + body


def decode_header(data: bytes, max_body_nbytes: int) -> tuple[Kind, FencingToken | None, int]:
    """``(kind, token, body_nbytes)``; raises ``ControlError`` on anything off."""
    magic, version, kind, flags, ticket, attempt, body_nbytes = _HEADER.unpack(data)
    if magic != MAGIC:
        raise ControlError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise ControlError(f"unsupported control format version {version}")
    if kind not in Kind.__members__.values():
        raise ControlError(f"unknown message kind {kind}")
    kind = Kind(kind)
    if flags:
        raise ControlError(f"unknown flags {flags:#x}")
    if body_nbytes > max_body_nbytes:
        raise ControlError(f"{Kind(kind).name} body of {body_nbytes} bytes > {max_body_nbytes}")
    if ticket == bytes(16) and attempt == 0:
        if kind not in (Kind.ACK, Kind.ERROR):
            raise ControlError(f"{Kind(kind).name} without a ticket")
        return kind, None, body_nbytes
    if attempt == 0:
        raise ControlError("attempt 0")
    return kind, FencingToken(str(uuid.UUID(bytes=ticket)), attempt), body_nbytes


@dataclass(frozen=True, slots=True)
class Hello:
    num_layers: int
    block_size_tokens: int
    block_nbytes: int
    src_num_blocks: int
    dst_block_ids: np.ndarray
    base_addresses: np.ndarray
    agent_name: str
    metadata: bytes
    memory_kind: str = "DRAM"
    """NIXL memory type of the sender's layers (``MEMORY_KINDS``)."""
    device_id: int = 0
    """The sender's GPU index when ``memory_kind`` is VRAM."""

    def encode(self) -> bytes:
        name = self.agent_name.encode()
        head = _HELLO.pack(self.num_layers, self.block_size_tokens, self.block_nbytes,
                           self.src_num_blocks, self.dst_block_ids.size, len(self.metadata),
                           len(name))
        memory = b""
        if self.memory_kind != "DRAM" or self.device_id:
            memory = _MEMORY.pack(MEMORY_KINDS.index(self.memory_kind) + 1, self.device_id)
        return (head + self.dst_block_ids.astype("<u8").tobytes()
                + self.base_addresses.astype("<u8").tobytes() + name + self.metadata + memory)

    @staticmethod
    def decode(body: bytes, max_blocks: int, max_layers: int) -> Hello:
        if len(body) < _HELLO.size:
            raise ControlError("HELLO too short")
        (num_layers, block_size_tokens, block_nbytes, src_num_blocks, num_dst, md_nbytes,
         name_nbytes) = _HELLO.unpack_from(body)
        if not 1 <= num_dst <= max_blocks or not 1 <= num_layers <= max_layers:
            raise ControlError(f"HELLO names {num_dst} blocks and {num_layers} layers")
        if md_nbytes > _MAX_METADATA_NBYTES or name_nbytes > _MAX_NAME_NBYTES:
            raise ControlError("HELLO metadata or name too long")
        expected = _HELLO.size + 8 * num_dst + 8 * num_layers + name_nbytes + md_nbytes
        if len(body) not in (expected, expected + _MEMORY.size):
            raise ControlError(f"HELLO is {len(body)} bytes, its counts say {expected}")
        memory_kind, device_id = "DRAM", 0
        if len(body) > expected:
            code, device_id = _MEMORY.unpack_from(body, expected)
            if not 1 <= code <= len(MEMORY_KINDS):
                raise ControlError(f"HELLO names memory type {code}")
            memory_kind = MEMORY_KINDS[code - 1]
        offset = _HELLO.size
        dst = np.frombuffer(body, "<u8", num_dst, offset).astype(np.int64)
        offset += 8 * num_dst
        bases = np.frombuffer(body, "<u8", num_layers, offset).astype(np.uint64)
        offset += 8 * num_layers
        name = body[offset : offset + name_nbytes].decode("utf-8", errors="strict")
        metadata = body[offset + name_nbytes : offset + name_nbytes + md_nbytes]
        return Hello(num_layers, block_size_tokens, block_nbytes, src_num_blocks, dst, bases,
                     name, metadata, memory_kind, device_id)


def encode_layer(layer: int, dst_ids: np.ndarray, src_ids: np.ndarray) -> bytes:
    return (_LAYER.pack(layer, dst_ids.size) + dst_ids.astype("<u8").tobytes()
            + src_ids.astype("<u8").tobytes())


def decode_layer(body: bytes, max_blocks: int) -> tuple[int, np.ndarray, np.ndarray]:
    if len(body) < _LAYER.size:
        raise ControlError("LAYER too short")
    layer, n = _LAYER.unpack_from(body)
    if not 1 <= n <= max_blocks or len(body) != _LAYER.size + 16 * n:
        raise ControlError(f"LAYER of {len(body)} bytes names {n} blocks")
    dst = np.frombuffer(body, "<u8", n, _LAYER.size)
    src = np.frombuffer(body, "<u8", n, _LAYER.size + 8 * n)
    return layer, dst.astype(np.int64), src.astype(np.int64)


def error_body(refused_kind: int, reason: str, detail: str) -> bytes:
    return bytes([refused_kind & 0xFF]) + f"{reason}\0{detail}".encode()[:MAX_TEXT_NBYTES]


async def read_message(reader: asyncio.StreamReader, max_body_nbytes: int
                        ) -> tuple[Kind, FencingToken | None, bytes] | None:
    """The next message, or None at a clean EOF between messages."""
    try:
        header = await reader.readexactly(HEADER_NBYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ConnectionResetError("peer closed in the middle of a header") from None
    kind, token, body_nbytes = decode_header(header, max_body_nbytes)
    body = await reader.readexactly(body_nbytes) if body_nbytes else b""
    return kind, token, body


def encode_done(first_token_id: int, prefill_compute_s: float, num_layers: int) -> bytes:
    return _DONE.pack(first_token_id, prefill_compute_s, num_layers)


def decode_done(body: bytes) -> tuple[int, float, int]:
    """``(first_token_id, prefill_compute_s, num_layers)``; ``ControlError`` if malformed."""
    if len(body) != _DONE.size:
        raise ControlError(f"DONE body is {len(body)} bytes")
    first_token_id, prefill_compute_s, num_layers = _DONE.unpack(body)
    return first_token_id, prefill_compute_s, num_layers


def max_message_nbytes(num_blocks: int, num_layers: int) -> int:
    """The longest body a receiver of ``num_blocks`` blocks and ``num_layers`` layers accepts
    (a HELLO naming every block, with the longest name and metadata allowed)."""
    return (_HELLO.size + 16 * num_blocks + 8 * num_layers + _MAX_NAME_NBYTES
            + _MAX_METADATA_NBYTES + _MEMORY.size)
