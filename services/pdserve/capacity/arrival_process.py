"""The arrival process a plan is sized for: observed arrivals (a trace's timestamps and the work
each request brings) cut into windows at the TTFT bound's time scale.

Why not Poisson. The planner's queueing formulas (``queueing.mgc_wait``) assume Poisson
arrivals. Real traces are not: over one-second windows the Azure 2023 code trace has an index of
dispersion for counts (variance / mean of the count) of 13 and over one minute of 160, where
Poisson has 1; the Azure conversation trace has a ~100 s stretch at twice its mean prompt
tokens per second; the Mooncake conversation trace delivers most of its requests in groups
sharing one millisecond timestamp. A plan sized for the mean rate meets its SLO in quiet periods
and misses it in every burst (on the Azure code trace at 20 req/s: 97.7% predicted, 5.7%
replayed).

Work, not counts. A pool feels the work that arrives, not the number of requests: bursts of the
Azure conversation trace are of short outputs, so they load prefill and leave decode's output
tokens per second flat. Each window therefore carries two intensities: the prefill work
(uncached prompt tokens) and the decode work (output tokens) arriving in it, relative to their
means (the index of dispersion *for work* of Fendick & Whitt, "Measurements and approximations
to describe the offered traffic and predict the average workload in a single-server queue",
Proc. IEEE 77(1), 1989, which they show predicts queueing under bursty traffic where counts do
not).

Calm windows (the stationary part). Arrivals are treated as a doubly stochastic (Cox) process:
compound Poisson given an intensity that itself varies. For the work ``W`` of a window, ``Var W
= E N x E[X^2] + Var(Lambda) x E[X]^2`` (law of total variance; Cox & Isham, *Point
Processes*, 1980, ch. 3): the variance beyond the compound-Poisson noise is the intensity's.
Each window's intensity is estimated by shrinking its work toward the mean, ``r = 1 + s (w /
mean - 1)`` with ``s = sqrt(1 - noise / Var W)``, which gives the estimates the intensity's
variance and leaves Poisson traffic at the mean rate (the M/G/c formulas already hold its
noise). A window is predicted by the stationary model at its own rates: the pointwise
stationary approximation (Green & Kolesar, "The pointwise stationary approximation for queues
with nonstationary arrivals", Management Science 37(1), 1991), accurate when the rate changes
slowly against the queue's relaxation time. Windows are grouped into ``levels`` (cells of a
cut by prefill intensity and one by decode intensity, ``PREFILL_EDGES`` x ``DECODE_EDGES``) so
a prediction evaluates the stationary model a few dozen times, not once per window.

Congested windows (the fluid part, ``disaggregated.series_attainment``). Where a burst
overloads the prefill pool, or leaves a backlog behind it, the stationary model has no answer
(an unstable queue) and the pointwise approximation is wrong both ways: a short overload drains
after it, a long one keeps growing. There the backlog is carried from window to window by
Lindley's recursion on the prefill work that actually arrived (``WindowSeries.prefill_load``,
noise included: it is the queue's real input at that resolution).

Windows are ``prefill_window_s`` long (the planner uses the TTFT bound: a burst shorter than the
bound is absorbed within it); each window's decode intensity is measured over the
``decode_window_s`` centred on it (the planner uses a request's decode time at the TPOT bound:
the batch is the arrivals of the last residence time). ``windows`` compresses (or stretches)
the observed times to the asked mean rate, as replaying the trace at that rate does, so the
burst structure is the trace's own at every rate. What the model does not see (routing
imbalance, prefix-cache placement, the wait for KV room during a burst) the replay in
``pdserve.sim.plan_check`` checks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from pdserve.common.errors import InvalidArgumentError

PREFILL_EDGES = (0.0, 0.5, 0.8, 0.9, 0.95, 0.98, 0.995, 1.0)
DECODE_EDGES = (0.0, 0.5, 0.8, 0.93, 0.98, 1.0)
"""Cumulative request shares at which windows sorted by their prefill (decode) intensity are
cut into levels: finer where the planner's target percentiles (90-99%) fall, since there the
busiest windows decide. The levels are the cells of both cuts (the two intensities are not
tied: a burst of short requests loads prefill, not decode), each decode value shared by its
column so a prediction computes each decode state once."""

MAX_WINDOWS = 20_000
"""Most windows a trace is cut into (a bound on the work per prediction)."""

MIN_WINDOWS = 8
"""Fewer windows than this over the trace: too short to measure burstiness (treated as
Poisson)."""


@dataclass(frozen=True, slots=True)
class RateLevel:
    """Requests arriving while the prefill pool sees ``prefill_factor`` x the mean rate and the
    decode pool ``decode_factor`` x the mean rate: ``share`` of all requests (levels sum to 1)."""

    prefill_factor: float
    decode_factor: float
    share: float


@dataclass(frozen=True, slots=True, eq=False)
class WindowSeries:
    """The arrivals as consecutive prefill windows of ``window_s`` seconds (at the asked rate),
    in time order: each window's prefill and decode intensity (relative to the mean), the
    prefill work that actually arrived in it (``prefill_load``, relative to the mean: the input
    of a fluid queue, noise included), ``share`` of the requests arriving in it (sums to 1),
    and ``cell``, the index of the level (in ``levels``) it falls in. Float arrays
    ``[num_windows]``; ``cell`` int."""

    window_s: float
    prefill_load: np.ndarray
    prefill_factor: np.ndarray
    decode_factor: np.ndarray
    share: np.ndarray
    cell: np.ndarray
    levels: tuple[RateLevel, ...]


@dataclass(frozen=True, slots=True, eq=False)
class ArrivalProfile:
    """Observed arrivals: times (``arrival_s``: float64[n], non-decreasing, seconds) and what
    each request asks of each pool (``prefill_work``, ``decode_work``: float[n] >= 0, e.g.
    uncached prompt tokens and output tokens; default 1 each, i.e. counts). Only their pattern
    matters: ``rate_mixture`` rescales the times to any mean rate."""

    arrival_s: np.ndarray
    prefill_work: np.ndarray | None = None
    decode_work: np.ndarray | None = None

    def __post_init__(self) -> None:
        times = np.asarray(self.arrival_s, dtype=np.float64)
        if times.ndim != 1 or times.size < 2 or not bool(np.all(np.isfinite(times))):
            raise InvalidArgumentError("an arrival profile needs at least 2 finite arrival times",
                                       field="arrivals")
        if bool(np.any(np.diff(times) < 0)) or not times[-1] > times[0]:
            raise InvalidArgumentError(
                "arrival times must be non-decreasing and span a positive time",
                field="arrivals")
        object.__setattr__(self, "arrival_s", times - times[0])
        for name in ("prefill_work", "decode_work"):
            work = getattr(self, name)
            work = np.ones(times.size) if work is None else np.asarray(work, dtype=np.float64)
            if work.shape != times.shape or not bool(np.all(work >= 0)) or not work.sum() > 0:
                raise InvalidArgumentError(
                    f"{name} needs one value >= 0 per arrival (not all 0)", field=name)
            object.__setattr__(self, name, work)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1])

    @property
    def mean_rate_per_s(self) -> float:
        """``(n - 1) / duration``, as ``Trace.mean_rate_per_s`` counts it."""
        return (self.arrival_s.size - 1) / self.duration_s

    def rate_mixture(self, rate_per_s: float, prefill_window_s: float,
                     decode_window_s: float) -> tuple[RateLevel, ...]:
        """The rate levels of these arrivals compressed to mean rate ``rate_per_s``, with
        windows of ``prefill_window_s`` and ``decode_window_s`` (seconds at that rate); see the
        module docstring. One level ``(1, 1, 1)`` when the trace is too short for the windows."""
        return self.windows(rate_per_s, prefill_window_s, decode_window_s).levels

    def windows(self, rate_per_s: float, prefill_window_s: float,
                decode_window_s: float) -> WindowSeries:
        """``rate_mixture``'s levels with the window series they summarise (times in seconds
        at ``rate_per_s``); one window of share 1 when the trace is too short."""
        if not (rate_per_s > 0 and prefill_window_s > 0 and decode_window_s > 0):
            raise InvalidArgumentError("rate and windows must be > 0", field="rate")
        # A window of w seconds at rate R spans w x R / own_rate seconds of the observed times.
        stretch = rate_per_s / self.mean_rate_per_s
        # Far below the trace's own rate the windows would be far shorter than its gaps (and
        # countless): no window is shorter than 1 / MAX_WINDOWS of the trace.
        prefill_own_s = max(prefill_window_s * stretch, self.duration_s / MAX_WINDOWS)
        decode_own_s = max(decode_window_s * stretch, prefill_own_s)
        series = _mixture(self, round(prefill_own_s, 9), round(decode_own_s, 9))
        return dataclasses.replace(series, window_s=series.window_s / stretch)

    def index_of_dispersion(self, window_s: float) -> float:
        """Variance over mean of the count of arrivals in windows of ``window_s`` seconds of the
        observed times (1 for Poisson; NaN when fewer than ``MIN_WINDOWS`` fit)."""
        edges = _edges(self.arrival_s, window_s)
        if edges is None:
            return math.nan
        counts = np.diff(np.searchsorted(self.arrival_s, edges, side="left")).astype(float)
        return float(counts.var() / counts.mean()) if counts.mean() > 0 else math.nan


def _edges(times: np.ndarray, window_s: float) -> np.ndarray | None:
    """Edges of the whole windows of ``window_s`` over ``times`` (a partial last window would
    read as a lull), or None when fewer than ``MIN_WINDOWS`` fit."""
    num_windows = int(times[-1] // window_s)
    if num_windows < MIN_WINDOWS:
        return None
    return np.arange(num_windows + 1) * window_s


def _intensity(times: np.ndarray, cumulative_work: np.ndarray, square_work: float,
               starts: np.ndarray, window_s: float, num_windows: int) -> np.ndarray:
    """Relative work intensity over ``[start, start + window_s)`` for each of ``starts``, by
    Cox shrinkage (module docstring) with the dispersion of ``num_windows`` tiling windows.

    Work in a window is compound: given the intensity, its variance is ``E N x E[X^2]``
    (``square_work`` = ``E[X^2]`` per request), the rest of the observed variance is the
    intensity's."""
    tiles = np.arange(num_windows + 1) * window_s
    tiled = np.diff(cumulative_work[np.searchsorted(times, tiles, side="left")])
    mean = float(tiled.mean())
    if mean <= 0:
        return np.ones(starts.size)
    mean_count = (times.size / times[-1]) * window_s
    noise = mean_count * square_work
    variance = float(tiled.var())
    shrink = math.sqrt(max(0.0, 1.0 - noise / variance)) if variance > 0 else 0.0
    index = np.searchsorted(times, np.stack([starts, starts + window_s]), side="left")
    work = cumulative_work[index[1]] - cumulative_work[index[0]]
    return np.maximum(0.0, 1.0 + shrink * (work / mean - 1.0))


