"""TTFT prediction, pure and synchronous: what admission sheds on and routing weighs prefill
workers by. Plain data in, an estimate out, no I/O, the time passed in by the caller.

A request's TTFT if admitted now is the wait behind the prefill work queued on the worker that
would prefill it (the chosen prefill worker, or the decode worker for local prefill) plus its
own prefill, both at the worker's learned prefill rate::

    predicted_ttft_s = (queued_tokens + num_prefill_tokens) / tokens_per_s

``queued_tokens`` is not the heartbeat's figure alone (up to a heartbeat period stale): it is
this router's own prefills in flight on the worker (``InFlightLedger``: known exactly, less the
progress the worker has made on the head one), plus the *foreign* part of the last report --
what the worker reported beyond this router's own work when the report arrived -- drained at the
worker's rate since then (other routers' work; the next report corrects it).

``tokens_per_s`` is learned online per worker from the router's own timing of its prefills: the
worker serves its prefill queue first come first served, so a job's service time is its
completion time minus the later of its dispatch and the previous job's completion (a departure-
time reconstruction that needs nothing from the worker). The estimate is an exponentially
weighted ratio estimator -- a decayed sum of tokens over a decayed sum of seconds, each new job
weighing ``ewma_alpha``, so a recent mix of prompt lengths is costed as a mix and per-job fixed
costs are spread over it -- seeded with a prior from the calibrated performance model for the
worker's model, GPU and TP degree. Tokens are whole prompts throughout. The prior
does not know how fast a simulated GPU runs (``speedup``) or how a real engine falls short of its
roofline; the observations do. (With several router replicas, other routers' jobs interleaved
with this router's make its samples pessimistic; that errs on the side of shedding.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from pdserve.perf.perf_model import PerfModel, perf_model_for
from pdserve.router.in_flight import InFlightLedger, PrefillJob
from pdserve.router.pool_view import WorkerView


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """What the pool view says about the worker that would prefill a request."""

    worker_id: str
    num_queued_prefill_tokens: int = 0
    """Prompt tokens queued or in progress, as last reported."""
    report_s: float = 0.0
    """Identity of that report (its heartbeat time, on any clock): a new value is a new report."""
    prior_tokens_per_s: float = 0.0
    """Prefill rate the performance model predicts; 0 = unknown (use the configured default)."""


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """The prefill work ahead of a new job on one worker now, and the rate it drains at."""

    queued_tokens: float
    tokens_per_s: float

    def ttft_s(self, num_prefill_tokens: int) -> float:
        """Predicted TTFT of a prompt of ``num_prefill_tokens`` (at least 1) sent there now."""
        return (self.queued_tokens + max(1, num_prefill_tokens)) / self.tokens_per_s


@dataclass(slots=True)
class _Worker:
    prior_tokens_per_s: float
    sum_tokens: float = 0.0
    """Decayed sum of prefilled tokens (with ``sum_s``, the ratio estimator of the rate)."""
    sum_s: float = 0.0
    num_samples: int = 0
    last_done_s: float = -math.inf
    report_s: float | None = None
    foreign_tokens: float = 0.0
    """Reported work beyond this router's own when the last report arrived."""
    foreign_at_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.sum_tokens / self.sum_s if self.num_samples else self.prior_tokens_per_s

    def learn(self, num_tokens: int, service_s: float, alpha: float) -> None:
        if not self.num_samples:
            # The prior counts as one earlier observation of the same size.
            self.sum_tokens, self.sum_s = num_tokens, num_tokens / self.prior_tokens_per_s
        self.sum_tokens = (1 - alpha) * self.sum_tokens + alpha * num_tokens
        self.sum_s = (1 - alpha) * self.sum_s + alpha * service_s
        self.num_samples += 1


