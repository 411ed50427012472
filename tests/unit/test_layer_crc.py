"""``LayerCrc``: the handoff checksum built layer by layer as layers go or land (in a thread) is
``kv_checksum`` of the blocks, whatever order the layers come in; and it follows the KV."""

from __future__ import annotations

import numpy as np

from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_checksums import LayerCrc, kv_checksum

LAYOUT = KvLayout(num_layers=6, num_blocks=32, block_size_tokens=4, block_nbytes=256)
IDS = [7, 2, 19, 3]


def _cache() -> KvCache:
    cache = KvCache(LAYOUT)
    rng = np.random.default_rng(5)
    for buffer in cache.layer_buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
    return cache


async def test_layers_in_order_give_the_whole_checksum() -> None:
    cache = _cache()
    crc = LayerCrc(cache, IDS)
    crc.add(0, 1, IDS)
    crc.add(1, 3, IDS)  # a frame of several layers
    crc.add(4, 2, IDS)
    assert await crc.result() == kv_checksum(cache, IDS)


async def test_out_of_order_or_partial_layers_fall_back_to_the_whole_checksum() -> None:
    cache = _cache()
    shuffled = LayerCrc(cache, IDS)
    shuffled.add(1, 1, IDS)
    shuffled.add(0, 1, IDS)
    assert await shuffled.result() == kv_checksum(cache, IDS)
    partial = LayerCrc(cache, IDS)
    partial.add(0, 1, IDS[:2])  # some blocks of a layer only
    assert await partial.result() == kv_checksum(cache, IDS)
    unfinished = LayerCrc(cache, IDS)
    unfinished.add(0, 2, IDS)
    assert await unfinished.result() == kv_checksum(cache, IDS)
    assert await LayerCrc(cache, IDS).result(IDS[::-1]) == kv_checksum(cache, IDS[::-1])


async def test_the_checksum_follows_the_kv() -> None:
    cache = _cache()
    before = kv_checksum(cache, IDS)
    cache.layer_buffers[3][19, 0] ^= 0x01
    crc = LayerCrc(cache, IDS)
    crc.add(0, LAYOUT.num_layers, IDS)
    assert await crc.result() == kv_checksum(cache, IDS) != before
