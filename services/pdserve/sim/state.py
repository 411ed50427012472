"""The simulator's mutable state: requests in flight and the prefill and decode instances they
run on.

Hot-path objects: ``__slots__`` classes rather than dataclasses, fields read and written in
place by the event handlers (``Simulator``), and small ints for ticket states. Times are
simulated seconds.
"""

from __future__ import annotations

import enum
from collections import deque

from pdserve.common.types import TicketState, WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.router.policy import DecodeCandidate, PrefillCandidate, RouteRequest
from pdserve.sim.prefix_cache import PrefixCache


class InstanceState(enum.IntEnum):
    """An instance's lifecycle: launched (``STARTING``, cold start), ``READY``, ``DRAINING``
    (finishing its work, taking none), then ``GONE``, or ``FAILED`` at any point."""

    STARTING = 0
    READY = 1
    DRAINING = 2
    GONE = 3
    FAILED = 4


STARTING, READY, DRAINING, GONE, FAILED = InstanceState
"""The states by name (the event handlers compare them on every step)."""


class StepKind(enum.IntEnum):
    """What a decode instance's step in flight is: a run of decode steps, a local prefill, or
    one decode step carrying prompt chunks (chunked prefill)."""

    DECODE = 0
    LOCAL = 1
    MIXED = 2


STEP_DECODE, STEP_LOCAL, STEP_MIXED = StepKind

TICKET_STATES = tuple(TicketState)
"""Ticket states by index: a request's ``ticket`` is an index into this (-1: no ticket), and
``Recorder`` counts moves in a ``len x len`` matrix of indices."""
NUM_TICKET_STATES = len(TICKET_STATES)
OPEN, PREFILLING, TRANSFERRING, DONE, ABORTED = (
    TICKET_STATES.index(s) for s in (TicketState.OPEN, TicketState.PREFILLING,
                                     TicketState.TRANSFERRING, TicketState.DONE,
                                     TicketState.ABORTED))


class SimRequest:
    """A request in flight (freed when it finishes).

    ``i`` is its row in the trace; ``attempt`` counts routing attempts ended by a failure (a
    queue entry tagged with an older attempt is stale); ``dec``/``pre`` the instances of the
    current attempt (``pre`` None: local prefill on ``dec``). ``first_s`` is the first token's
    time (-1 before it); ``join_step``/``join_s`` when it joined its decode batch;
    ``prefilled`` how many of its prompt tokens a chunked local prefill has computed.
    """

    __slots__ = (
        "arrival",
        "attempt",
        "cached",
        "chunks",
        "compute_s",
        "dec",
        "first_s",
        "i",
        "is_local",
        "join_s",
        "join_step",
        "num_attempts",
        "num_blocks",
        "output",
        "pre",
        "prefilled",
        "prompt",
        "route_request",
        "routed_s",
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
        self.dec: DecodeInstance | None = None
        self.pre: PrefillInstance | None = None
        self.ticket = -1
        self.compute_s = 0.0
        self.transfer_s = 0.0
        self.first_s = -1.0
        self.routed_s = arrival
        self.join_step = 0
        self.join_s = 0.0
        self.is_local = False
        self.cached = 0
        self.prefilled = 0
        self.chunks: tuple[list[int], list[int]] | None = None
        """Its prompt's trace blocks (``Trace.prefix_chunks``), once asked for."""


class Instance:
    """What every simulated instance has: ``idx`` (its number in its pool, ``wid`` = ``p<idx>``
    or ``d<idx>``), ``rank`` (its place by worker id) and ``key`` (its shortlist key, -1 when
    not ready; see ``Shortlist``), lifecycle ``state`` and ``epoch`` (bumped to void the events
    in flight for it), whether a batch or step is ``busy``, and the requests ``assigned``."""

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
        self.state = STARTING
        self.epoch = 0
        self.busy = False
        self.assigned: set[SimRequest] = set()
        self.launched_s = now

    def load(self) -> WorkerLoad:
        """What the instance would report in a heartbeat (the pool manager's view)."""
        raise NotImplementedError

    def record(self, deployment: str) -> WorkerRecord:
        """The instance as the pool manager's worker record (for ``choose_drain_victims``)."""
        return WorkerRecord(
            worker_id=self.wid, deployment=deployment, role=self.role,
            state=WorkerState.LOADING if self.state == STARTING else WorkerState.READY,
            address="", load=self.load(), registered_s=self.launched_s)


class PrefillInstance(Instance):
    """A prefill instance: its FCFS ``queue`` of ``(request, attempt)`` (``queued_tokens`` their
    prompt tokens, the running batch's included until it ends), the ``batch`` running, its prefix
    ``cache`` (see ``prefix_cache``) and its cached candidate."""

    __slots__ = ("batch", "cache", "candidate", "queue", "queued_tokens")

    def __init__(self, idx: int, now: float) -> None:
        super().__init__(idx, f"p{idx}", WorkerRole.PREFILL, now)
        self.queue: deque[tuple[SimRequest, int]] = deque()
        self.queued_tokens = 0
        self.batch: list[tuple[SimRequest, int]] = []
        self.cache = PrefixCache()
        self.candidate: PrefillCandidate | None = None

    def load(self) -> WorkerLoad:
        return WorkerLoad(num_queued_prefill_tokens=self.queued_tokens)

    def lose_work(self) -> None:
        """A failure: everything queued or running is gone."""
        self.queue.clear()
        self.batch = []
        self.queued_tokens = 0


class DecodeInstance(Instance):
    """A decode instance: KV blocks ``free`` of ``total``, ``running`` sequences (past their
    first token), and its continuous batch (``decode_runs``): ``heap`` of ``(finishing step,
    trace row, request)`` for the ``n_batch`` sequences in the batch, ``ctx_base`` so that the
    batch reads ``ctx_base + n_batch x steps`` context tokens at step ``steps``, sequences
    ``waiting`` for a batch slot, prompts queued for ``local`` prefill and the ``local_batch``
    running. The step in flight is ``step_kind`` (decode run or local prefill, ``step_s`` long
    for the latter); a decode run is ``run_steps`` steps from ``run_start``, step ``i`` lasting
    ``run_first_s + i x run_delta_s``."""

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
        self.heap: list[tuple[int, int, SimRequest]] = []
        self.n_batch = 0
        self.ctx_base = 0
        self.steps = 0
        self.waiting: deque[SimRequest] = deque()
        self.local: deque[tuple[SimRequest, int]] = deque()
        self.step_kind = STEP_DECODE
        self.step_s = 0.0
        self.local_batch: list[tuple[SimRequest, int]] = []
        self.candidate: DecodeCandidate | None = None
        self.run_steps = 0
        self.run_start = 0.0
        self.run_first_s = 0.0
        self.run_delta_s = 0.0

    def load(self) -> WorkerLoad:
        return WorkerLoad(num_running_seqs=self.running, num_free_blocks=self.free,
                          num_total_blocks=self.total)

    def lose_work(self) -> None:
        """A failure: its batch, waiting sequences and local prefills are gone, its blocks
        free (the caller accounts for the blocks in use)."""
        self.free = self.total
        self.heap.clear()
        self.waiting.clear()
        self.local.clear()
        self.n_batch = self.running = self.ctx_base = 0


AnyInstance = PrefillInstance | DecodeInstance
"""An instance of either pool."""
