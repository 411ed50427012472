"""Discrete-event simulation of one deployment's prefill and decode pools.

Events happen at batch boundaries, never per token: a prefill instance runs one batch of queued
prompts at a time; a decode instance runs continuous-batching steps, each advancing every
sequence in its batch by one token, one event per run of steps (``decode_runs``).

The decisions are the live services' own policy objects:

- routing, local-vs-remote prefill and the KV reservation size: ``pdserve.router.policy.route``
  with the configured ``RoutingConfig``, over candidates built from the simulated instances'
  state (free blocks, running sequences, queued prefill tokens, prefix-cache overlap), passed as
  a ``Shortlist`` of the candidates no other dominates;
- ticket states: every move is counted and checked against ``TICKET_TRANSITIONS``;
- scaling: any ``ScalingPolicy``, asked every ``scaling_interval_s`` with a
  ``ScalingObservation``; instances it adds serve after ``cold_start_s``; instances it removes
  are chosen by ``pdserve.pool.manager.choose_drain_victims`` and drain (finish their work, take
  no new work, then leave).

The replay loop takes requests from an arrival source (``TraceArrivals``) and runs every event
due before each arrival; admission is the live router's policy (``SimConfig.admission``:
``pdserve.router.admission``, called through ``LiveAdmission``; no room on any decode instance
refuses at once, as live) or, without it, the simulator's own queue (``AdmissionQueue``).
Failures: an instance that fails loses its work; requests it held before their first token are
retried (a new attempt, up to ``max_attempts``) on the remaining instances, requests past their
first token fail. Local prefill runs on the decode instance as a step of its own, between decode
steps (the batch stalls for it), alternating with decode steps while both have work; with
chunked prefill (``ClusterSpec.chunked_prefill_tokens``) every step while prompts wait is one
decode step that also carries prompt chunks (``InstanceModel.mixed_step_s``). A colocated
deployment is decode instances only, with chunked prefill: the same engine model as the
disaggregated instances.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any

from pdserve.capacity.scaling import ScalingPolicy
from pdserve.common.errors import CapacityError, UnavailableError
from pdserve.common.types import WorkerRole
from pdserve.pool.manager import choose_drain_victims
from pdserve.router.policy import route
from pdserve.sim.admission import AdmissionQueue
from pdserve.sim.arrivals import TraceArrivals
from pdserve.sim.config import SimConfig
from pdserve.sim.decode_runs import (
    DecodeTiming,
    cut_run,
    finish_run,
    join_waiting,
    start_run,
    take_chunks,
    take_local_batch,
)
from pdserve.sim.engine_model import InstanceModel, instance_model
from pdserve.sim.fleet import Fleet
from pdserve.sim.live_admission import LiveAdmission
from pdserve.sim.observation import ScalingWindow
from pdserve.sim.recorder import Recorder
from pdserve.sim.result import RequestStatus, ScalingRecord, SimResult
from pdserve.sim.shortlist import MAX_FREE_BLOCKS
from pdserve.sim.state import (
    ABORTED,
    DONE,
    DRAINING,
    FAILED,
    GONE,
    OPEN,
    PREFILLING,
    READY,
    STARTING,
    STEP_DECODE,
    STEP_LOCAL,
    STEP_MIXED,
    TRANSFERRING,
    AnyInstance,
    DecodeInstance,
    PrefillInstance,
    SimRequest,
)
from pdserve.sim.traces import Trace
from pdserve.sim.usage import Usage

ProgressFn = Callable[[int, int, float], None]
"""``progress(num_arrived, num_requests, sim_time_s)``, called every few thousand arrivals."""

# Event kinds (indices into Simulator._handlers).
EV_PREFILL_DONE, EV_KV_LANDED, EV_DECODE_STEP, EV_READY, EV_FAIL, EV_SCALE, EV_SAMPLE = range(7)
_NO_CHUNKS: tuple[list[int], list[int]] = ([], [])
"""A prompt without prefix hashes (``Trace.prefix_chunks``)."""
_CHUNK_BATCH = 2048
_CHUNK_BATCHES_KEPT = 8



class Simulator:
    """One run: ``Simulator(trace, config, policy).run()`` -> ``SimResult``.

    ``policy`` is any ``ScalingPolicy`` (None: the pools keep their size). ``instance``
    overrides the catalog-derived instance model (tests; of both pools unless
    ``ClusterSpec.prefill_tp_size`` differs from ``tp_size``, when prefill instances get the
    catalog's model at their TP). ``model`` is the decode instances' model (their KV, decode
    steps and local prefills), ``prefill_model`` the prefill instances' (prefill batches, the KV
    transfer from their NICs, their prefix cache's size).
    """

    def __init__(self, trace: Trace, config: SimConfig, policy: ScalingPolicy | None = None, *,
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
        self.prefill_model = self.model if cluster.prefill_tp == cluster.tp_size else (
            instance_model(cluster.model, cluster.gpu, cluster.prefill_tp,
                           block_size_tokens=cluster.block_size_tokens,
                           gpu_memory_utilization=cluster.gpu_memory_utilization))
        if self.model.num_blocks > MAX_FREE_BLOCKS:
            raise CapacityError(
                f"instances with over {MAX_FREE_BLOCKS} KV blocks are not supported")
        self._block_size = self.model.block_size_tokens
        # Hot path: bound once.
        self._prefill_s = self.prefill_model.perf.prefill_time_s
        self._local_prefill_s = self.model.perf.prefill_time_s
        self._timing = DecodeTiming(self.model)
        self._chunk_budget = cluster.chunked_prefill_tokens
        self._prefix_cache_blocks = cluster.prefix_cache_blocks or self.prefill_model.num_blocks
        self._has_hashes = trace.has_prefix_hashes
        self._chunk_batches: dict[int, list[tuple[list[int], list[int]]]] = {}
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._num_events = 0
        self._in_flight = 0
        self._blocks_freed = False
        self._arrivals = TraceArrivals(trace, config.routing, self._block_size, config.max_tokens)
        self._live = None if config.admission is None else LiveAdmission(
            config.admission, cluster, trace.tenant)
        self._admission = AdmissionQueue(
            0 if self._live is not None else config.max_queued_requests, self._try_route)
        self._usage = usage = Usage()
        self._recorder = recorder = Recorder(trace, config, self.model)
        self._window = ScalingWindow(config)
        self._fleet = fleet = Fleet(config, self.model, usage, recorder)
        self._shortlist = shortlist = fleet.shortlist
        self._by_id = fleet.by_id
        # Hot-path calls, bound once (several per request).
        self._move_ticket = recorder.move_ticket
        self._change_used = usage.change_used
        self._update_decode = shortlist.update_decode
        self._update_prefill = shortlist.update_prefill
        self._maybe_leave = fleet.maybe_leave
        self._handlers: list[Callable[[Any], None]] = [
            self._on_prefill_done, self._on_kv_landed, self._on_decode_step, self._on_ready,
            self._on_fail, self._on_scale, self._on_sample]

    # -- the replay loop ----------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        cpu_started = time.process_time()
        cluster, fleet = self.config.cluster, self._fleet
        for _ in range(cluster.num_prefill):
            fleet.make_ready(fleet.launch(WorkerRole.PREFILL, self.now), self.now)
        for _ in range(cluster.num_decode):
            fleet.make_ready(fleet.launch(WorkerRole.DECODE, self.now), self.now)
        self._blocks_freed = bool(cluster.num_decode)  # room appeared, as when any turns ready
        for failure in self.config.failures:
            self._push(failure.time_s, EV_FAIL, failure.instance_id)
        if self.policy is not None:
            self._push(self.config.scaling_interval_s, EV_SCALE, None)
        self._push(0.0, EV_SAMPLE, None)
        self._replay()
        self._usage.advance(self.now)
        result = self._recorder.result(self._usage, fleet.serving_decodes(), self.now,
                                       self._num_events, time.perf_counter() - started)
        result.extra["cpu_s"] = time.process_time() - cpu_started
        if self._live is not None:
            for outcome, count in self._live.outcomes.items():
                result.extra[f"admission_{outcome}"] = count
            result.shed.update((i, str(outcome)) for i, outcome in self._live.shed.items())
        return result

    def _replay(self) -> None:
        """Every arrival in order, each after the events due before it; then the events that
        finish what is in flight."""
        arrivals = self._arrivals
        num_requests = arrivals.num_requests
        arrive, request, run_events = self._arrive, arrivals.request, self._run_events
        heap = self._heap
        for start, arrival_s, prompts, outputs in arrivals.chunks():
            for j, arrival in enumerate(arrival_s):
                if heap and heap[0][0] <= arrival:
                    run_events(arrival)
                self.now = arrival
                arrive(request(start + j, arrival, prompts[j], outputs[j]))
            if self.progress is not None:
                self.progress(start + len(arrival_s), num_requests, self.now)
        self._run_events(None)
        self._num_events += num_requests

    def _run_events(self, until_s: float | None) -> None:
        """Handle the events due at or before ``until_s`` (None: until nothing is in flight),
        retrying the admission queue whenever one freed KV blocks."""
        heap = self._heap
        pop = heapq.heappop
        handlers = self._handlers
        num_events = 0
        while heap and (heap[0][0] <= until_s if until_s is not None else self._in_flight):
            t, _, kind, payload = pop(heap)
            self.now = t
            handlers[kind](payload)
            num_events += 1
            if self._blocks_freed:
                self._blocks_freed = False
                if self._admission.waiting:
                    self._drain_queue()
        self._num_events += num_events

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    # -- arrivals, routing, admission ---------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        self._in_flight += 1
        self._window.arrived(req)
        if req.num_blocks > self.model.num_blocks or not self._shortlist.has_ready_decode:
            # Can never fit anywhere, or no decode instance is ready (the live router answers
            # UNAVAILABLE then): refused at once.
            self._finish_unserved(req, RequestStatus.REJECTED)
        elif not self._admission.admit(req):
            self._finish_unserved(req, RequestStatus.REJECTED)

    def _drain_queue(self) -> None:
        admission = self._admission
        admission.drain()
        if admission.waiting and not self._fleet.has_live_decode():
            # No decode instance will ever have room: refuse what waits (a retry that cannot
            # be placed has failed).
            for req in admission.take_all():
                self._finish_unserved(req, RequestStatus.FAILED if req.num_attempts
                                      else RequestStatus.REJECTED)

    def _try_route(self, req: SimRequest) -> bool:
        """Route ``req`` with the live policy and dispatch it; False if no decode has room."""
        shortlist = self._shortlist
        decodes = shortlist.decode_candidates(req.num_blocks)
        if not decodes:
            return False
        if self._live is not None:
            self._live.meet(self._fleet.prefills, req, self.now)
        overlap: dict[int, int] = {}
        if self._has_hashes and self._fleet.prefills:
            overlap = self._overlaps(req)
        try:
            decision = route(req.route_request, decodes, shortlist.prefill_candidates(overlap),
                             self.config.routing)
        except (CapacityError, UnavailableError):
            return False
        dec = self._by_id[decision.decode_worker_id]
        assert isinstance(dec, DecodeInstance)
        pre = self._by_id[decision.prefill_worker_id] if decision.prefill_worker_id else None
        live = self._live
        if live is not None:
            prefiller = pre or dec
            if req.num_attempts == 0 and not live.admit(req, prefiller, self.now):
                self._finish_unserved(req, RequestStatus.REJECTED)
                return True  # shed: handled, not waiting
            live.dispatched(req, prefiller, self.now)
        num_blocks = decision.num_blocks
        req.num_blocks = num_blocks
        req.num_attempts += 1
        req.routed_s = self.now
        req.dec = dec
        req.ticket = OPEN  # a new ticket: no transition to count
        self._change_used(self.now, num_blocks)
        dec.free -= num_blocks
        dec.assigned.add(req)
        self._update_decode(dec)
        if pre is not None:
            assert isinstance(pre, PrefillInstance)
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

    def _chunks(self, req: SimRequest) -> tuple[list[int], list[int]]:
        """``req``'s prompt by trace block (``Trace.prefix_chunks``), computed for a batch of
        trace rows at a time; the last few batches are kept (a request that waited for room
        asks after later arrivals have)."""
        if req.chunks is None:
            key = req.i // _CHUNK_BATCH
            batch = self._chunk_batches.get(key)
            if batch is None:
                if len(self._chunk_batches) >= _CHUNK_BATCHES_KEPT:
                    del self._chunk_batches[next(iter(self._chunk_batches))]
                start = key * _CHUNK_BATCH
                batch = self._chunk_batches[key] = self.trace.prefix_chunk_batch(
                    start, min(start + _CHUNK_BATCH, self.trace.num_requests),
                    self._block_size)
            req.chunks = batch[req.i - key * _CHUNK_BATCH]
        return req.chunks

    def _overlaps(self, req: SimRequest) -> dict[int, int]:
        """Leading engine blocks of ``req``'s prompt each ready prefill instance's prefix cache
        holds, by instance number (only those > 0)."""
        chunks, counts = self._chunks(req)
        found: dict[int, int] = {}
        if not chunks:
            return found
        first = chunks[0]
        for pre in self._fleet.prefills:
            if pre.state == READY and pre.cache.holds(first):
                found[pre.idx] = pre.cache.cached_blocks(chunks, counts)
        return found

    # -- prefill instances --------------------------------------------------------------------

    def _start_prefill(self, pre: PrefillInstance) -> None:
        queue = pre.queue
        budget = self.config.cluster.prefill_batch_tokens
        batch: list[tuple[SimRequest, int]] = []
        lengths: list[int] = []
        total = 0
        move_ticket = self._move_ticket
        while queue:
            req, attempt = queue[0]
            if req.attempt != attempt:
                queue.popleft()
                continue
            chunks, counts = self._chunks(req) if self._has_hashes else _NO_CHUNKS
            cached = 0
            if chunks:
                cached = min(pre.cache.cached_blocks(chunks, counts) * self._block_size,
                             req.prompt - 1)
            uncached = req.prompt - cached
            if batch and total + uncached > budget:
                break
            queue.popleft()
            if chunks:
                pre.cache.touch(chunks, counts, self._prefix_cache_blocks)
            req.cached = cached
            move_ticket(req, PREFILLING)
            batch.append((req, attempt))
            lengths.append(uncached)
            total += uncached
        if not batch:
            pre.busy = False
            self._maybe_leave(pre, self.now)
            return
        duration = self._prefill_s(lengths)
        self._usage.add_prefill_busy(duration)
        pre.batch = batch
        pre.busy = True
        self._push(self.now + duration, EV_PREFILL_DONE, (pre, pre.epoch, duration))

    def _on_prefill_done(self, payload: tuple[PrefillInstance, int, float]) -> None:
        pre, epoch, duration = payload
        if pre.epoch != epoch:
            return
        landing = []
        num_tokens = 0
        for req, attempt in pre.batch:
            if req.attempt != attempt:
                continue
            self._move_ticket(req, TRANSFERRING)
            if self._live is not None:
                self._live.prefill_done(req, self.now)
            pre.queued_tokens -= req.prompt
            req.compute_s = duration
            num_tokens += req.prompt
            landing.append((req, attempt))
        pre.batch = []
        self._update_prefill(pre)
        if landing:
            exposed = self.prefill_model.exposed_transfer_s(num_tokens, duration)
            for req, _ in landing:
                req.transfer_s = exposed
            self._push(self.now + exposed, EV_KV_LANDED, landing)
        pre.busy = False
        if pre.queue:
            self._start_prefill(pre)
        else:
            self._maybe_leave(pre, self.now)

    def _on_kv_landed(self, landing: list[tuple[SimRequest, int]]) -> None:
        for req, attempt in landing:
            if req.attempt != attempt:
                continue
            self._move_ticket(req, DONE)
            pre = req.pre
            assert pre is not None
            pre.assigned.discard(req)
            self._first_token(req)
            if pre.state == DRAINING:
                self._maybe_leave(pre, self.now)

    # -- decode instances ---------------------------------------------------------------------

    def _first_token(self, req: SimRequest) -> None:
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

    def _on_decode_step(self, payload: tuple[DecodeInstance, int]) -> None:
        dec, epoch = payload
        if dec.epoch != epoch:
            return
        # dec stays busy while this step's results are applied: joins and leaving happen in
        # _next_step, once.
        if dec.step_kind == STEP_MIXED:
            finished = finish_run(dec)  # the step's decode tokens, then its completed prompts
            self._local_first_tokens(dec)
            for req in finished:
                self._finish(req, dec)
        elif dec.step_kind == STEP_LOCAL:
            self._local_first_tokens(dec)
        else:
            for req in finish_run(dec):
                self._finish(req, dec)
        dec.busy = False
        self._next_step(dec)

    def _local_first_tokens(self, dec: DecodeInstance) -> None:
        """The prompts whose local prefill the step that just ended completed: first tokens."""
        batch, dec.local_batch = dec.local_batch, []
        for req, attempt in batch:
            if req.attempt == attempt:
                self._move_ticket(req, DONE)
                if self._live is not None:
                    self._live.prefill_done(req, self.now)
                req.compute_s = (dec.step_s if dec.step_kind == STEP_LOCAL
                                 else self.now - req.routed_s)
                req.transfer_s = 0.0
                self._first_token(req)

    def _next_step(self, dec: DecodeInstance) -> None:
        """At a step boundary of an idle ``dec``: start a local prefill step, a chunked-prefill
        step or a decode run."""
        local = dec.local
        while local and local[0][0].attempt != local[0][1]:
            local.popleft()
        if local and self._chunk_budget and self._start_mixed(dec):
            return
        if local and not self._chunk_budget and (
                dec.step_kind == STEP_DECODE or not (dec.n_batch or dec.waiting)):
            batch, lengths = take_local_batch(
                dec, self.config.cluster.prefill_batch_tokens)
            duration = self._local_prefill_s(lengths)
            dec.local_batch = batch
            dec.step_kind = STEP_LOCAL
            dec.step_s = duration
            dec.busy = True
            dec.run_steps = 1
            self._push(self.now + duration, EV_DECODE_STEP, (dec, dec.epoch))
            return
        max_batch_size = self.config.cluster.max_batch_size
        if dec.waiting and dec.n_batch < max_batch_size:
            join_waiting(dec, max_batch_size, self.now)
        if dec.n_batch:
            self._start_run(dec)
        else:
            dec.step_kind = STEP_DECODE
            self._maybe_leave(dec, self.now)

    def _start_mixed(self, dec: DecodeInstance) -> bool:
        """One decode step of the batch (waiting sequences joined first) carrying prompt chunks
        up to the token budget; False, and nothing started, if the batch fills the budget (the
        prompts wait for sequences to finish)."""
        max_batch_size = self.config.cluster.max_batch_size
        if dec.waiting and dec.n_batch < max_batch_size:
            join_waiting(dec, max_batch_size, self.now)
        n = dec.n_batch
        room = self._chunk_budget - n
        if room < 1:
            return False
        chunks, dec.local_batch = take_chunks(dec, room)
        duration = self.model.mixed_step_s(n, dec.ctx_base + n * dec.steps, chunks)
        dec.step_kind = STEP_MIXED
        dec.step_s = duration
        dec.busy = True
        dec.run_steps = 1
        self._push(self.now + duration, EV_DECODE_STEP, (dec, dec.epoch))
        return True

    def _start_run(self, dec: DecodeInstance) -> None:
        """Decode steps until the batch's next completion, as one event (``start_run``)."""
        end_s = start_run(dec, self.now, self._timing)
        self._push(end_s, EV_DECODE_STEP, (dec, dec.epoch))

    def _cut_run(self, dec: DecodeInstance) -> None:
        """End ``dec``'s decode run at the first step boundary at or after now."""
        end_s = cut_run(dec, self.now)
        if end_s is not None:
            self._push(end_s, EV_DECODE_STEP, (dec, dec.epoch))

    # -- request ends -------------------------------------------------------------------------

    def _finish(self, req: SimRequest, dec: DecodeInstance) -> None:
        """``req`` produced its last token on ``dec``: record it and free its blocks."""
        now = self.now
        self._change_used(now, -req.num_blocks)
        dec.free += req.num_blocks
        if req.output > 1:
            dec.running -= 1
        dec.assigned.discard(req)
        self._update_decode(dec)
        self._blocks_freed = True
        ttft, tpot = self._recorder.completed(req, dec, now)
        if self._live is not None:
            self._live.finish(req)
        self._in_flight -= 1
        self._window.completed(ttft, tpot)
        if dec.state == DRAINING:
            self._maybe_leave(dec, now)

    def _finish_unserved(self, req: SimRequest, status: RequestStatus) -> None:
        self._recorder.unserved(req, status, self.now)
        if self._live is not None:
            self._live.finish(req)
        self._in_flight -= 1
        self._window.unserved()

    # -- failures -----------------------------------------------------------------------------

    def _on_ready(self, payload: tuple[AnyInstance, int]) -> None:
        inst, epoch = payload
        if inst.epoch == epoch and inst.state == STARTING:
            self._fleet.make_ready(inst, self.now)
            if isinstance(inst, DecodeInstance):
                self._blocks_freed = True  # new room for the admission queue

    def _on_fail(self, instance_id: str) -> None:
        inst = self._fleet.by_id.get(instance_id)
        if inst is None or inst.state in (GONE, FAILED):
            return
        self._fleet.fail(inst, self.now)
        victims = sorted(inst.assigned, key=lambda r: r.i)
        inst.assigned.clear()
        if isinstance(inst, DecodeInstance):
            self._change_used(self.now, inst.free - inst.total)
        inst.lose_work()
        retries = []
        for req in victims:
            if req.first_s >= 0:  # past its first token: the stream breaks
                self._finish_unserved(req, RequestStatus.FAILED)
                continue
            self._abort(req, inst)
            if req.num_attempts < self.config.max_attempts:
                retries.append(req)
            else:
                self._finish_unserved(req, RequestStatus.FAILED)
        self._admission.retry_first(retries)
        self._drain_queue()

    def _abort(self, req: SimRequest, failed: AnyInstance) -> None:
        """End ``req``'s current attempt (before its first token) and free what it holds on
        the instances that did not fail. Its queue entries become stale (attempt mismatch)."""
        was = req.ticket
        self._move_ticket(req, ABORTED)
        if self._live is not None:
            self._live.prefill_done(req, self.now, is_ok=False)
        req.ticket = -1
        req.attempt += 1
        req.prefilled = 0
        dec, pre = req.dec, req.pre
        req.dec = req.pre = None
        if dec is not None and dec is not failed:
            self._change_used(self.now, -req.num_blocks)
            dec.free += req.num_blocks
            dec.assigned.discard(req)
            self._update_decode(dec)
            self._maybe_leave(dec, self.now)
        if pre is not None and pre is not failed:
            if was in (OPEN, PREFILLING):
                pre.queued_tokens -= req.prompt
                self._update_prefill(pre)
            pre.assigned.discard(req)
            self._maybe_leave(pre, self.now)

    # -- periodic: scaling and sampling -------------------------------------------------------

    def _on_scale(self, _: None) -> None:
        if not self._in_flight and self._all_arrived():
            return
        fleet = self._fleet
        self._usage.advance(self.now)
        queued = (sum(p.queued_tokens for p in fleet.prefills),
                  self._admission.queued_prompt_tokens())
        observation = self._window.observe(self.now, fleet.counts(), self._usage, queued)
        assert self.policy is not None
        decision = self.policy.decide(observation)
        self._recorder.scaled(ScalingRecord(self.now, decision.num_prefill, decision.num_decode,
                                            decision.reason))
        self._actuate(WorkerRole.PREFILL, max(0, decision.num_prefill))
        self._actuate(WorkerRole.DECODE, max(0, decision.num_decode))
        if self._admission.waiting:
            self._drain_queue()
        self._push(self.now + self.config.scaling_interval_s, EV_SCALE, None)

    def _actuate(self, role: WorkerRole, target: int) -> None:
        fleet = self._fleet
        pool: list[PrefillInstance] | list[DecodeInstance] = (
            fleet.prefills if role is WorkerRole.PREFILL else fleet.decodes)
        live: list[AnyInstance] = [inst for inst in pool if inst.state in (STARTING, READY)]
        for _ in range(target - len(live)):
            inst = fleet.launch(role, self.now)
            self._push(self.now + self.config.cold_start_s, EV_READY, (inst, inst.epoch))
        if target < len(live):
            records = [inst.record(self.config.deployment) for inst in live]
            for record in choose_drain_victims(records, len(live) - target):
                fleet.drain(fleet.by_id[record.worker_id], self.now)

    def _on_sample(self, _: None) -> None:
        usage = self._usage
        kv_used = usage.used_blocks / usage.serving_blocks if usage.serving_blocks else 0.0
        self._recorder.sample(self.now, self._fleet.counts(), len(self._admission), kv_used)
        if self._in_flight or not self._all_arrived():
            if self._all_arrived() and all(e[2] in (EV_SCALE, EV_SAMPLE) for e in self._heap):
                raise RuntimeError(f"simulation stalled at {self.now:.1f} s: {self._in_flight} "
                                   "requests in flight and nothing scheduled to move them")
            self._push(self.now + self.config.sample_interval_s, EV_SAMPLE, None)

    def _all_arrived(self) -> bool:
        return self.now >= self._arrivals.last_arrival_s


def simulate(trace: Trace, config: SimConfig, policy: ScalingPolicy | None = None, *,
             instance: InstanceModel | None = None,
             progress: ProgressFn | None = None) -> SimResult:
    """Run one simulation (see ``Simulator``)."""
    return Simulator(trace, config, policy, instance=instance, progress=progress).run()
