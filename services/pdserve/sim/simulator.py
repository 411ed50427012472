"""Discrete-event simulation of one deployment's prefill and decode pools.

Events happen at batch boundaries, never per token: a prefill instance runs one batch of queued
prompts at a time; a decode instance runs continuous-batching steps, each advancing every
sequence in its batch by one token in ``decode_step_s(batch, total context)``. A sequence's
finishing step is known when it joins the batch (``join step + output - 1``), so a step costs
O(log batch) however large the batch is.

The decisions are the live services' own policy objects:

- routing, local-vs-remote prefill and the KV reservation size: ``pdserve.router.policy.route``
  with the configured ``RoutingConfig``, over candidates built from the simulated instances'
  state (free blocks, running sequences, queued prefill tokens, prefix-cache overlap);
- ticket states: every move is counted and checked against ``TICKET_TRANSITIONS``;
- scaling: any ``ScalingPolicy``, asked every ``scaling_interval_s`` with a
  ``ScalingObservation``; instances it adds serve after ``cold_start_s``; instances it removes
  are chosen by ``pdserve.pool.manager.choose_drain_victims`` and drain (finish their work, take
  no new work, then leave).

Candidate shortlist. Passing every ready instance to ``route`` costs O(instances) per request,
too slow at thousands of GPUs. All simulated instances are identical, so a candidate that has
no more free blocks and no fewer running sequences than another (decode), or no fewer queued
tokens and no more cached prefix than another (prefill), is never a better choice for a policy
that prefers room, low pressure, short queues and cache hits. The simulator passes only the
candidates no other dominates; of a group of exact ties (identical in everything ``route``
reads but the worker id) it passes the first and the last by worker id, which is where any
policy that breaks ties by id looks (``route`` takes the largest id for decode, the smallest
for prefill). ``SimConfig.is_shortlisted=False`` passes everything; the tests check that both
give the same result.

Admission: a request that no decode instance has room for waits in a FIFO queue at the router
(at most ``max_queued_requests``; beyond it, rejected); the queue head is retried whenever KV
blocks are freed or an instance becomes ready. Failures: an instance that fails loses its work;
requests it held before their first token are retried (a new attempt, up to ``max_attempts``)
on the remaining instances, requests past their first token fail.

Local prefill runs on the decode instance as a step of its own, between decode steps (the batch
stalls for it), alternating with decode steps while both have work.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from array import array
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from pdserve.common.errors import CapacityError, IllegalTransitionError, UnavailableError
from pdserve.common.types import (
    TICKET_TRANSITIONS,
    TicketState,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)
from pdserve.router.policy import (
    DecodeCandidate,
    PrefillCandidate,
    RouteRequest,
    num_blocks_to_reserve,
    route,
)
from pdserve.sim.config import SimConfig
from pdserve.sim.engine_model import InstanceModel, instance_model
from pdserve.sim.result import InstanceEvent, RequestStatus, ScalingRecord, SimResult
from pdserve.sim.traces import Trace

ProgressFn = Callable[[int, int, float], None]
"""``progress(num_arrived, num_requests, sim_time_s)``, called every few thousand arrivals."""

# Instance lifecycle.
_STARTING, _READY, _DRAINING, _GONE, _FAILED = range(5)
# Ticket states as small ints (index into _TICKET_STATES).
_TICKET_STATES = tuple(TicketState)
_OPEN, _PREFILLING, _TRANSFERRING, _DONE, _ABORTED = (
    _TICKET_STATES.index(s) for s in (TicketState.OPEN, TicketState.PREFILLING,
                                      TicketState.TRANSFERRING, TicketState.DONE,
                                      TicketState.ABORTED))
_NUM_TICKET_STATES = len(_TICKET_STATES)
# Event kinds.
_EV_PREFILL_DONE, _EV_KV_LANDED, _EV_DECODE_STEP, _EV_READY, _EV_FAIL, _EV_SCALE, _EV_SAMPLE = (
    range(7))
# Decode step kinds.
_STEP_DECODE, _STEP_LOCAL = 0, 1

# Shortlist keys pack an instance's state and its rank by worker id into one int (see
# _update_decode / _update_prefill), so sorting keys sorts by state, then worker id.
_IDX_BITS = 20
_IDX_MASK = (1 << _IDX_BITS) - 1
_RUN_SHIFT = _IDX_BITS
_FREE_SHIFT = 2 * _IDX_BITS
_MAX_FREE = (1 << 22) - 1
_QUEUED_CAP = (1 << 40) - 1
_CHUNK = 1 << 14


class _Req:
    """A request in flight (freed when it finishes). Times are simulated seconds."""

    __slots__ = (
        "arrival",
        "attempt",
        "cached",
        "compute_s",
        "dec",
        "first_s",
        "hashes",
        "i",
        "is_local",
        "join_s",
        "join_step",
        "num_attempts",
        "num_blocks",
        "output",
        "pre",
        "prompt",
        "route_request",
        "ticket",
        "transfer_s",
    )

    def __init__(self, i: int, arrival: float, prompt: int, output: int,
                 route_request: RouteRequest, num_blocks: int) -> None:
        self.i = i
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.route_request = route_request
        self.num_blocks = num_blocks
        self.attempt = 0
        self.num_attempts = 0
        self.dec: _Decode | None = None
        self.pre: _Prefill | None = None
        self.ticket = -1
        self.compute_s = 0.0
        self.transfer_s = 0.0
        self.first_s = -1.0
        self.join_step = 0
        self.join_s = 0.0
        self.is_local = False
        self.cached = 0
        self.hashes: list[int] | None = None


class _Instance:
    __slots__ = (
        "assigned",
        "busy",
        "epoch",
        "idx",
        "key",
        "launched_s",
        "rank",
        "role",
        "state",
        "wid",
    )

    def __init__(self, idx: int, wid: str, role: WorkerRole, now: float) -> None:
        self.idx = idx
        self.rank = idx
        self.key = -1
        self.wid = wid
        self.role = role
        self.state = _STARTING
        self.epoch = 0
        self.busy = False
        self.assigned: set[_Req] = set()
        self.launched_s = now


class _Prefill(_Instance):
    __slots__ = ("batch", "candidate", "lru", "queue", "queued_tokens")

    def __init__(self, idx: int, now: float) -> None:
        super().__init__(idx, f"p{idx}", WorkerRole.PREFILL, now)
        self.queue: deque[tuple[_Req, int]] = deque()
        self.queued_tokens = 0
        self.batch: list[tuple[_Req, int]] = []
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.candidate: PrefillCandidate | None = None


class _Decode(_Instance):
    __slots__ = (
        "candidate",
        "ctx_base",
        "free",
        "heap",
        "local",
        "local_batch",
        "n_batch",
        "run_delta_s",
        "run_first_s",
        "run_start",
        "run_steps",
        "running",
        "step_kind",
        "step_s",
        "steps",
        "total",
        "waiting",
    )

    def __init__(self, idx: int, now: float, total_blocks: int) -> None:
        super().__init__(idx, f"d{idx}", WorkerRole.DECODE, now)
        self.free = total_blocks
        self.total = total_blocks
        self.running = 0
        self.heap: list[tuple[int, int, _Req]] = []
        self.n_batch = 0
        self.ctx_base = 0
        self.steps = 0
        self.waiting: deque[_Req] = deque()
        self.local: deque[tuple[_Req, int]] = deque()
        self.step_kind = _STEP_DECODE
        self.step_s = 0.0
        self.local_batch: list[tuple[_Req, int]] = []
        self.candidate: DecodeCandidate | None = None
        # The decode run in flight: run_steps steps from run_start, step i lasting
        # run_first_s + i x run_delta_s.
        self.run_steps = 0
        self.run_start = 0.0
        self.run_first_s = 0.0
        self.run_delta_s = 0.0


class Simulator:
    """One run: ``Simulator(trace, config, policy).run()`` -> ``SimResult``.

    ``policy`` is any object with ``decide(ScalingObservation) -> ScalingDecision`` (None: the
    pools keep their size). ``instance`` overrides the catalog-derived instance model (tests).
    """

    def __init__(self, trace: Trace, config: SimConfig, policy: Any | None = None, *,
                 instance: InstanceModel | None = None,
                 progress: ProgressFn | None = None) -> None:
        cluster = config.cluster
        self.trace = trace
        self.config = config
        self.policy = policy
        self.progress = progress
        self.model = instance or instance_model(
            cluster.model, cluster.gpu, cluster.tp_size,
            block_size_tokens=cluster.block_size_tokens,
            gpu_memory_utilization=cluster.gpu_memory_utilization)
        if self.model.num_blocks > _MAX_FREE:
            raise CapacityError(f"instances with over {_MAX_FREE} KV blocks are not supported")
        self._block_size = self.model.block_size_tokens
        # Hot-path timing functions, bound once; decode step lines per batch size.
        self._prefill_s = self.model.perf.prefill_time_s
        self._step_s = self.model.perf.decode_step_time_s
        self._lines: dict[int, tuple[float, float, float, float] | None] = {}
        self._lru_cap = cluster.prefix_cache_blocks or self.model.num_blocks
        self._has_hashes = trace.has_prefix_hashes
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._prefills: list[_Prefill] = []
        self._decodes: list[_Decode] = []
        self._by_id: dict[str, _Prefill | _Decode] = {}
        # Shortlist keys of ready instances, sorted (see _update_decode / _update_prefill).
        self._p_sorted: list[int] = []
        self._d_sorted: list[int] = []
        self._d_runs: list[int] = []
        self._p_by_rank: list[_Prefill] = []
        self._d_by_rank: list[_Decode] = []
        self._queue: deque[_Req] = deque()
        self._transitions = [0] * (_NUM_TICKET_STATES * _NUM_TICKET_STATES)
        self._events: list[InstanceEvent] = []
        self._scaling: list[ScalingRecord] = []
        self._num_events = 0
        self._in_flight = 0
        self._blocks_freed = False
        # Integrals over time, for GPU-hours and the scaling observation.
        self._last_t = 0.0
        self._num_alive = 0
        self._gpu_s = 0.0
        self._used_blocks = 0
        self._used_t = 0.0
        self._used_int = 0.0
        self._used_total_int = 0.0
        self._serving_blocks = 0
        self._serving_int = 0.0
        self._num_prefill_ready = 0
        self._prefill_ready_int = 0.0
        self._prefill_busy_s = 0.0
        self._prefill_busy_total_s = 0.0
        # Whole-run integrals: used blocks, serving blocks, ready prefill instances (for the
        # utilisation figures in SimResult.extra).
        self._totals = [0.0, 0.0, 0.0]
        # Per-interval counters for the scaling observation.
        self._win_arrivals = 0
        self._win_prompt = 0
        self._win_output = 0
        self._win_done = 0
        self._win_met = 0
        self._rates: list[float] = []
        self._last_means = (0.0, 0.0)
        self._ttft_limit = config.slo.ttft_ms / 1000.0
        self._tpot_limit = config.slo.tpot_ms / 1000.0
        self._timeline: dict[str, array] = {name: array("d") for name in (
            "time_s", "prefill_ready", "prefill_starting", "prefill_draining", "decode_ready",
            "decode_starting", "decode_draining", "num_queued", "kv_used_fraction")}
        n = trace.num_requests
        self._res_f = {name: array("d", bytes(8 * n)) for name in (
            "ttft_s", "tpot_s", "finish_s", "compute_s", "transfer_s", "slot_wait_s")}
        self._res_ttft = self._res_f["ttft_s"]
        self._res_tpot = self._res_f["tpot_s"]
        self._res_finish = self._res_f["finish_s"]
        self._res_compute = self._res_f["compute_s"]
        self._res_transfer = self._res_f["transfer_s"]
        self._res_slot_wait = self._res_f["slot_wait_s"]
        self._res_status = array("b", [-1]) * n
        self._res_local = array("b", bytes(n))
        self._res_attempts = array("b", bytes(n))
        self._res_dec = array("i", [-1]) * n
        self._res_pre = array("i", [-1]) * n
        self._res_cached = array("q", bytes(8 * n))
        self._handlers: list[Callable[[Any], None]] = [
            self._on_prefill_done, self._on_kv_landed, self._on_decode_step, self._on_ready,
            self._on_fail, self._on_scale, self._on_sample]

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        cpu_started = time.process_time()
        cluster = self.config.cluster
        for _ in range(cluster.num_prefill):
            self._make_ready(self._launch(WorkerRole.PREFILL))
        for _ in range(cluster.num_decode):
            self._make_ready(self._launch(WorkerRole.DECODE))
        for failure in self.config.failures:
            self._push(failure.time_s, _EV_FAIL, failure.instance_id)
        if self.policy is not None:
            self._push(self.config.scaling_interval_s, _EV_SCALE, None)
        self._push(0.0, _EV_SAMPLE, None)
        self._loop()
        self._advance(self.now)
        result = self._result(time.perf_counter() - started)
        result.extra["cpu_s"] = time.process_time() - cpu_started
        return result

    def _loop(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        handlers = self._handlers
        trace = self.trace
        n = trace.num_requests
        routing = self.config.routing
        block_size = self._block_size
        max_tokens = self.config.max_tokens
        num_events = 0
        for start in range(0, n, _CHUNK):
            stop = min(n, start + _CHUNK)
            arrivals = trace.arrival_s[start:stop].tolist()
            prompts = trace.prompt_tokens[start:stop].tolist()
            outputs = trace.output_tokens[start:stop].tolist()
            for j, arrival in enumerate(arrivals):
                while heap and heap[0][0] <= arrival:
                    t, _, kind, payload = pop(heap)
                    self.now = t
                    handlers[kind](payload)
                    num_events += 1
                    if self._blocks_freed:
                        self._blocks_freed = False
                        if self._queue:
                            self._drain_queue()
                self.now = arrival
                output = outputs[j]
                if max_tokens:  # the client's limit; the trace's length is where it would stop
                    output = min(output, max_tokens)
                rr = RouteRequest(prompts[j], max_tokens or output)
                req = _Req(start + j, arrival, prompts[j], output, rr,
                           num_blocks_to_reserve(rr, block_size, routing))
                self._arrive(req)
            if self.progress is not None:
                self.progress(stop, n, self.now)
        while heap and self._in_flight:
            t, _, kind, payload = pop(heap)
            self.now = t
            handlers[kind](payload)
            num_events += 1
            if self._blocks_freed:
                self._blocks_freed = False
                if self._queue:
                    self._drain_queue()
        self._num_events = num_events + n

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    # -- arrivals, routing, admission ---------------------------------------------------------

    def _arrive(self, req: _Req) -> None:
        self._in_flight += 1
        self._win_arrivals += 1
        self._win_prompt += req.prompt
        self._win_output += req.output
        if req.num_blocks > self.model.num_blocks or not self._d_sorted:
            # Can never fit anywhere, or no decode instance is ready (the live router answers
            # UNAVAILABLE then): refused at once.
            self._finish_unserved(req, RequestStatus.REJECTED)
            return
        queue = self._queue
        if queue:
            if len(queue) >= self.config.max_queued_requests:
                self._finish_unserved(req, RequestStatus.REJECTED)
            else:
                queue.append(req)
        elif not self._try_route(req):
            if self.config.max_queued_requests == 0:
                self._finish_unserved(req, RequestStatus.REJECTED)
            else:
                queue.append(req)

    def _drain_queue(self) -> None:
        queue = self._queue
        while queue and self._try_route(queue[0]):
            queue.popleft()
        if queue and not any(d.state in (_STARTING, _READY) for d in self._decodes):
            while queue:  # no decode instance will ever have room: refuse what waits
                req = queue.popleft()  # (a retry that cannot be placed has failed)
                self._finish_unserved(req, RequestStatus.FAILED if req.num_attempts
                                      else RequestStatus.REJECTED)

    def _try_route(self, req: _Req) -> bool:
        """Route ``req`` with the live policy and dispatch it; False if no decode has room."""
        decodes = self._decode_candidates(req.num_blocks)
        if not decodes:
            return False
        try:
            decision = route(req.route_request, decodes, self._prefill_candidates(req),
                             self.config.routing)
        except (CapacityError, UnavailableError):
            return False
        dec = self._by_id[decision.decode_worker_id]
        assert isinstance(dec, _Decode)
        num_blocks = decision.num_blocks
        req.num_blocks = num_blocks
        req.num_attempts += 1
        req.dec = dec
        req.ticket = _OPEN  # a new ticket: no transition to count
        self._change_used(num_blocks)
        dec.free -= num_blocks
        dec.assigned.add(req)
        self._update_decode(dec)
        if decision.prefill_worker_id:
            pre = self._by_id[decision.prefill_worker_id]
            assert isinstance(pre, _Prefill)
            req.pre = pre
            req.is_local = False
            pre.queue.append((req, req.attempt))
            pre.queued_tokens += req.prompt
            pre.assigned.add(req)
            self._update_prefill(pre)
            if not pre.busy:
                self._start_prefill(pre)
        else:
            req.pre = None
            req.is_local = True
            dec.local.append((req, req.attempt))
            if not dec.busy:
                self._next_step(dec)
            else:
                self._cut_run(dec)
        return True

    def _decode_candidates(self, num_blocks: int) -> list[DecodeCandidate]:
        """Ready decode instances with room for ``num_blocks``, shortlisted (see the module
        docstring). ``_d_sorted`` holds one key per ready instance, ordered by free blocks (most
        first), then running sequences, then worker id."""
        if not self.config.is_shortlisted:
            return [self._decode_candidate(d) for d in self._decodes
                    if d.state == _READY and d.free >= num_blocks]
        ordered = self._d_sorted
        bound = (_MAX_FREE - num_blocks + 1) << _FREE_SHIFT
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

    def _decode_candidate(self, dec: _Decode) -> DecodeCandidate:
        candidate = dec.candidate
        if candidate is None:
            candidate = dec.candidate = DecodeCandidate(
                dec.wid, dec.free, dec.total, dec.running, self._block_size)
        return candidate

    def _prefill_candidates(self, req: _Req) -> list[PrefillCandidate]:
        """Ready prefill instances, shortlisted: the least-queued tie group's first and last by
        worker id, plus every instance holding a prefix of the prompt."""
        prefills = self._prefills
        if not prefills:
            return []
        overlap: dict[int, int] = {}
        if self._has_hashes:
            overlap = self._overlaps(req)
        if not self.config.is_shortlisted:
            return [self._prefill_candidate(p, overlap.get(p.idx, 0)) for p in prefills
                    if p.state == _READY]
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

    def _prefill_candidate(self, pre: _Prefill, cached_blocks: int) -> PrefillCandidate:
        if cached_blocks:
            return PrefillCandidate(pre.wid, pre.queued_tokens, cached_blocks * self._block_size)
        candidate = pre.candidate
        if candidate is None:
            candidate = pre.candidate = PrefillCandidate(pre.wid, pre.queued_tokens)
        return candidate

    def _update_decode(self, dec: _Decode) -> None:
        """Re-key ``dec`` after its free blocks, running count or state changed."""
        dec.candidate = None
        ordered = self._d_sorted
        if dec.key >= 0:
            del ordered[bisect_left(ordered, dec.key)]
        if dec.state == _READY:
            dec.key = (((_MAX_FREE - dec.free) << _FREE_SHIFT)
                       | (min(dec.running, _IDX_MASK) << _RUN_SHIFT) | dec.rank)
            insort(ordered, dec.key)
            self._d_runs[dec.idx] = dec.running
        else:
            dec.key = -1
            self._d_runs[dec.idx] = _IDX_MASK + 1

    def _update_prefill(self, pre: _Prefill) -> None:
        """Re-key ``pre`` after its queued tokens or state changed."""
        pre.candidate = None
        ordered = self._p_sorted
        if pre.key >= 0:
            del ordered[bisect_left(ordered, pre.key)]
        if pre.state == _READY:
            pre.key = (min(pre.queued_tokens, _QUEUED_CAP) << _IDX_BITS) | pre.rank
            insort(ordered, pre.key)
        else:
            pre.key = -1

    def _rerank(self, pool: list[Any]) -> list[Any]:
        """Rank a pool's instances by worker id (string order, as ``route`` compares them) and
        re-key them; returns rank -> instance."""
        by_rank = sorted(pool, key=lambda inst: inst.wid)
        for rank, inst in enumerate(by_rank):
            inst.rank = rank
            self._update(inst)
        return by_rank

    # -- prefix cache (traces with prefix hashes) ---------------------------------------------

    def _hashes(self, req: _Req) -> list[int]:
        if req.hashes is None:
            req.hashes = self.trace.engine_block_hashes(req.i, self._block_size)
        return req.hashes

    def _overlaps(self, req: _Req) -> dict[int, int]:
        """Leading blocks of ``req`` each ready prefill instance holds (only those > 0)."""
        hashes = self._hashes(req)
        found: dict[int, int] = {}
        if not hashes:
            return found
        first = hashes[0]
        for pre in self._prefills:
            if pre.state == _READY and first in pre.lru:
                found[pre.idx] = _cached_prefix(pre.lru, hashes)
        return found

    def _touch_prefix(self, pre: _Prefill, hashes: list[int]) -> None:
        """Insert or refresh ``hashes`` last block first, so a prefix always outlives its
        extensions (the LRU then holds prefix-closed chains and overlap is a bisection)."""
        lru = pre.lru
        for value in reversed(hashes):
            if value in lru:
                lru.move_to_end(value)
            else:
                lru[value] = None
        excess = len(lru) - self._lru_cap
        for _ in range(max(0, excess)):
            lru.popitem(last=False)

    # -- prefill instances --------------------------------------------------------------------

    def _start_prefill(self, pre: _Prefill) -> None:
        queue = pre.queue
        budget = self.config.cluster.prefill_batch_tokens
        batch: list[tuple[_Req, int]] = []
        lengths: list[int] = []
        total = 0
        while queue:
            req, attempt = queue[0]
            if req.attempt != attempt:
                queue.popleft()
                continue
            cached = 0
            if self._has_hashes:
                hashes = self._hashes(req)
                if hashes:
                    cached = min(_cached_prefix(pre.lru, hashes) * self._block_size,
                                 req.prompt - 1)
            uncached = req.prompt - cached
            if batch and total + uncached > budget:
                break
            queue.popleft()
            if self._has_hashes and req.hashes:
                self._touch_prefix(pre, req.hashes)
            req.cached = cached
            self._set_ticket(req, _PREFILLING)
            batch.append((req, attempt))
            lengths.append(uncached)
            total += uncached
        if not batch:
            pre.busy = False
            self._maybe_leave(pre)
            return
        duration = self._prefill_s(lengths)
        self._prefill_busy_s += duration
        self._prefill_busy_total_s += duration
        pre.batch = batch
        pre.busy = True
        self._push(self.now + duration, _EV_PREFILL_DONE, (pre, pre.epoch, duration))

    def _on_prefill_done(self, payload: tuple[_Prefill, int, float]) -> None:
        pre, epoch, duration = payload
        if pre.epoch != epoch:
            return
        landing = []
        num_tokens = 0
        for req, attempt in pre.batch:
            if req.attempt != attempt:
                continue
            self._set_ticket(req, _TRANSFERRING)
            pre.queued_tokens -= req.prompt
            req.compute_s = duration
            num_tokens += req.prompt
            landing.append((req, attempt))
        pre.batch = []
        self._update_prefill(pre)
        if landing:
            exposed = self.model.exposed_transfer_s(num_tokens, duration)
            for req, _ in landing:
                req.transfer_s = exposed
            self._push(self.now + exposed, _EV_KV_LANDED, landing)
        pre.busy = False
        if pre.queue:
            self._start_prefill(pre)
        else:
            self._maybe_leave(pre)

    def _on_kv_landed(self, landing: list[tuple[_Req, int]]) -> None:
        for req, attempt in landing:
            if req.attempt != attempt:
                continue
            self._set_ticket(req, _DONE)
            pre = req.pre
            assert pre is not None
            pre.assigned.discard(req)
            self._first_token(req)
            if pre.state == _DRAINING:
                self._maybe_leave(pre)

    # -- decode instances ---------------------------------------------------------------------

    def _first_token(self, req: _Req) -> None:
        req.first_s = self.now
        dec = req.dec
        assert dec is not None
        if req.output <= 1:
            self._finish(req, dec)
            return
        dec.waiting.append(req)
        dec.running += 1
        self._update_decode(dec)
        if not dec.busy:
            self._next_step(dec)
        elif dec.n_batch < self.config.cluster.max_batch_size:
            self._cut_run(dec)

    def _on_decode_step(self, payload: tuple[_Decode, int]) -> None:
        dec, epoch = payload
        if dec.epoch != epoch:
            return
        # dec stays busy while this step's results are applied: joins and leaving happen in
        # _next_step, once.
        if dec.step_kind == _STEP_LOCAL:
            batch, dec.local_batch = dec.local_batch, []
            for req, attempt in batch:
                if req.attempt == attempt:
                    self._set_ticket(req, _DONE)
                    req.compute_s = dec.step_s
                    req.transfer_s = 0.0
                    self._first_token(req)
        else:
            dec.steps += dec.run_steps
            steps = dec.steps
            heap = dec.heap
            while heap and heap[0][0] <= steps:
                req = heapq.heappop(heap)[2]
                dec.n_batch -= 1
                dec.ctx_base -= req.prompt + 1 - req.join_step
                self._finish(req, dec)
        dec.busy = False
        self._next_step(dec)

    def _next_step(self, dec: _Decode) -> None:
        """At a step boundary of an idle ``dec``: start a local prefill step or a decode step."""
        local = dec.local
        while local and local[0][0].attempt != local[0][1]:
            local.popleft()
        if local and (dec.step_kind == _STEP_DECODE or not (dec.n_batch or dec.waiting)):
            budget = self.config.cluster.prefill_batch_tokens
            batch = []
            lengths = []
            total = 0
            while local:
                req, attempt = local[0]
                if req.attempt != attempt:
                    local.popleft()
                    continue
                if batch and total + req.prompt > budget:
                    break
                local.popleft()
                batch.append((req, attempt))
                lengths.append(req.prompt)
                total += req.prompt
            duration = self._prefill_s(lengths)
            dec.local_batch = batch
            self._start_step(dec, _STEP_LOCAL, duration)
            return
        waiting = dec.waiting
        if waiting and dec.n_batch < self.config.cluster.max_batch_size:
            room = self.config.cluster.max_batch_size - dec.n_batch
            steps = dec.steps
            now = self.now
            heap = dec.heap
            for _ in range(min(room, len(waiting))):
                req = waiting.popleft()
                req.join_step = steps
                req.join_s = now
                heapq.heappush(heap, (steps + req.output - 1, req.i, req))
                dec.ctx_base += req.prompt + 1 - steps
            dec.n_batch = len(heap)
        if dec.n_batch:
            self._start_run(dec)
        else:
            dec.step_kind = _STEP_DECODE
            self._maybe_leave(dec)

    def _start_step(self, dec: _Decode, kind: int, duration: float) -> None:
        dec.step_kind = kind
        dec.step_s = duration
        dec.busy = True
        dec.run_steps = 1
        self._push(self.now + duration, _EV_DECODE_STEP, (dec, dec.epoch))

    def _start_run(self, dec: _Decode) -> None:
        """Decode steps until the batch's next completion, as one event.

        Nothing else changes the batch before then unless a sequence arrives to join it or a
        local prefill arrives (``_cut_run`` then ends the run at the next step boundary). Step
        ``i`` reads ``n`` more context tokens than step ``i - 1``. For a batch of ``n`` the
        step time is the larger of two lines in the context length (the roofline's compute and
        memory bounds; ``InstanceModel.decode_step_lines``, checked against the performance
        model), so while one line dominates the steps sum in closed form; a run in which the
        dominant line changes is cut to one step. Without lines (a performance model of
        another shape), three calls check that the run is linear.
        """
        n = dec.n_batch
        context = dec.ctx_base + n * dec.steps
        num_steps = dec.heap[0][0] - dec.steps
        lines = self._lines.get(n, False)
        if lines is False:
            lines = self._lines[n] = self.model.decode_step_lines(n)
        delta_s = 0.0
        if lines is not None:  # step time = the larger of two lines in the context length
            base_a, slope_a, base_b, slope_b = lines
            line_a = base_a + slope_a * context
            line_b = base_b + slope_b * context
            first_s = line_a if line_a >= line_b else line_b  # noqa: FURB136 - hot path
            if num_steps > 1:
                end = context + (num_steps - 1) * n
                if (line_a >= line_b) == (base_a + slope_a * end >= base_b + slope_b * end):
                    delta_s = (slope_a if line_a >= line_b else slope_b) * n
                else:
                    num_steps = 1  # the roofline regime changes inside the run
        else:
            step_s = self._step_s
            first_s = step_s(n, context)
            if num_steps > 1:
                last_s = step_s(n, context + (num_steps - 1) * n)
                delta_s = (last_s - first_s) / (num_steps - 1)
                mid = num_steps // 2
                if num_steps > 2 and abs(step_s(n, context + mid * n)
                                         - (first_s + mid * delta_s)) > 1e-9 * last_s:
                    num_steps = 1
        dec.step_kind = _STEP_DECODE
        dec.busy = True
        dec.run_steps = num_steps
        dec.run_start = self.now
        dec.run_first_s = first_s
        dec.run_delta_s = delta_s
        duration = num_steps * first_s + delta_s * (num_steps * (num_steps - 1) / 2)
        self._push(self.now + duration, _EV_DECODE_STEP, (dec, dec.epoch))

    def _cut_run(self, dec: _Decode) -> None:
        """End ``dec``'s decode run at the first step boundary at or after now."""
        num_steps = dec.run_steps
        if num_steps <= 1 or dec.step_kind != _STEP_DECODE:
            return
        first_s, delta_s = dec.run_first_s, dec.run_delta_s
        elapsed = self.now - dec.run_start

        def ends_s(j: int) -> float:
            return j * first_s + delta_s * (j * (j - 1) / 2)

        if delta_s > 0:
            b = first_s - delta_s / 2
            j = math.ceil((-b + math.sqrt(b * b + 2 * delta_s * elapsed)) / delta_s)
        else:
            j = math.ceil(elapsed / first_s)
        j = max(1, min(num_steps, j))
        while j < num_steps and ends_s(j) < elapsed:
            j += 1
        while j > 1 and ends_s(j - 1) >= elapsed:
            j -= 1
        if j >= num_steps:
            return
        dec.run_steps = j
        dec.epoch += 1
        self._push(dec.run_start + ends_s(j), _EV_DECODE_STEP, (dec, dec.epoch))

    # -- request ends -------------------------------------------------------------------------

    def _finish(self, req: _Req, dec: _Decode) -> None:
        """``req`` produced its last token on ``dec``: record it and free its blocks."""
        now = self.now
        self._change_used(-req.num_blocks)
        dec.free += req.num_blocks
        if req.output > 1:
            dec.running -= 1
        dec.assigned.discard(req)
        self._update_decode(dec)
        self._blocks_freed = True
        i = req.i
        ttft = req.first_s - req.arrival
        self._res_ttft[i] = ttft
        self._res_finish[i] = now
        self._res_compute[i] = req.compute_s
        self._res_transfer[i] = req.transfer_s
        if req.output > 1:
            tpot = (now - req.first_s) / (req.output - 1)
            self._res_tpot[i] = tpot
            self._res_slot_wait[i] = req.join_s - req.first_s
        else:
            tpot = 0.0
        self._res_status[i] = RequestStatus.COMPLETED
        self._res_local[i] = req.is_local
        self._res_attempts[i] = req.num_attempts
        self._res_dec[i] = dec.idx
        self._res_pre[i] = -1 if req.pre is None else req.pre.idx
        self._res_cached[i] = req.cached
        self._in_flight -= 1
        self._win_done += 1
        if ttft <= self._ttft_limit and tpot <= self._tpot_limit:
            self._win_met += 1
        if dec.state == _DRAINING:
            self._maybe_leave(dec)

    def _finish_unserved(self, req: _Req, status: RequestStatus) -> None:
        i = req.i
        self._res_status[i] = status
        self._res_attempts[i] = req.num_attempts
        self._res_finish[i] = self.now
        self._in_flight -= 1
        self._win_done += 1

    def _set_ticket(self, req: _Req, state: int) -> None:
        if req.ticket >= 0:
            self._transitions[req.ticket * _NUM_TICKET_STATES + state] += 1
        req.ticket = state

    # -- lifecycle: launch, ready, drain, fail ------------------------------------------------

    def _launch(self, role: WorkerRole) -> _Prefill | _Decode:
        self._advance(self.now)
        inst: _Prefill | _Decode
        if role is WorkerRole.PREFILL:
            inst = _Prefill(len(self._prefills), self.now)
            self._prefills.append(inst)
            self._p_by_rank = self._rerank(self._prefills)
        else:
            inst = _Decode(len(self._decodes), self.now, self.model.num_blocks)
            self._decodes.append(inst)
            self._d_runs.append(_IDX_MASK + 1)
            self._d_by_rank = self._rerank(self._decodes)
        if inst.idx > _IDX_MASK:
            raise CapacityError(f"more than {_IDX_MASK} instances per pool are not supported")
        self._by_id[inst.wid] = inst
        self._num_alive += 1
        self._log(inst, "launched")
        return inst

    def _make_ready(self, inst: _Prefill | _Decode) -> None:
        self._advance(self.now)
        inst.state = _READY
        if isinstance(inst, _Decode):
            self._serving_blocks += inst.total
            self._update_decode(inst)
            self._blocks_freed = True  # new room for the admission queue
        else:
            self._num_prefill_ready += 1
            self._update_prefill(inst)
        self._log(inst, "ready")

    def _on_ready(self, payload: tuple[_Prefill | _Decode, int]) -> None:
        inst, epoch = payload
        if inst.epoch == epoch and inst.state == _STARTING:
            self._make_ready(inst)

    def _drain(self, inst: _Prefill | _Decode) -> None:
        self._advance(self.now)
        if inst.state == _STARTING:
            inst.epoch += 1
            self._gone(inst, _GONE, "left")
            return
        if inst.state != _READY:
            return
        if isinstance(inst, _Prefill):
            self._num_prefill_ready -= 1
        inst.state = _DRAINING
        self._update(inst)
        self._log(inst, "draining")
        self._maybe_leave(inst)

    def _maybe_leave(self, inst: _Prefill | _Decode) -> None:
        if inst.state != _DRAINING or inst.busy or inst.assigned:
            return
        if isinstance(inst, _Prefill) and inst.queue:
            return
        self._advance(self.now)
        self._gone(inst, _GONE, "left")

    def _gone(self, inst: _Prefill | _Decode, state: int, event: str) -> None:
        was_serving = inst.state in (_READY, _DRAINING)
        if isinstance(inst, _Decode) and was_serving:
            self._serving_blocks -= inst.total
        if isinstance(inst, _Prefill) and inst.state == _READY:
            self._num_prefill_ready -= 1
        inst.state = state
        self._num_alive -= 1
        self._update(inst)
        self._log(inst, event)

    def _update(self, inst: _Prefill | _Decode) -> None:
        if isinstance(inst, _Decode):
            self._update_decode(inst)
        else:
            self._update_prefill(inst)

    def _on_fail(self, instance_id: str) -> None:
        inst = self._by_id.get(instance_id)
        if inst is None or inst.state in (_GONE, _FAILED):
            return
        self._advance(self.now)
        inst.epoch += 1
        inst.busy = False
        self._gone(inst, _FAILED, "failed")
        victims = sorted(inst.assigned, key=lambda r: r.i)
        inst.assigned.clear()
        if isinstance(inst, _Decode):
            self._change_used(inst.free - inst.total)
            inst.free = inst.total
            inst.heap.clear()
            inst.waiting.clear()
            inst.local.clear()
            inst.n_batch = inst.running = inst.ctx_base = 0
        else:
            inst.queue.clear()
            inst.batch = []
            inst.queued_tokens = 0
        retries = []
        for req in victims:
            if req.first_s >= 0:
                self._res_ttft[req.i] = req.first_s - req.arrival
                self._finish_unserved(req, RequestStatus.FAILED)
            else:
                self._abort(req, inst)
                retries.append(req)
        for req in reversed(retries):  # oldest first at the head of the queue
            if req.num_attempts >= self.config.max_attempts:
                self._finish_unserved(req, RequestStatus.FAILED)
            else:
                self._queue.appendleft(req)
        self._drain_queue()

    def _abort(self, req: _Req, failed: _Prefill | _Decode) -> None:
        """End ``req``'s current attempt (before its first token) and free what it holds on
        the instances that did not fail. Its queue entries become stale (attempt mismatch)."""
        was = req.ticket
        self._set_ticket(req, _ABORTED)
        req.ticket = -1
        req.attempt += 1
        dec, pre = req.dec, req.pre
        req.dec = req.pre = None
        if dec is not None and dec is not failed:
            self._change_used(-req.num_blocks)
            dec.free += req.num_blocks
            dec.assigned.discard(req)
            self._update_decode(dec)
            self._maybe_leave(dec)
        if pre is not None and pre is not failed:
            if was in (_OPEN, _PREFILLING):
                pre.queued_tokens -= req.prompt
                self._update_prefill(pre)
            pre.assigned.discard(req)
            self._maybe_leave(pre)

    # -- periodic: scaling and sampling -------------------------------------------------------

    def _on_scale(self, _: None) -> None:
        if not self._in_flight and self._all_arrived():
            return
        from pdserve.capacity.scaling import PoolObservation, ScalingObservation

        interval = self.config.scaling_interval_s
        self._advance(self.now)
        self._rates.append(self._win_arrivals / interval)
        history = self.config.scaling_history
        if len(self._rates) > history:
            del self._rates[: len(self._rates) - history]
        if self._win_arrivals:
            self._last_means = (self._win_prompt / self._win_arrivals,
                                self._win_output / self._win_arrivals)
        prefill_util = self._prefill_busy_s / self._prefill_ready_int if self._prefill_ready_int else 0.0
        decode_util = self._used_int / self._serving_int if self._serving_int else 0.0
        counts = self._counts()
        observation = ScalingObservation(
            now_s=self.now, deployment=self.config.deployment, interval_s=interval,
            arrival_rates_per_s=tuple(self._rates),
            mean_prompt_tokens=self._last_means[0], mean_output_tokens=self._last_means[1],
            prefill=PoolObservation(
                num_ready=counts[0], num_starting=counts[1], num_draining=counts[2],
                utilization=min(1.0, prefill_util),
                num_queued_tokens=sum(p.queued_tokens for p in self._prefills)),
            decode=PoolObservation(
                num_ready=counts[3], num_starting=counts[4], num_draining=counts[5],
                utilization=min(1.0, decode_util),
                num_queued_tokens=sum(r.prompt for r in self._queue)),
            cold_start_s=self.config.cold_start_s,
            slo_attainment=self._win_met / self._win_done if self._win_done else 1.0,
        )
        self._win_arrivals = self._win_prompt = self._win_output = 0
        self._win_done = self._win_met = 0
        self._prefill_busy_s = 0.0
        self._prefill_ready_int = self._used_int = self._serving_int = 0.0
        assert self.policy is not None
        decision = self.policy.decide(observation)
        self._scaling.append(ScalingRecord(self.now, decision.num_prefill, decision.num_decode,
                                           decision.reason))
        self._actuate(WorkerRole.PREFILL, self._prefills, max(0, decision.num_prefill))
        self._actuate(WorkerRole.DECODE, self._decodes, max(0, decision.num_decode))
        if self._queue:
            self._drain_queue()
        self._push(self.now + interval, _EV_SCALE, None)

    def _actuate(self, role: WorkerRole, pool: list[Any], target: int) -> None:
        from pdserve.pool.manager import choose_drain_victims

        live = [inst for inst in pool if inst.state in (_STARTING, _READY)]
        for _ in range(target - len(live)):
            inst = self._launch(role)
            self._push(self.now + self.config.cold_start_s, _EV_READY, (inst, inst.epoch))
        if target < len(live):
            records = [self._record(inst) for inst in live]
            for record in choose_drain_victims(records, len(live) - target):
                self._drain(self._by_id[record.worker_id])

    def _record(self, inst: _Prefill | _Decode) -> WorkerRecord:
        if isinstance(inst, _Decode):
            load = WorkerLoad(num_running_seqs=inst.running, num_free_blocks=inst.free,
                              num_total_blocks=inst.total)
        else:
            load = WorkerLoad(num_queued_prefill_tokens=inst.queued_tokens)
        return WorkerRecord(
            worker_id=inst.wid, deployment=self.config.deployment, role=inst.role,
            state=WorkerState.LOADING if inst.state == _STARTING else WorkerState.READY,
            address="", load=load, registered_s=inst.launched_s)

    def _on_sample(self, _: None) -> None:
        counts = self._counts()
        timeline = self._timeline
        timeline["time_s"].append(self.now)
        for name, value in zip(("prefill_ready", "prefill_starting", "prefill_draining",
                                "decode_ready", "decode_starting", "decode_draining"), counts,
                               strict=True):
            timeline[name].append(value)
        timeline["num_queued"].append(len(self._queue))
        timeline["kv_used_fraction"].append(
            self._used_blocks / self._serving_blocks if self._serving_blocks else 0.0)
        if self._in_flight or not self._all_arrived():
            if self._all_arrived() and all(e[2] in (_EV_SCALE, _EV_SAMPLE) for e in self._heap):
                raise RuntimeError(f"simulation stalled at {self.now:.1f} s: {self._in_flight} "
                                   "requests in flight and nothing scheduled to move them")
            self._push(self.now + self.config.sample_interval_s, _EV_SAMPLE, None)

    def _counts(self) -> tuple[int, int, int, int, int, int]:
        out = []
        for pool in (self._prefills, self._decodes):
            states = [inst.state for inst in pool]
            out += [states.count(_READY), states.count(_STARTING), states.count(_DRAINING)]
        return tuple(out)  # type: ignore[return-value]

    def _all_arrived(self) -> bool:
        n = self.trace.num_requests
        return n == 0 or self.now >= float(self.trace.arrival_s[-1])

    # -- bookkeeping --------------------------------------------------------------------------

    def _change_used(self, num_blocks: int) -> None:
        """Reserve (> 0) or release (< 0) decode blocks, integrating the count over time."""
        now = self.now
        dt = now - self._used_t
        if dt > 0:
            used_s = self._used_blocks * dt
            self._used_int += used_s
            self._used_total_int += used_s
            self._used_t = now
        self._used_blocks += num_blocks

    def _advance(self, now: float) -> None:
        """Integrate the lifecycle counters (instances alive, serving) up to ``now``; they
        change only when an instance launches, becomes ready, drains, leaves or fails."""
        self._change_used(0)
        dt = now - self._last_t
        if dt > 0:
            self._gpu_s += self._num_alive * dt
            self._serving_int += self._serving_blocks * dt
            self._prefill_ready_int += self._num_prefill_ready * dt
            totals = self._totals
            totals[1] += self._serving_blocks * dt
            totals[2] += self._num_prefill_ready * dt
            self._last_t = now

    def _log(self, inst: _Prefill | _Decode, event: str) -> None:
        self._events.append(InstanceEvent(self.now, inst.wid, inst.role.value, event))

    def _result(self, wall_s: float) -> SimResult:
        transitions = {}
        legal = TICKET_TRANSITIONS
        for index, count in enumerate(self._transitions):
            if not count:
                continue
            src = _TICKET_STATES[index // _NUM_TICKET_STATES]
            dst = _TICKET_STATES[index % _NUM_TICKET_STATES]
            if dst not in legal[src]:
                raise IllegalTransitionError(f"simulated ticket moved {src} -> {dst} ({count}x)")
            transitions[(src.value, dst.value)] = count
        unfinished = int(np.count_nonzero(np.frombuffer(self._res_status, dtype=np.int8) < 0))
        if unfinished:
            raise RuntimeError(f"simulation ended with {unfinished} requests unaccounted for")
        trace = self.trace
        res = {name: np.frombuffer(values, dtype=np.float64).copy()
               for name, values in self._res_f.items()}
        res["queue_s"] = res["ttft_s"] - res["compute_s"] - res["transfer_s"]
        serving = [d for d in self._decodes if d.state in (_READY, _DRAINING)]
        return SimResult(
            config=self.config,
            arrival_s=trace.arrival_s, prompt_tokens=trace.prompt_tokens,
            output_tokens=(np.minimum(trace.output_tokens, self.config.max_tokens)
                           if self.config.max_tokens else trace.output_tokens),
            status=np.frombuffer(self._res_status, dtype=np.int8).copy(),
            is_local_prefill=np.frombuffer(self._res_local, dtype=np.int8).astype(bool),
            num_attempts=np.frombuffer(self._res_attempts, dtype=np.int8).copy(),
            decode_instance=np.frombuffer(self._res_dec, dtype=np.int32).copy(),
            prefill_instance=np.frombuffer(self._res_pre, dtype=np.int32).copy(),
            cached_tokens=np.frombuffer(self._res_cached, dtype=np.int64).copy(),
            timeline={name: np.frombuffer(values, dtype=np.float64).copy()
                      for name, values in self._timeline.items()},
            instance_events=tuple(self._events), scaling=tuple(self._scaling),
            ticket_transitions=transitions,
            gpu_hours=self._gpu_s * self.model.tp_size / 3600.0,
            end_s=self.now, num_events=self._num_events,
            num_free_blocks_at_end=sum(d.free for d in serving),
            num_total_blocks_at_end=sum(d.total for d in serving),
            wall_s=wall_s, extra=self._utilisation(), **res)

    def _utilisation(self) -> dict[str, float]:
        _, serving, prefill_ready = self._totals
        used = self._used_total_int
        # Time-integral of running sequences = the sum of each one's time from first token to
        # its end (finish or failure).
        ttft = np.frombuffer(self._res_ttft, dtype=np.float64)
        finish = np.frombuffer(self._res_finish, dtype=np.float64)
        outputs = self.trace.output_tokens
        if self.config.max_tokens:
            outputs = np.minimum(outputs, self.config.max_tokens)
        started = (ttft > 0) & (outputs > 1)
        running = float(np.sum(finish[started] - self.trace.arrival_s[started] - ttft[started]))
        decode_ready_s = serving / self.model.num_blocks if self.model.num_blocks else 0.0
        slots = decode_ready_s * self.config.cluster.max_batch_size
        return {
            "prefill_busy_fraction": self._prefill_busy_total_s / prefill_ready if prefill_ready else 0.0,
            "decode_kv_used_fraction": used / serving if serving else 0.0,
            "decode_batch_slot_fraction": running / slots if slots else 0.0,
            "mean_running_per_decode": running / decode_ready_s if decode_ready_s else 0.0,
            "prefill_busy_s": self._prefill_busy_total_s,
            "decode_instance_s": decode_ready_s,
            "prefill_instance_s": prefill_ready,
        }


def _cached_prefix(lru: OrderedDict[int, None], hashes: list[int]) -> int:
    """Leading ``hashes`` held in ``lru``, by bisection (the LRU is prefix-closed)."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in lru:
            lo = mid
        else:
            hi = mid - 1
    return lo


def simulate(trace: Trace, config: SimConfig, policy: Any | None = None, *,
             instance: InstanceModel | None = None,
             progress: ProgressFn | None = None) -> SimResult:
    """Run one simulation (see ``Simulator``)."""
    return Simulator(trace, config, policy, instance=instance, progress=progress).run()
