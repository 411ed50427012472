"""Byte views of KV blocks for scatter/gather I/O: a layer's blocks as few buffers as possible
(runs of consecutive ids are one contiguous piece of memory), never a copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.common.errors import InvalidArgumentError
from pdserve.worker.engine import KvCache


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
        buffer[first : first + count].reshape(-1).data
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
            flat = buffer.data.cast("B")
            views.extend(flat[first * block_nbytes : (first + count) * block_nbytes]
                         for first, count in runs)
        else:  # a run of rows of a non-contiguous buffer would be copied by reshape: refuse
            raise InvalidArgumentError(f"KV layer buffer {layer} is not contiguous")
    return views
