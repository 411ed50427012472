"""The candidates the simulator hands the router's ``route`` for each request.

Passing every ready instance to ``route`` costs O(instances) per request, too slow at thousands
of GPUs. All simulated instances are identical, so a candidate that has no more free blocks and
no fewer running sequences than another (decode), or no fewer queued tokens and no more cached
prefix than another (prefill), is never a better choice for a policy that prefers room, low
pressure, short queues and cache hits. The shortlist holds only the candidates no other
dominates; of a group of exact ties (identical in everything ``route`` reads but the worker id)
it holds the first and the last by worker id, which is where any policy that breaks ties by id
looks (``route`` takes the largest id for decode, the smallest for prefill).
``SimConfig.is_shortlisted=False`` passes everything; the tests check that both give the same
result.

Keys. Each ready instance has one int key that packs its state and its rank by worker id, kept
in a sorted list per pool, so sorting keys sorts by state, then worker id: decode by free blocks
(most first), then running sequences (fewest first); prefill by queued tokens (fewest first).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TypeVar

from pdserve.common.errors import CapacityError
from pdserve.router.policy import DecodeCandidate, PrefillCandidate
from pdserve.sim.state import READY, DecodeInstance, Instance, PrefillInstance

_IDX_BITS = 20
_IDX_MASK = (1 << _IDX_BITS) - 1
_RUN_SHIFT = _IDX_BITS
_FREE_SHIFT = 2 * _IDX_BITS
MAX_FREE_BLOCKS = (1 << 22) - 1
"""The most KV blocks an instance may have (they share its key with running count and rank)."""
MAX_POOL_SIZE = _IDX_MASK
"""The most instances a pool may have launched (its rank shares the key)."""
_QUEUED_CAP = (1 << 40) - 1
_NOT_READY = _IDX_MASK + 1
"""``running`` of an instance that is not ready: above every real count."""

_InstanceT = TypeVar("_InstanceT", bound=Instance)


class Shortlist:
    """Sorted shortlist keys of both pools' ready instances (module docstring), over the
    simulator's pool lists (``prefills``, ``decodes``, indexed by instance number, appended by
    the caller before ``add``). ``update_*`` after anything a key holds changes."""

    def __init__(self, prefills: list[PrefillInstance], decodes: list[DecodeInstance],
                 block_size_tokens: int, is_shortlisted: bool = True) -> None:
        self._prefills = prefills
        self._decodes = decodes
        self._block_size = block_size_tokens
        self._is_shortlisted = is_shortlisted
        self._p_sorted: list[int] = []
        self._d_sorted: list[int] = []
        self._d_runs: list[int] = []  # running sequences per decode instance number
        self._p_by_rank: list[PrefillInstance] = []
        self._d_by_rank: list[DecodeInstance] = []

    @property
    def has_ready_decode(self) -> bool:
        return bool(self._d_sorted)

    # -- membership ---------------------------------------------------------------------------

    def add(self, inst: PrefillInstance | DecodeInstance) -> None:
        """A newly launched instance (already appended to its pool list)."""
        if inst.idx > MAX_POOL_SIZE:
            raise CapacityError(f"more than {MAX_POOL_SIZE} instances per pool are not supported")
        if isinstance(inst, DecodeInstance):
            self._d_runs.append(_NOT_READY)
            self._d_by_rank = self._rerank(self._decodes)
        else:
            self._p_by_rank = self._rerank(self._prefills)

    def _rerank(self, pool: list[_InstanceT]) -> list[_InstanceT]:
        """Rank a pool's instances by worker id (string order, as ``route`` compares them) and
        re-key them; returns rank -> instance."""
        by_rank = sorted(pool, key=lambda inst: inst.wid)
        for rank, inst in enumerate(by_rank):
            inst.rank = rank
            self.update(inst)
        return by_rank

    def update(self, inst: Instance) -> None:
        if isinstance(inst, DecodeInstance):
            self.update_decode(inst)
        elif isinstance(inst, PrefillInstance):
            self.update_prefill(inst)

    def update_decode(self, dec: DecodeInstance) -> None:
        """Re-key ``dec`` after its free blocks, running count or state changed."""
        dec.candidate = None
        ordered = self._d_sorted
        if dec.key >= 0:
            del ordered[bisect_left(ordered, dec.key)]
        if dec.state == READY:
            dec.key = (((MAX_FREE_BLOCKS - dec.free) << _FREE_SHIFT)
                       | (min(dec.running, _IDX_MASK) << _RUN_SHIFT) | dec.rank)
            insort(ordered, dec.key)
            self._d_runs[dec.idx] = dec.running
        else:
            dec.key = -1
            self._d_runs[dec.idx] = _NOT_READY

    def update_prefill(self, pre: PrefillInstance) -> None:
        """Re-key ``pre`` after its queued tokens or state changed."""
        pre.candidate = None
        ordered = self._p_sorted
        if pre.key >= 0:
            del ordered[bisect_left(ordered, pre.key)]
        if pre.state == READY:
            pre.key = (min(pre.queued_tokens, _QUEUED_CAP) << _IDX_BITS) | pre.rank
            insort(ordered, pre.key)
        else:
            pre.key = -1

    # -- candidates ---------------------------------------------------------------------------

    def decode_candidates(self, num_blocks: int) -> list[DecodeCandidate]:
        """Ready decode instances with room for ``num_blocks``, shortlisted. ``_d_sorted`` holds
        one key per ready instance, ordered by free blocks (most first), then running
        sequences, then worker id."""
        if not self._is_shortlisted:
            return [self._decode_candidate(d) for d in self._decodes
                    if d.state == READY and d.free >= num_blocks]
        ordered = self._d_sorted
        bound = (MAX_FREE_BLOCKS - num_blocks + 1) << _FREE_SHIFT
        if not ordered or ordered[0] >= bound:
            return []
        floor = min(self._d_runs)  # nothing can have fewer running sequences than this
        chosen = []
        best = _IDX_MASK + 1
        group = -1
        tail = 0
        for key in ordered:
            if key >= bound:
                break
            state = key >> _RUN_SHIFT
            if state == group:  # an exact tie of the last undominated candidate
                tail = key
                continue
            if tail:
                chosen.append(tail)
                tail = 0
            if best <= floor:
                break
            run = state & _IDX_MASK
            if run < best:
                chosen.append(key)
                best = run
                group = state
        if tail:
            chosen.append(tail)
        by_rank = self._d_by_rank
        candidates = []
        for key in chosen:
            dec = by_rank[key & _IDX_MASK]
            candidates.append(dec.candidate or self._decode_candidate(dec))
        return candidates

    def _decode_candidate(self, dec: DecodeInstance) -> DecodeCandidate:
        candidate = dec.candidate
        if candidate is None:
            candidate = dec.candidate = DecodeCandidate(
                dec.wid, dec.free, dec.total, dec.running, self._block_size)
        return candidate

    def prefill_candidates(self, overlap: dict[int, int]) -> list[PrefillCandidate]:
        """Ready prefill instances, shortlisted: the least-queued tie group's first and last by
        worker id, plus every instance holding a prefix of the prompt (``overlap``: instance
        number -> leading blocks it holds, only those > 0)."""
        prefills = self._prefills
        if not prefills:
            return []
        if not self._is_shortlisted:
            return [self._prefill_candidate(p, overlap.get(p.idx, 0)) for p in prefills
                    if p.state == READY]
        ordered = self._p_sorted
        if not ordered:
            return []
        by_rank = self._p_by_rank
        first = ordered[0]
        last = ordered[bisect_left(ordered, ((first >> _IDX_BITS) + 1) << _IDX_BITS) - 1]
        chosen = [by_rank[first & _IDX_MASK]]
        if last != first:
            chosen.append(by_rank[last & _IDX_MASK])
        if overlap:
            chosen = [p for p in chosen if p.idx not in overlap]
            chosen += [prefills[k] for k in sorted(overlap)]
        return [self._prefill_candidate(p, overlap.get(p.idx, 0)) for p in chosen]

    def _prefill_candidate(self, pre: PrefillInstance, cached_blocks: int) -> PrefillCandidate:
        if cached_blocks:
            return PrefillCandidate(pre.wid, pre.queued_tokens, cached_blocks * self._block_size)
        candidate = pre.candidate
        if candidate is None:
            candidate = pre.candidate = PrefillCandidate(pre.wid, pre.queued_tokens)
        return candidate
