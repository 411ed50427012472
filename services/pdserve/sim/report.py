"""Summaries of a ``SimResult``: latency percentiles, SLO attainment with miss reasons, GPU-hours,
and per-interval series (demand, instances, attainment) for plots."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.sim.config import SloSpec
from pdserve.sim.result import MissReason, RequestStatus, SimResult

PERCENTILES = (50.0, 90.0, 99.0)
_REASONS = (MissReason.QUEUEING, MissReason.TRANSFER, MissReason.COMPUTE, MissReason.REJECTED,
            MissReason.FAILED)


@dataclass(frozen=True, slots=True)
class SimSummary:
    """Figures of one run. Latencies in milliseconds over completed requests; attainment over
    all requests (rejected and failed count as misses); ``misses`` counts requests per reason
    (``MissReason`` names, lower case), one reason each (TTFT's if TTFT missed, else TPOT's);
    ``ttft_misses`` / ``tpot_misses`` count each SLO's misses separately."""

    num_requests: int
    num_completed: int
    num_rejected: int
    num_failed: int
    ttft_ms: dict[float, float]
    tpot_ms: dict[float, float]
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    misses: dict[str, int]
    ttft_misses: dict[str, int]
    tpot_misses: dict[str, int]
    gpu_hours: float
    sim_s: float
    wall_s: float
    local_prefill_fraction: float
    slo: SloSpec

    def as_dict(self) -> dict[str, object]:
        return {
            "num_requests": self.num_requests, "num_completed": self.num_completed,
            "num_rejected": self.num_rejected, "num_failed": self.num_failed,
            "ttft_ms": {f"p{p:g}": v for p, v in self.ttft_ms.items()},
            "tpot_ms": {f"p{p:g}": v for p, v in self.tpot_ms.items()},
            "attainment": self.attainment, "ttft_attainment": self.ttft_attainment,
            "tpot_attainment": self.tpot_attainment, "misses": self.misses,
            "ttft_misses": self.ttft_misses, "tpot_misses": self.tpot_misses,
            "gpu_hours": self.gpu_hours, "sim_s": self.sim_s, "wall_s": self.wall_s,
            "local_prefill_fraction": self.local_prefill_fraction,
            "slo": {"ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms},
        }


def _count(reasons: np.ndarray) -> dict[str, int]:
    counts = np.bincount(reasons.astype(np.int64), minlength=len(MissReason))
    return {reason.name.lower(): int(counts[reason]) for reason in _REASONS}


def _percentiles(values: np.ndarray) -> dict[float, float]:
    if len(values) == 0:
        return {p: float("nan") for p in PERCENTILES}
    return {p: float(v) * 1000.0 for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES),
                                                  strict=True)}


