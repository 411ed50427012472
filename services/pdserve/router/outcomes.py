"""Per-request outcomes: Prometheus metrics at once, and per-window aggregates (goodput against
the configured SLOs, latency percentiles, reasons for misses) written to the durable store.

Durable writes happen on a background thread and never block serving: a failed write is logged
and the window is kept for the next flush (at most ``max_pending_windows``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import numpy as np

from pdserve.common.metrics import counter, gauge, histogram
from pdserve.db.records import MissReason, RequestWindowRecord
from pdserve.router.metrics import SLO_MISSES
from pdserve.router.types import RequestOutcome

logger = logging.getLogger(__name__)

TTFT = histogram("router", "time_to_first_token", "seconds", "Time to first token.", ["model"])
TPOT = histogram("router", "time_per_output_token", "seconds",
                 "Mean time per output token after the first.", ["model"])
OUTCOMES = counter("router", "finished", "requests", "Finished requests by outcome.",
                   ["model", "outcome"])
GOODPUT = gauge("router", "goodput", "requests",
                "Requests per second meeting both SLOs over the last window.", ["model"])
IN_FLIGHT = gauge("router", "in_flight", "requests", "Requests in flight on this router.")


class WindowWriter(Protocol):
    def record_request_window(self, record: RequestWindowRecord) -> object: ...


@dataclass(slots=True)
class _Window:
    start_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    num_requests: int = 0
    num_ok: int = 0
    num_errors: int = 0
    num_ttft_misses: int = 0
    num_tpot_misses: int = 0
    num_good: int = 0
    misses: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def miss_reason(outcome: RequestOutcome, slo_ttft_s: float) -> MissReason:
    """Where a slow request's time went (approximate): the visible transfer, a retry or a queue,
    else compute."""
    if outcome.exposed_transfer_s > 0.3 * max(outcome.ttft_s, 1e-9):
        return MissReason.TRANSFER
    if outcome.num_attempts > 1 or outcome.queue_s > 0.5 * slo_ttft_s:
        return MissReason.QUEUEING
    return MissReason.COMPUTE


class OutcomeAggregator:
    def __init__(self, slo_ttft_ms: float, slo_tpot_ms: float, window_s: float,
                 clock: Callable[[], float] | None = None, writer: WindowWriter | None = None,
                 max_pending_windows: int = 1000, source: str = "") -> None:
        """``clock``: wall-clock seconds (windows are aligned to it); ``time.time`` by default."""
        self._source = source
        self._slo_ttft_s = slo_ttft_ms / 1000
        self._slo_tpot_s = slo_tpot_ms / 1000
        self._window_s = window_s
        self._clock = clock or time.time
        self._writer = writer
        self._max_pending = max_pending_windows
        self._windows: dict[tuple[str, float], _Window] = {}
        self._pending: list[RequestWindowRecord] = []

    def record(self, outcome: RequestOutcome) -> None:
        model = outcome.deployment
        now = self._clock()
        start = math.floor(now / self._window_s) * self._window_s
        window = self._windows.setdefault((model, start), _Window(start))
        window.num_requests += 1
        if outcome.is_ok:
            window.num_ok += 1
            TTFT.labels(model).observe(outcome.ttft_s)
            TPOT.labels(model).observe(outcome.tpot_s)
            window.ttft_s.append(outcome.ttft_s)
            window.tpot_s.append(outcome.tpot_s)
            ttft_miss = outcome.ttft_s > self._slo_ttft_s
            tpot_miss = outcome.tpot_s > self._slo_tpot_s
            window.num_ttft_misses += ttft_miss
            window.num_tpot_misses += tpot_miss
            if ttft_miss:
                reason = miss_reason(outcome, self._slo_ttft_s)
                window.misses[reason] += 1
                SLO_MISSES.labels(model, reason).inc()
            elif tpot_miss:
                window.misses[MissReason.COMPUTE] += 1
                SLO_MISSES.labels(model, MissReason.COMPUTE).inc()
            else:
                window.num_good += 1
            OUTCOMES.labels(model, "ok").inc()
        elif outcome.error_code == "CANCELLED":
            OUTCOMES.labels(model, "cancelled").inc()
        else:
            window.num_errors += 1
            OUTCOMES.labels(model, "error").inc()

    def close_windows(self, *, is_final: bool = False) -> list[RequestWindowRecord]:
        """Windows that ended (all, when ``is_final``) as records; they leave the aggregator."""
        now = self._clock()
        closed = []
        for key, window in list(self._windows.items()):
            if is_final or window.start_s + self._window_s <= now:
                del self._windows[key]
                closed.append(self._to_record(key[0], window))
                GOODPUT.labels(key[0]).set(window.num_good / self._window_s)
        return closed

    def _to_record(self, model: str, window: _Window) -> RequestWindowRecord:
        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q) * 1000) if values else None

        return RequestWindowRecord(
            deployment=model, window_start=datetime.fromtimestamp(window.start_s, UTC),
            window_s=self._window_s, num_requests=window.num_requests, num_ok=window.num_ok,
            num_ttft_slo_misses=window.num_ttft_misses, num_tpot_slo_misses=window.num_tpot_misses,
            num_errors=window.num_errors, goodput_rps=window.num_good / self._window_s,
            ttft_p50_ms=pct(window.ttft_s, 50), ttft_p90_ms=pct(window.ttft_s, 90),
            ttft_p99_ms=pct(window.ttft_s, 99), tpot_p50_ms=pct(window.tpot_s, 50),
            tpot_p90_ms=pct(window.tpot_s, 90), tpot_p99_ms=pct(window.tpot_s, 99),
            num_misses_by_reason=dict(window.misses), source=self._source,
        )

    async def flush(self, *, is_final: bool = False) -> int:
        """Write closed windows; returns how many were written."""
        self._pending.extend(self.close_windows(is_final=is_final))
        if self._writer is None or not self._pending:
            self._pending.clear()
            return 0
        written = 0
        while self._pending:
            record = self._pending[0]
            try:
                await asyncio.to_thread(self._writer.record_request_window, record)
            except Exception:  # noqa: BLE001 - durable store down: keep and retry later
                logger.warning("could not write request window; will retry", exc_info=True)
                del self._pending[: max(0, len(self._pending) - self._max_pending)]
                break
            self._pending.pop(0)
            written += 1
        return written

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self._window_s)
            except TimeoutError:
                pass
            await self.flush(is_final=stop.is_set())
