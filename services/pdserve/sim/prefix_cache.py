"""Prefix caches of simulated prefill instances (traces with prefix hashes).

Each prefill instance keeps an LRU of engine blocks (``PrefillInstance.cache``), as the engine's
own prefix cache does. A prompt's blocks are inserted or refreshed last block first, so a prefix
always outlives its extensions: the cache holds prefix-closed chains, and the cached prefix of a
prompt is its leading blocks up to the first one missing.

The blocks are kept by trace block (``Trace.prefix_chunks``: a chain hash per
``hash_block_tokens`` of prompt, e.g. 32 engine blocks of 16 tokens in a Mooncake block of 512),
not one entry per engine block: the engine blocks of one trace block differ only by their place
in it, so which of them a cache holds is a count, and touching a 12k-token prompt is ~24 steps
rather than ~750. The LRU order is kept exactly, at engine-block grain, as *runs*: a run is
blocks ``lo..hi`` of one trace block, touched together (block ``hi`` the least recently used of
them). A touch of a trace block's first ``k`` blocks makes them one new run at the recent end;
its blocks beyond ``k`` keep their older runs, so the runs of one trace block, oldest first,
hold its highest blocks first, and eviction, taking blocks from the oldest run's top, leaves
each trace block holding a prefix of its blocks. ``tests/unit/test_sim_prefix_cache.py`` checks
this against a plain per-engine-block LRU.
"""

from __future__ import annotations

from collections import deque


class PrefixCache:
    """One instance's cache. ``num_blocks`` engine blocks are held; ``touch`` evicts down to
    the capacity it is given."""

    __slots__ = ("_held", "_num_dead", "_order", "_runs", "num_blocks")

    def __init__(self) -> None:
        self.num_blocks = 0
        self._held: dict[int, int] = {}
        """Trace-block chain hash -> engine blocks held of it (always its first ones)."""
        self._runs: dict[int, list[list[int]]] = {}
        """Trace-block chain hash -> its runs, oldest first."""
        self._order: deque[list[int]] = deque()
        """Every run as ``[chain hash, lo, hi]`` (engine blocks of that trace block, 1-based),
        least recently used first; a run refreshed whole is left here dead (``hi`` 0) until it
        reaches the front or dead runs outnumber live ones."""
        self._num_dead = 0

    def holds(self, chunk: int) -> bool:
        """Whether any block of trace block ``chunk`` (a chain hash) is held."""
        return chunk in self._held

    def cached_blocks(self, chunks: list[int], counts: list[int]) -> int:
        """Leading engine blocks of a prompt (``Trace.prefix_chunks``: chain hashes and engine
        blocks per trace block) that are held."""
        held = self._held
        total = 0
        for chunk, need in zip(chunks, counts, strict=True):
            have = held.get(chunk, 0)
            if have < need:
                return total + have
            total += need
        return total

    def touch(self, chunks: list[int], counts: list[int], capacity_blocks: int) -> None:
        """Insert or refresh a prompt's blocks, last block first, then evict the least recently
        used blocks beyond ``capacity_blocks``."""
        held, runs, order = self._held, self._runs, self._order
        added = dead = 0
        for i in range(len(chunks) - 1, -1, -1):
            chunk, need = chunks[i], counts[i]
            have = held.get(chunk, 0)
            if have:
                chunk_runs = runs[chunk]
                while chunk_runs:  # newest run first: it holds the lowest blocks
                    run = chunk_runs[-1]
                    if run[2] > need:
                        if run[1] <= need:
                            run[1] = need + 1
                        break
                    run[2] = 0
                    chunk_runs.pop()
                    dead += 1
                if need > have:
                    added += need - have
                    held[chunk] = need
            else:
                chunk_runs = runs[chunk] = []
                held[chunk] = need
                added += need
            run = [chunk, 1, need]
            order.append(run)
            chunk_runs.append(run)
        self.num_blocks += added
        self._num_dead += dead
        excess = self.num_blocks - capacity_blocks
        if excess > 0:
            self._evict(excess)
        if self._num_dead > len(order) // 2:
            self._order = deque(run for run in order if run[2])
            self._num_dead = 0

    def _evict(self, num_blocks: int) -> None:
        held, runs, order = self._held, self._runs, self._order
        self.num_blocks -= num_blocks
        while num_blocks > 0:
            run = order[0]
            chunk, lo, hi = run
            if not hi:
                order.popleft()
                self._num_dead -= 1
                continue
            size = hi - lo + 1
            if size > num_blocks:
                run[2] = hi - num_blocks
                held[chunk] -= num_blocks
                return
            order.popleft()
            num_blocks -= size
            chunk_runs = runs[chunk]
            del chunk_runs[0]
            if chunk_runs:
                held[chunk] -= size
            else:
                del runs[chunk], held[chunk]
