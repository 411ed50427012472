"""Checksums of the prompt KV that crosses a handoff, as each side saw it, for audits.

The prefill side checksums the blocks it sent, the decode side the blocks that landed (before any
decode step writes into them); ``GetStatus`` reports both, so an audit (the chaos harness, an
operator) can compare them ticket by ticket without reading KV memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache

MAX_CHECKSUMS = 4096
"""Recent handoffs whose checksums a worker keeps for audits."""


@dataclass(frozen=True, slots=True)
class KvChecksum:
    """One handoff's prompt KV as one side saw it (sent by prefill, accepted by decode)."""

    token: FencingToken
    crc32: int
    num_blocks: int
    num_layers: int
    block_crc32s: tuple[int, ...] = ()
    """One CRC-32 per block over its layers in order, when the side computed them (the vLLM
    connector does): an audit can then say which block differs."""
    frame_version: int = 0
    """KV frame format version of the handoff (2: checked at DONE); 0 = not known."""


def kv_checksum(kv_cache: KvCache, block_ids: Sequence[int]) -> int:
    """CRC-32 of every layer of ``block_ids`` (layer-major, blocks in sequence order): what both
    sides of a handoff compute over the prompt's KV, so an audit can compare them."""
    crc = 0
    ids = np.asarray(block_ids, dtype=np.int64)
    for layer in range(kv_cache.layout.num_layers):
        crc = zlib.crc32(np.ascontiguousarray(kv_cache.layer_blocks(layer, ids)).data, crc)
    return crc


def checksum_of(kv_cache: KvCache, token: FencingToken, block_ids: Sequence[int], *,
                frame_version: int = 0, crc32: int | None = None) -> KvChecksum:
    """The ``KvChecksum`` of ``token``'s prompt blocks ``block_ids`` in ``kv_cache``; ``crc32``
    when the handoff computed it already (frame version 2 checks it at DONE)."""
    if crc32 is None:
        crc32 = kv_checksum(kv_cache, block_ids)
    return KvChecksum(token, crc32, len(block_ids), kv_cache.layout.num_layers,
                      frame_version=frame_version)
