"""What this router has in flight on each worker, in one place.

A worker's heartbeat is up to a period old, so between two reports the router alone knows what
it has just sent there. Two readers need that knowledge:

* admission (``router.prediction``) predicts a request's TTFT from the prefill work queued on
  the worker that would prefill it: the prefills this router booked there, oldest first (the
  worker serves them first come first served);
* routing (``router.policy``) scores decode workers by memory and batch pressure: the KV blocks
  this router's tickets reserved there and the requests it has decoding there.

Both read the one ``InFlightLedger`` the router holds. Its writers, one per kind of entry:

==============================  =================================  ==========================
entry                           booked                             ended
==============================  =================================  ==========================
prefill (tokens, since when)    ``book_prefill``: at admission,    ``end_prefill``: the
                                on the worker predicted against;   prefill finished, failed
                                again at dispatch, on the worker   or was cancelled (returns
                                it was sent to (a retry may move   the job, whose timing
                                it)                                teaches the rate)
decode (blocks, one sequence)   ``reserve_blocks``: the ticket is  ``release_blocks``: the
                                open                               attempt ended, any outcome
==============================  =================================  ==========================

A prefill entry is keyed by its request id (a request has one prefill at a time: a new booking
replaces the old one), a decode entry by its ticket id (a UUID, never reused: an attempt that
ends late cannot release a later attempt's or request's blocks). Either way an entry is counted
once and freed once. Not thread-safe; one event loop uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """A prefill this router booked on a worker."""

    worker_id: str
    num_tokens: int
    """The prompt's tokens, >= 1 (whole prompts: the unit workers report their queues in)."""
    booked_s: float
    """When it was booked (admission) or sent (dispatch), on the caller's monotonic clock."""


@dataclass(frozen=True, slots=True)
class WorkerInFlight:
    """This router's work on one worker that its last heartbeat may not show yet."""

    num_prefill_tokens: int = 0
    """Tokens of the prefills booked there."""
    head_prefill: PrefillJob | None = None
    """The oldest of them: the one the worker is working on, if it has reached this router's."""
    num_reserved_blocks: int = 0
    """KV blocks this router's open tickets reserved there (decode workers)."""
    num_seqs: int = 0
    """Requests this router has decoding there, or about to (one per open ticket)."""


@dataclass(slots=True)
class _Worker:
    prefill_jobs: dict[str, PrefillJob] = field(default_factory=dict)
    """Request id -> its prefill, in booking order."""
    num_prefill_tokens: int = 0
    blocks: dict[str, int] = field(default_factory=dict)
    """Ticket id -> KV blocks it reserved."""
    num_reserved_blocks: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.prefill_jobs and not self.blocks


class InFlightLedger:
    """Per worker, this router's prefills and decode reservations in flight (module docstring)."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._prefill_worker: dict[str, str] = {}
        """Request id -> the worker holding its prefill."""
        self._decode_worker: dict[str, str] = {}
        """Ticket id -> the worker holding its blocks."""

    # -- reads --------------------------------------------------------------------------------

    def on(self, worker_id: str) -> WorkerInFlight:
        """What this router has in flight on ``worker_id`` now (zeros for a worker it never
        used)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return WorkerInFlight()
        return WorkerInFlight(
            num_prefill_tokens=worker.num_prefill_tokens,
            head_prefill=next(iter(worker.prefill_jobs.values()), None),
            num_reserved_blocks=worker.num_reserved_blocks,
            num_seqs=len(worker.blocks),
        )

    # -- prefills -----------------------------------------------------------------------------

    def book_prefill(self, request_id: str, worker_id: str, num_tokens: int, now_s: float) -> None:
        """The request's prefill counts on ``worker_id`` from ``now_s``, behind the prefills
        booked there before it. A prefill the request had booked elsewhere is ended first."""
        self.end_prefill(request_id)
        worker = self._workers.setdefault(worker_id, _Worker())
        worker.prefill_jobs[request_id] = PrefillJob(worker_id, num_tokens, now_s)
        worker.num_prefill_tokens += num_tokens
        self._prefill_worker[request_id] = worker_id

    def end_prefill(self, request_id: str) -> PrefillJob | None:
        """The request's prefill no longer counts (it finished, failed or moved); the job, or
        None if it had none booked."""
        worker_id = self._prefill_worker.pop(request_id, None)
        if worker_id is None:
            return None
        worker = self._workers[worker_id]
        job = worker.prefill_jobs.pop(request_id)
        worker.num_prefill_tokens -= job.num_tokens
        self._drop_if_empty(worker_id, worker)
        return job

    # -- decode reservations ------------------------------------------------------------------

    def reserve_blocks(self, ticket_id: str, worker_id: str, num_blocks: int) -> None:
        """Ticket ``ticket_id`` reserved ``num_blocks`` on decode worker ``worker_id``: they and
        one sequence count there until ``release_blocks``."""
        self.release_blocks(ticket_id)
        worker = self._workers.setdefault(worker_id, _Worker())
        worker.blocks[ticket_id] = num_blocks
        worker.num_reserved_blocks += num_blocks
        self._decode_worker[ticket_id] = worker_id

    def release_blocks(self, ticket_id: str) -> None:
        """The ticket's attempt ended (its sequence finished, or the ticket was aborted): its
        blocks and sequence stop counting here; what the worker still holds, its reports show.
        Releasing a ticket twice, or one never reserved, changes nothing."""
        worker_id = self._decode_worker.pop(ticket_id, None)
        if worker_id is None:
            return
        worker = self._workers[worker_id]
        worker.num_reserved_blocks -= worker.blocks.pop(ticket_id)
        self._drop_if_empty(worker_id, worker)

    def _drop_if_empty(self, worker_id: str, worker: _Worker) -> None:
        if worker.is_empty:
            del self._workers[worker_id]
