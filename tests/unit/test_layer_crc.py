"""``LayerCrc``: the handoff checksum built layer by layer as layers go or land (in a thread) is
``kv_checksum`` of the blocks, whatever order the layers come in; and it follows the KV. Each
test runs for both algorithms (CRC-32 for frame versions 1 and 2, CRC-32C for 3), and each
algorithm is checked against its published check value and an independent computation."""

from __future__ import annotations

import zlib

import crc32c
import numpy as np
import pytest

from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_checksums import (
    CrcKind,
    LayerCrc,
    crc_kind_for,
    kv_checksum,
)

LAYOUT = KvLayout(num_layers=6, num_blocks=32, block_size_tokens=4, block_nbytes=256)
IDS = [7, 2, 19, 3]


@pytest.fixture(params=list(CrcKind), ids=str)
def kind(request: pytest.FixtureRequest) -> CrcKind:
    return request.param  # type: ignore[no-any-return]


def _cache() -> KvCache:
    cache = KvCache(LAYOUT)
    rng = np.random.default_rng(5)
    for buffer in cache.layer_buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
    return cache


async def test_layers_in_order_give_the_whole_checksum(kind: CrcKind) -> None:
    cache = _cache()
    crc = LayerCrc(cache, IDS, kind=kind)
    crc.add(0, 1, IDS)
    crc.add(1, 3, IDS)  # a frame of several layers
    crc.add(4, 2, IDS)
    assert await crc.result() == kv_checksum(cache, IDS, kind)


async def test_out_of_order_or_partial_layers_fall_back_to_the_whole_checksum(
        kind: CrcKind) -> None:
    cache = _cache()
    shuffled = LayerCrc(cache, IDS, kind=kind)
    shuffled.add(1, 1, IDS)
    shuffled.add(0, 1, IDS)
    assert await shuffled.result() == kv_checksum(cache, IDS, kind)
    partial = LayerCrc(cache, IDS, kind=kind)
    partial.add(0, 1, IDS[:2])  # some blocks of a layer only
    assert await partial.result() == kv_checksum(cache, IDS, kind)
    unfinished = LayerCrc(cache, IDS, kind=kind)
    unfinished.add(0, 2, IDS)
    assert await unfinished.result() == kv_checksum(cache, IDS, kind)
    reversed_ids = IDS[::-1]
    assert await LayerCrc(cache, IDS, kind=kind).result(reversed_ids) == kv_checksum(
        cache, reversed_ids, kind)


async def test_the_checksum_follows_the_kv(kind: CrcKind) -> None:
    cache = _cache()
    before = kv_checksum(cache, IDS, kind)
    cache.layer_buffers[3][19, 0] ^= 0x01
    crc = LayerCrc(cache, IDS, kind=kind)
    crc.add(0, LAYOUT.num_layers, IDS)
    assert await crc.result() == kv_checksum(cache, IDS, kind) != before


async def test_inline_threaded_and_mixed_steps_give_the_same_checksum(kind: CrcKind) -> None:
    cache = _cache()
    whole = kv_checksum(cache, IDS, kind)
    step_nbytes = len(IDS) * LAYOUT.block_nbytes
    # 0: every step to the thread; 2 layers' worth: one- and two-layer steps inline, the
    # three-layer step to the thread and the step after it chained behind it; huge: all inline.
    for inline_nbytes in (0, 2 * step_nbytes, 1 << 30):
        crc = LayerCrc(cache, IDS, inline_nbytes=inline_nbytes, kind=kind)
        crc.add(0, 1, IDS)
        crc.add(1, 3, IDS)
        crc.add(4, 1, IDS)
        crc.add(5, 1, IDS)
        assert await crc.result() == whole, inline_nbytes


async def test_a_closed_checksum_is_computed_whole(kind: CrcKind) -> None:
    cache = _cache()
    crc = LayerCrc(cache, IDS, inline_nbytes=0, kind=kind)
    crc.add(0, 3, IDS)
    crc.close()  # the thread step is cancelled
    crc.add(3, 3, IDS)
    assert await crc.result() == kv_checksum(cache, IDS, kind)


def test_each_algorithm_is_the_published_one() -> None:
    """The standard check values of "123456789", and a cache's checksum against the same CRC
    taken over its layers' blocks copied out one after the other (layer-major, in order)."""
    assert zlib.crc32(b"123456789") == 0xCBF43926
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    cache = _cache()
    data = b"".join(cache.layer_buffers[layer][IDS].tobytes()
                    for layer in range(LAYOUT.num_layers))
    assert kv_checksum(cache, IDS, CrcKind.CRC32) == zlib.crc32(data)
    assert kv_checksum(cache, IDS, CrcKind.CRC32C) == crc32c.crc32c(data)
    assert kv_checksum(cache, IDS) == kv_checksum(cache, IDS, CrcKind.CRC32)


def test_frame_version_3_and_later_checksum_with_crc32c() -> None:
    assert [crc_kind_for(v) for v in (0, 1, 2, 3, 4)] == [
        CrcKind.CRC32, CrcKind.CRC32, CrcKind.CRC32, CrcKind.CRC32C, CrcKind.CRC32C]
