"""PNG of a simulation over time: demand, instances, SLO attainment (matplotlib, Agg backend).

matplotlib is optional (the ``plots`` extra); ``plot_timeline`` raises ``PlotUnavailableError``
when it is missing so callers can say so and carry on.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.common.errors import PdserveError
from pdserve.common.plotting import MISSING_NOTE, pyplot
from pdserve.sim.config import SloSpec
from pdserve.sim.report import time_series
from pdserve.sim.result import SimResult


class PlotUnavailableError(PdserveError):
    """matplotlib is not installed."""


def plot_timeline(result: SimResult, path: Path, *, bin_s: float | None = None,
                  slo: SloSpec | None = None, title: str = "") -> Path:
    """Write three stacked panels to ``path``: arrival rate, instances (serving and starting,
    per pool) and the SLO attainment of the requests arriving in each interval."""
    plt = pyplot()
    if plt is None:
        raise PlotUnavailableError(MISSING_NOTE)
    series = time_series(result, bin_s, slo)
    slo = slo or result.config.slo
    minutes = series.start_s / 60.0
    fig, (demand, instances, attained) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    demand.step(minutes, series.arrival_rate_per_s, where="post", color="tab:gray")
    demand.set_ylabel("arrivals / s")
    demand.set_title(title or "demand, instances and SLO attainment")
    for values, starting, label, color in (
            (series.prefill_instances, series.prefill_starting, "prefill", "tab:blue"),
            (series.decode_instances, series.decode_starting, "decode", "tab:orange")):
        instances.step(minutes, values, where="post", color=color, label=f"{label} serving")
        if starting.any():
            instances.step(minutes, values + starting, where="post", color=color,
                           linestyle="--", label=f"{label} incl. starting")
    instances.set_ylabel("instances")
    instances.legend(loc="upper left", fontsize="small")
    attained.plot(minutes, 100.0 * series.attainment, color="tab:green", marker=".",
                  markersize=3, linewidth=1)
    attained.set_ylabel("attainment %")
    attained.set_ylim(-2, 102)
    attained.set_xlabel("simulated minutes")
    attained.set_title(f"both SLOs met (TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms), "
                       "by arrival interval", fontsize="small")
    for axis in (demand, instances, attained):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
