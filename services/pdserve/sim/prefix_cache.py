"""Prefix caches of simulated prefill instances (traces with prefix hashes).

Each instance keeps an LRU of engine block hashes (``PrefillInstance.lru``). A prompt's blocks
are inserted or refreshed last block first, so a prefix always outlives its extensions: the LRU
holds prefix-closed chains, and the cached prefix of a prompt is found by bisection.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.sim.state import READY, PrefillInstance


def cached_prefix(lru: OrderedDict[int, None], hashes: list[int]) -> int:
    """Leading ``hashes`` held in ``lru``, by bisection (the LRU is prefix-closed)."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in lru:
            lo = mid
        else:
            hi = mid - 1
    return lo


def touch_prefix(lru: OrderedDict[int, None], hashes: list[int], capacity_blocks: int) -> None:
    """Insert or refresh ``hashes`` last block first, then evict the least recently used
    blocks beyond ``capacity_blocks``."""
    for value in reversed(hashes):
        if value in lru:
            lru.move_to_end(value)
        else:
            lru[value] = None
    excess = len(lru) - capacity_blocks
    for _ in range(max(0, excess)):
        lru.popitem(last=False)


def overlaps(prefills: list[PrefillInstance], hashes: list[int]) -> dict[int, int]:
    """Leading blocks of a prompt (its block ``hashes``) each ready prefill instance holds, by
    instance number (only those > 0)."""
    found: dict[int, int] = {}
    if not hashes:
        return found
    first = hashes[0]
    for pre in prefills:
        if pre.state == READY and first in pre.lru:
            found[pre.idx] = cached_prefix(pre.lru, hashes)
    return found