class TtftPredictor:
    """Per-worker learned prefill rates and foreign work, over this router's ``InFlightLedger``
    (see the module docstring). Every method takes ``now_s`` from the caller's monotonic clock.
    """

    def __init__(self, in_flight: InFlightLedger, *, ewma_alpha: float,
                 default_tokens_per_s: float) -> None:
        self._in_flight = in_flight
        self._ewma_alpha = ewma_alpha
        self._default_tokens_per_s = default_tokens_per_s
        self._workers: dict[str, _Worker] = {}

    def tokens_per_s(self, worker_id: str) -> float | None:
        """The learned prefill rate of a worker, or None if it was never seen."""
        worker = self._workers.get(worker_id)
        return worker.tokens_per_s if worker else None

    def observe(self, snapshot: WorkerSnapshot, now_s: float) -> None:
        """Take in the worker's report if it is a new one: what it shows beyond this router's
        own prefills there is foreign work, draining from ``now_s``."""
        self._observe(snapshot, now_s)

    def estimate(self, snapshot: WorkerSnapshot, now_s: float) -> PrefillEstimate:
        """The prefill work ahead of a new job on the worker now (``observe`` included)."""
        worker = self._observe(snapshot, now_s)
        own = self._in_flight.on(snapshot.worker_id)
        rate = worker.tokens_per_s
        foreign_drained_at = worker.foreign_at_s + worker.foreign_tokens / rate
        foreign = max(0.0, worker.foreign_tokens - rate * (now_s - worker.foreign_at_s))
        own_tokens = float(own.num_prefill_tokens)
        head = own.head_prefill
        if head is not None:
            started = max(head.booked_s, worker.last_done_s, foreign_drained_at)
            own_tokens -= min(head.num_tokens, rate * max(0.0, now_s - started))
        return PrefillEstimate(foreign + own_tokens, rate)

    def learn(self, job: PrefillJob, now_s: float) -> None:
        """``job`` finished at ``now_s`` (successes only: a failure says nothing of the rate)."""
        worker = self._workers.get(job.worker_id)
        if worker is None:
            return
        service_s = now_s - max(job.booked_s, worker.last_done_s)
        worker.last_done_s = now_s
        if service_s > 0:
            worker.learn(job.num_tokens, service_s, self._ewma_alpha)

    def _observe(self, snapshot: WorkerSnapshot, now_s: float) -> _Worker:
        worker = self._workers.get(snapshot.worker_id)
        if worker is None:
            worker = self._workers[snapshot.worker_id] = _Worker(
                snapshot.prior_tokens_per_s or self._default_tokens_per_s)
        if snapshot.report_s != worker.report_s:
            own_tokens = self._in_flight.on(snapshot.worker_id).num_prefill_tokens
            worker.report_s = snapshot.report_s
            worker.foreign_tokens = float(max(0, snapshot.num_queued_prefill_tokens - own_tokens))
            worker.foreign_at_s = now_s
        return worker


# -- adapters ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _perf_model(model: str, gpu: str, tp_size: int) -> PerfModel | None:
    try:
        return perf_model_for(model, gpu, tp_size)
    except Exception:  # noqa: BLE001 - unknown to the catalog: no prior
        return None


def prior_tokens_per_s(model: str, gpu: str, tp_size: int, num_tokens: int) -> float:
    """Prefill rate the calibrated performance model predicts for one prompt of ``num_tokens``
    on ``model`` x ``gpu`` x ``tp_size``; 0.0 when the catalog does not know them."""
    perf = _perf_model(model, gpu, max(1, tp_size))
    if perf is None or num_tokens <= 0:
        return 0.0
    seconds = perf.prefill_time_s([num_tokens])
    return num_tokens / seconds if seconds > 0 else 0.0


def snapshot_of(worker: WorkerView, num_prefill_tokens: int) -> WorkerSnapshot:
    """The prediction's view of a pool-view worker (prior from its model, GPU and TP degree)."""
    info = worker.info
    return WorkerSnapshot(
        worker_id=worker.worker_id,
        num_queued_prefill_tokens=worker.record.load.num_queued_prefill_tokens,
        report_s=worker.record.last_heartbeat_s,
        # The worker's own figure when it gives one (it knows its engine and speed), else the
        # performance model's for its model, GPU and TP degree.
        prior_tokens_per_s=info.prefill_tokens_per_s or prior_tokens_per_s(
            info.model or worker.record.deployment, info.gpu, info.tp_size, num_prefill_tokens),
    )