@functools.lru_cache(maxsize=256)
def _mixture(profile: ArrivalProfile, prefill_window_s: float,
             decode_window_s: float) -> WindowSeries:
    """``ArrivalProfile.rate_mixture`` in the profile's own time (cached: the planner asks for
    the same windows at every configuration; profiles hash by identity)."""
    times = profile.arrival_s
    edges = _edges(times, prefill_window_s)
    if edges is None:
        one = np.ones(1)
        return WindowSeries(prefill_window_s, one, one, one, one, np.zeros(1, dtype=np.int64),
                            (RateLevel(1.0, 1.0, 1.0),))
    num_windows = edges.size - 1
    starts = edges[:-1]
    counts = np.diff(np.searchsorted(times, edges, side="left")).astype(np.float64)
    levels_by_pool = []
    for work, window_s in ((profile.prefill_work, prefill_window_s),
                           (profile.decode_work, decode_window_s)):
        assert work is not None
        scale = float(work.mean())
        unit = work / scale
        cumulative = np.concatenate(([0.0], np.cumsum(unit)))
        tiles = _edges(times, window_s)
        if tiles is None:
            levels_by_pool.append(np.ones(num_windows))
            continue
        # The decode window is centred on the prefill window (clipped to the trace).
        centred = np.clip(starts + (prefill_window_s - window_s) / 2, 0.0,
                          times[-1] - window_s)
        levels_by_pool.append(_intensity(times, cumulative, float((unit * unit).mean()),
                                         centred, window_s, tiles.size - 1))
    prefill, decode = levels_by_pool
    weights = counts / counts.sum()  # share of requests arriving in each window
    prefill_bin = _bins(prefill, weights, PREFILL_EDGES)
    decode_bin = _bins(decode, weights, DECODE_EDGES)
    decode_values = np.ones(len(DECODE_EDGES) - 1)
    for j in range(decode_values.size):
        in_bin = decode_bin == j
        if weights[in_bin].sum() > 0:
            decode_values[j] = np.average(decode[in_bin], weights=weights[in_bin])
    levels: list[RateLevel] = []
    cells = np.zeros(num_windows, dtype=np.int64)
    for i in range(len(PREFILL_EDGES) - 1):
        for j in range(decode_values.size):
            cell = (prefill_bin == i) & (decode_bin == j)
            share = float(weights[cell].sum())
            if share > 0:
                cells[cell] = len(levels)
                levels.append(RateLevel(float(np.average(prefill[cell], weights=weights[cell])),
                                        float(decode_values[j]), share))
    assert profile.prefill_work is not None
    cumulative = np.concatenate(([0.0], np.cumsum(profile.prefill_work)))
    arrived = np.diff(cumulative[np.searchsorted(times, edges, side="left")])
    load = arrived / max(float(arrived.mean()), 1e-300)
    return WindowSeries(prefill_window_s, load, prefill, decode, weights, cells, tuple(levels))


def _bins(values: np.ndarray, weights: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """Bin index per window: windows sorted by ``values``, cut where the cumulative share of
    requests (``weights``) crosses ``edges``."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    cut = np.searchsorted(np.asarray(edges[1:-1]), cumulative - 0.5 * weights[order],
                          side="right")
    bins = np.empty(values.size, dtype=np.int64)
    bins[order] = cut
    return bins