def summarize(result: SimResult, slo: SloSpec | None = None) -> SimSummary:
    slo = slo or result.config.slo
    completed = result.status == RequestStatus.COMPLETED
    ttft = result.ttft_reasons(slo)
    tpot = result.tpot_reasons(slo)
    overall = np.where(ttft != MissReason.NONE, ttft, tpot)
    n = max(1, result.num_requests)
    return SimSummary(
        num_requests=result.num_requests,
        num_completed=int(completed.sum()),
        num_rejected=int(np.sum(result.status == RequestStatus.REJECTED)),
        num_failed=int(np.sum(result.status == RequestStatus.FAILED)),
        ttft_ms=_percentiles(result.ttft_s[completed]),
        tpot_ms=_percentiles(result.tpot_s[completed & (result.output_tokens > 1)]),
        attainment=float(np.sum(overall == MissReason.NONE)) / n,
        ttft_attainment=float(np.sum(ttft == MissReason.NONE)) / n,
        tpot_attainment=float(np.sum(tpot == MissReason.NONE)) / n,
        misses=_count(overall), ttft_misses=_count(ttft), tpot_misses=_count(tpot),
        gpu_hours=result.gpu_hours, sim_s=result.end_s, wall_s=result.wall_s,
        local_prefill_fraction=float(np.mean(result.is_local_prefill[completed]))
        if completed.any() else 0.0,
        slo=slo,
    )


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w)
                       for i, (h, w) in enumerate(zip(headers, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)


def format_summary(summary: SimSummary) -> str:
    """Human-readable tables: latency percentiles, attainment, misses by reason, cost."""
    latency = _table(["metric", *(f"p{p:g}" for p in PERCENTILES), "SLO"], [
        ["TTFT ms", *(f"{summary.ttft_ms[p]:,.1f}" for p in PERCENTILES),
         f"{summary.slo.ttft_ms:,.0f}"],
        ["TPOT ms", *(f"{summary.tpot_ms[p]:,.1f}" for p in PERCENTILES),
         f"{summary.slo.tpot_ms:,.0f}"],
    ])
    n = max(1, summary.num_requests)
    reasons = [r.name.lower() for r in _REASONS]
    misses = _table(["SLO", "attained", *reasons], [
        ["TTFT", f"{summary.ttft_attainment:.2%}",
         *(f"{summary.ttft_misses[r]:,}" for r in reasons)],
        ["TPOT", f"{summary.tpot_attainment:.2%}",
         *(f"{summary.tpot_misses[r]:,}" for r in reasons)],
        ["both", f"{summary.attainment:.2%}", *(f"{summary.misses[r]:,}" for r in reasons)],
    ])
    totals = (f"requests {summary.num_requests:,}: completed {summary.num_completed:,}, "
              f"rejected {summary.num_rejected:,}, failed {summary.num_failed:,}; "
              f"local prefill {summary.local_prefill_fraction:.1%}\n"
              f"GPU-hours {summary.gpu_hours:,.2f} over {summary.sim_s:,.0f} simulated s "
              f"({summary.gpu_hours / max(1e-9, summary.sim_s / 3600):,.0f} GPUs on average); "
              f"simulated in {summary.wall_s:,.2f} s wall "
              f"({summary.num_requests / max(1e-9, summary.wall_s):,.0f} requests/s)")
    legend = ("miss reasons: queueing = met without waiting; transfer = met without the exposed "
              "KV transfer; compute = missed even without both; the 'both' row counts each "
              f"missed request once (TTFT reason first) of {n:,}")
    return f"{latency}\n\n{misses}\n\n{totals}\n\n{legend}"


@dataclass(frozen=True, slots=True)
class TimeSeries:
    """Per ``bin_s`` interval (``start_s``): arrivals per second, SLO attainment of the requests
    that arrived in it (NaN if none), and instance counts sampled at its start."""

    start_s: np.ndarray
    arrival_rate_per_s: np.ndarray
    attainment: np.ndarray
    prefill_instances: np.ndarray
    decode_instances: np.ndarray
    prefill_starting: np.ndarray
    decode_starting: np.ndarray


def time_series(result: SimResult, bin_s: float | None = None,
                slo: SloSpec | None = None) -> TimeSeries:
    """Bins of ``bin_s`` seconds (default: about 200 bins over the run, at least 1 s)."""
    end = max(result.end_s, float(result.arrival_s[-1]) if result.num_requests else 0.0, 1e-9)
    if bin_s is None:
        bin_s = max(1.0, float(np.ceil(end / 200)))
    edges = np.arange(0.0, end + bin_s, bin_s)
    arrivals, _ = np.histogram(result.arrival_s, edges)
    met, _ = np.histogram(result.arrival_s, edges, weights=result.met_slo(slo).astype(float))
    with np.errstate(invalid="ignore", divide="ignore"):
        attainment = np.where(arrivals > 0, met / np.maximum(arrivals, 1), np.nan)
    timeline = result.timeline
    starts = edges[:-1]
    index = np.clip(np.searchsorted(timeline["time_s"], starts, side="right") - 1, 0,
                    max(0, len(timeline["time_s"]) - 1))

    def sampled(name: str) -> np.ndarray:
        values = timeline[name]
        return values[index] if len(values) else np.zeros(len(starts))

    return TimeSeries(
        start_s=starts, arrival_rate_per_s=arrivals / bin_s, attainment=attainment,
        prefill_instances=sampled("prefill_ready") + sampled("prefill_draining"),
        decode_instances=sampled("decode_ready") + sampled("decode_draining"),
        prefill_starting=sampled("prefill_starting"), decode_starting=sampled("decode_starting"),
    )
