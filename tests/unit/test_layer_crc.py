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


async def test_inline_threaded_and_mixed_steps_give_the_same_checksum() -> None:
    cache = _cache()
    whole = kv_checksum(cache, IDS)
    step_nbytes = len(IDS) * LAYOUT.block_nbytes
    # 0: every step to the thread; 2 layers' worth: one- and two-layer steps inline, the
    # three-layer step to the thread and the step after it chained behind it; huge: all inline.
    for inline_nbytes in (0, 2 * step_nbytes, 1 << 30):
        crc = LayerCrc(cache, IDS, inline_nbytes=inline_nbytes)
        crc.add(0, 1, IDS)
        crc.add(1, 3, IDS)
        crc.add(4, 1, IDS)
        crc.add(5, 1, IDS)
        assert await crc.result() == whole, inline_nbytes


async def test_a_closed_checksum_is_computed_whole() -> None:
    cache = _cache()
    crc = LayerCrc(cache, IDS, inline_nbytes=0)
    crc.add(0, 3, IDS)
    crc.close()  # the thread step is cancelled
    crc.add(3, 3, IDS)
    assert await crc.result() == kv_checksum(cache, IDS)
