"""Admission control, pure and synchronous: plain data in, a decision out, no I/O, the time passed
in by the caller. The router calls it once per request, after routing and before it opens a
ticket, so a request that cannot meet its TTFT SLO is refused before any prefill work (or KV
reservation) is spent on it; the simulator calls the same object.

**Prediction** (``router.prediction``): a request's TTFT if admitted now is the prefill work
queued on the worker that would prefill it -- this router's own prefills there
(``router.in_flight``) plus the foreign part of the worker's last report -- and its own prompt,
at the worker's learned prefill rate.

**Shedding** (each refusal is immediate, with a retry hint, never a wait in an unbounded queue):

1. the router is at ``max_in_flight`` requests, or the tenant at its in-flight cap (explicit per
   tenant, else ``tenant_share`` x ``max_in_flight``);
2. the router queue -- admitted requests whose prefill has not finished -- holds ``max_pending``;
3. the predicted TTFT exceeds the budget, ``ttft_budget_fraction`` x the SLO (the margin covers
   what the prediction leaves out: ticket, admission and transfer latency, and its own error);
   the retry hint is the time until the queue has drained enough to admit the request;
4. fair share: once the queue is *saturated* (predicted TTFT beyond ``fair_share_onset`` of the
   budget, or the router queue beyond that fraction of its bound), a tenant holding more than
   its weighted share of the pending prefill work is refused; tenants under their share are still
   admitted up to the full budget. This is max-min fairness over the pending prefill work (the
   resource a TTFT SLO rations): a tenant asking for less than an equal (weighted) split gets all
   it asks, and what it leaves is shared by the others. A tenant sending ten times another's
   rate is shed in the band between the onset and the budget while the light tenant still gets
   in, so the light tenant's goodput stays at its demand. Decode KV room is checked by the routing
   policy (``policy.choose_decode``), which raises its own ``CapacityError``.

Retry hints are clamped to ``[min_retry_after_s, max_retry_after_s]`` and grow with the depth of
the queue that caused the refusal. ``is_shedding_enabled=False`` keeps only the hard bounds (1 and
2), to measure what shedding buys.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass

from pdserve.common.errors import InvalidArgumentError
from pdserve.router.in_flight import InFlightLedger
from pdserve.router.prediction import TtftPredictor, WorkerSnapshot


class AdmissionOutcome(enum.StrEnum):
    ADMITTED = "admitted"
    ROUTER_FULL = "router_full"
    """The router holds ``max_in_flight`` requests."""
    TENANT_FULL = "tenant_full"
    """The tenant holds its in-flight cap."""
    QUEUE_FULL = "queue_full"
    """The router queue (requests not yet through prefill) is at its bound."""
    SLO = "slo"
    """The predicted TTFT exceeds the budget."""
    FAIR_SHARE = "fair_share"
    """Saturated, and the tenant holds more than its share of the pending prefill work."""


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Knobs of the admission policy. Times in seconds; fractions in (0, 1] unless noted."""

    slo_ttft_s: float = 2.0
    ttft_budget_fraction: float = 0.8
    """Shed when the predicted TTFT exceeds this fraction of ``slo_ttft_s`` (may exceed 1)."""
    fair_share_onset: float = 0.5
    """Fraction of the budget (and of ``max_pending``) beyond which tenants over their share
    are shed."""
    is_shedding_enabled: bool = True
    """False: only the in-flight caps and the queue bound refuse requests."""
    max_in_flight: int = 4096
    """Requests the router holds at once (prefilling or decoding)."""
    max_pending: int = 1024
    """Requests admitted whose prefill has not finished (the router queue)."""
    tenant_share: float = 0.5
    """Default in-flight cap of a tenant, as a fraction of ``max_in_flight``."""
    tenant_max_in_flight: tuple[tuple[str, int], ...] = ()
    """Explicit in-flight caps, (tenant, cap) pairs; others get the default."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """Fair-share weights, (tenant, weight) pairs; others weigh 1."""
    in_flight_retry_after_s: float = 0.5
    """Retry hint when an in-flight cap refuses (how long requests decode is not predicted)."""
    min_retry_after_s: float = 0.05
    max_retry_after_s: float = 10.0
    ewma_alpha: float = 0.2
    """Weight of each new observation in the learned prefill rate."""
    default_tokens_per_s: float = 10_000.0
    """Prior prefill rate of a worker the performance model does not know."""
    tenant_idle_s: float = 10.0
    """A tenant that sent nothing for this long no longer claims a fair share."""

    def __post_init__(self) -> None:
        positive = ("slo_ttft_s", "ttft_budget_fraction", "default_tokens_per_s",
                    "max_retry_after_s", "tenant_idle_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name}: must be > 0", field=name)
        for name in ("fair_share_onset", "tenant_share", "ewma_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidArgumentError(f"{name}: must be in (0, 1]", field=name)
        for name in ("max_in_flight", "max_pending"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name}: must be >= 1", field=name)
        if not 0 <= self.min_retry_after_s <= self.max_retry_after_s:
            raise InvalidArgumentError("min_retry_after_s: must be in [0, max_retry_after_s]",
                                       field="min_retry_after_s")
        if any(cap < 1 for _, cap in self.tenant_max_in_flight):
            raise InvalidArgumentError("tenant_max_in_flight: caps must be >= 1",
                                       field="tenant_max_in_flight")
        if any(not weight > 0 for _, weight in self.tenant_weights):
            raise InvalidArgumentError("tenant_weights: weights must be > 0",
                                       field="tenant_weights")

    @property
    def budget_s(self) -> float:
        """Predicted TTFT beyond which a request is shed."""
        return self.slo_ttft_s * self.ttft_budget_fraction


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    request_id: str
    tenant: str
    """"" is the default tenant."""
    num_prefill_tokens: int
    """The prompt's tokens, >= 1: the unit workers report their queues in. (A prefix-cache
    hit makes a prefill cheaper; counted in whole prompts, hits show up as a faster learned
    rate, in proportion to how often they happen. Counting only uncached tokens would charge
    a mostly cached prompt's fixed costs -- the whole KV still moves -- to a handful of tokens
    and make the worker look slow.)"""


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    outcome: AdmissionOutcome
    predicted_ttft_s: float
    retry_after_s: float = 0.0
    """Seconds to wait before retrying; 0 when admitted."""
    message: str = ""

    @property
    def is_admitted(self) -> bool:
        return self.outcome is AdmissionOutcome.ADMITTED


@dataclass(slots=True)
class _Request:
    tenant: str
    num_tokens: int
    is_pending: bool = True


class AdmissionPolicy:
    """Per-router admission state and decisions. Not thread-safe; one event loop calls it.

    Life of a request: ``admit`` (which, when it admits, books the request's prefill in the
    ``InFlightLedger`` on the worker it was predicted against) -> ``dispatched`` when its prefill
    is actually sent (again for each retry, possibly elsewhere) -> ``prefill_done`` when the
    prefill finished or failed -> ``finish`` when the request ends, whatever happened. Every
    method takes ``now_s`` from the caller's monotonic clock; calls for unknown request ids are
    ignored. ``in_flight`` is the router's ledger (routing reads it too); a policy used alone
    keeps its own.
    """

    def __init__(self, config: AdmissionConfig, in_flight: InFlightLedger | None = None) -> None:
        self.config = config
        self._in_flight = in_flight if in_flight is not None else InFlightLedger()
        self._predictor = TtftPredictor(self._in_flight, ewma_alpha=config.ewma_alpha,
                                       default_tokens_per_s=config.default_tokens_per_s)
        self._requests: dict[str, _Request] = {}
        self._tenant_in_flight: Counter[str] = Counter()
        self._tenant_pending_tokens: Counter[str] = Counter()
        self._num_pending = 0
        self._tenant_seen_s: dict[str, float] = {}
        """When each tenant last asked, oldest first."""
        self._tenant_caps = dict(config.tenant_max_in_flight)
        self._tenant_weights = dict(config.tenant_weights)
        self._default_cap = max(1, math.ceil(config.tenant_share * config.max_in_flight))

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def num_pending(self) -> int:
        return self._num_pending

    def tenant_in_flight(self, tenant: str) -> int:
        return self._tenant_in_flight[tenant]

    def tenant_cap(self, tenant: str) -> int:
        return self._tenant_caps.get(tenant, self._default_cap)

    def tokens_per_s(self, worker_id: str) -> float | None:
        """The learned prefill rate of a worker, or None if it was never seen."""
        return self._predictor.tokens_per_s(worker_id)

    def estimated_queued_tokens(self, snapshot: WorkerSnapshot, now_s: float) -> int:
        """Prefill tokens ahead of a new job on the worker now (``router.prediction``)."""
        return round(self._predictor.estimate(snapshot, now_s).queued_tokens)

    def predict_ttft_s(self, snapshot: WorkerSnapshot, num_prefill_tokens: int,
                       now_s: float) -> float:
        return self._predictor.estimate(snapshot, now_s).ttft_s(num_prefill_tokens)

    # -- decisions ----------------------------------------------------------------------------

    def admit(self, request: AdmissionRequest, worker: WorkerSnapshot,
              now_s: float) -> AdmissionDecision:
        """Admit or refuse ``request`` if it were prefilled on ``worker`` now. When admitted, the
        request counts against its tenant and the router from now until ``finish``."""
        if request.request_id in self._requests:
            raise InvalidArgumentError(f"request_id: {request.request_id!r} is already admitted",
                                       field="request_id")
        config = self.config
        num_tokens = max(1, request.num_prefill_tokens)
        estimate = self._predictor.estimate(worker, now_s)
        rate = estimate.tokens_per_s
        predicted = estimate.ttft_s(num_tokens)
        tenant = request.tenant
        self._seen(tenant, now_s)

        def shed(outcome: AdmissionOutcome, retry_after_s: float,
                 message: str) -> AdmissionDecision:
            return AdmissionDecision(outcome, predicted, self._clamp(retry_after_s), message)

        if self.num_in_flight >= config.max_in_flight:
            return shed(AdmissionOutcome.ROUTER_FULL, config.in_flight_retry_after_s,
                        f"router is at its in-flight limit ({config.max_in_flight})")
        cap = self.tenant_cap(tenant)
        if self._tenant_in_flight[tenant] >= cap:
            return shed(AdmissionOutcome.TENANT_FULL, config.in_flight_retry_after_s,
                        f"tenant is at its in-flight limit ({cap})")
        if self._num_pending >= config.max_pending:
            excess = self._num_pending - config.max_pending + 1
            mean_tokens = sum(self._tenant_pending_tokens.values()) / max(1, self._num_pending)
            return shed(AdmissionOutcome.QUEUE_FULL, excess * mean_tokens / rate,
                        f"router queue is full ({config.max_pending} requests before prefill)")
        if config.is_shedding_enabled:
            budget_s = config.budget_s
            if predicted > budget_s:
                return shed(AdmissionOutcome.SLO, predicted - budget_s,
                            f"predicted TTFT {predicted * 1000:.0f} ms exceeds the budget of "
                            f"{budget_s * 1000:.0f} ms (SLO {config.slo_ttft_s * 1000:.0f} ms)")
            onset_s = budget_s * config.fair_share_onset
            is_saturated = (predicted > onset_s
                            or self._num_pending >= config.fair_share_onset * config.max_pending)
            excess_tokens = self._excess_tokens(tenant)
            if is_saturated and excess_tokens > 0:
                return shed(AdmissionOutcome.FAIR_SHARE,
                            max(predicted - onset_s, excess_tokens / rate),
                            "tenant holds more than its share of a saturated queue")
        self._requests[request.request_id] = _Request(tenant, num_tokens)
        self._tenant_in_flight[tenant] += 1
        self._tenant_pending_tokens[tenant] += num_tokens
        self._num_pending += 1
        self._in_flight.book_prefill(request.request_id, worker.worker_id, num_tokens, now_s)
        return AdmissionDecision(AdmissionOutcome.ADMITTED, predicted)

    def dispatched(self, request_id: str, worker: WorkerSnapshot, now_s: float) -> None:
        """The request's prefill was sent to ``worker`` (the first attempt, or a retry)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        # Not sent before now: a report that arrived since admission cannot show it.
        self._in_flight.end_prefill(request_id)
        if not request.is_pending:
            request.is_pending = True
            self._num_pending += 1
            self._tenant_pending_tokens[request.tenant] += request.num_tokens
        self._predictor.observe(worker, now_s)
        self._in_flight.book_prefill(request_id, worker.worker_id, request.num_tokens, now_s)

    def prefill_done(self, request_id: str, now_s: float, *, is_ok: bool) -> None:
        """The prefill finished (``is_ok``: its result arrived) or failed or was cancelled. Only
        successes teach the worker's rate."""
        request = self._requests.get(request_id)
        if request is None or not request.is_pending:
            return
        request.is_pending = False
        self._num_pending -= 1
        self._tenant_pending_tokens[request.tenant] -= request.num_tokens
        if self._tenant_pending_tokens[request.tenant] <= 0:
            del self._tenant_pending_tokens[request.tenant]
        job = self._in_flight.end_prefill(request_id)
        if job is not None and is_ok:
            self._predictor.learn(job, now_s)

    def finish(self, request_id: str) -> None:
        """The request ended (any outcome): it stops counting against its tenant and the router."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.is_pending:
            self.prefill_done(request_id, 0.0, is_ok=False)
        del self._requests[request_id]
        self._tenant_in_flight[request.tenant] -= 1
        if self._tenant_in_flight[request.tenant] <= 0:
            del self._tenant_in_flight[request.tenant]

    # -- internals ----------------------------------------------------------------------------

    def _clamp(self, retry_after_s: float) -> float:
        return min(self.config.max_retry_after_s, max(self.config.min_retry_after_s, retry_after_s))

    def _seen(self, tenant: str, now_s: float) -> None:
        seen = self._tenant_seen_s
        seen.pop(tenant, None)
        seen[tenant] = now_s
        horizon_s = now_s - self.config.tenant_idle_s
        while (oldest := next(iter(seen))) != tenant and seen[oldest] < horizon_s:
            del seen[oldest]

    def _excess_tokens(self, tenant: str) -> float:
        """Pending prefill tokens the tenant holds beyond its weighted share of all pending
        work. Shares are split among the tenants that asked recently (a light tenant between two
        requests still claims its share) or hold pending work. A tenant at or under its share
        is admitted, so even the smallest tenant always gets one request in."""
        pending = self._tenant_pending_tokens
        if not pending:
            return 0.0
        active = set(pending) | set(self._tenant_seen_s)
        weight = self._tenant_weights.get(tenant, 1.0)
        total_weight = sum(self._tenant_weights.get(t, 1.0) for t in active)
        share = sum(pending.values()) * weight / total_weight
        return pending[tenant] - share
