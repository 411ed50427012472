"""The analytic model of a disaggregated deployment: SLO attainment of a ``DisaggConfig`` under a
``Demand`` (``predict``), and the local-prefill threshold that goes with it.

The model (``predict``), per request ``i`` with prompt ``l_i``, output ``o_i``, uncached prompt
tokens ``u_i = max(1, ceil(l_i (1 - prefix_hit_rate)))`` and ``m_i = o_i - 1`` decode steps (the
first token comes out of prefill):

- **Prefill pool = M/G/c.** The router sends a prompt to the prefill instance with the least
  queued work (``router.policy.choose_prefill``); each instance serves FCFS, one prompt at a time
  (as the worker agent does). Joining the server with least unfinished work makes FCFS waits
  equal to those of one central queue with ``c = num_prefill`` servers, so the pool is an M/G/c
  queue with service ``S_i = prefill_time_s([u_i])``. Its mean wait uses the Allen-Cunneen
  approximation ``Wq = (1 + scv_S) / 2 x Wq(M/M/c)`` (Erlang C), which is exact for M/M/c and,
  at ``c = 1``, is the Pollaczek-Khinchine mean ``lambda E[S^2] / (2 (1 - rho))``. For the
  percentile the wait is taken as ``0`` with probability ``1 - C`` and exponential with mean
  ``Wq / C`` otherwise (``C`` = Erlang-C probability of waiting), the usual heavy-traffic tail.
  Accuracy: Allen-Cunneen mean waits are typically within about 10% of M/G/c for ``rho >= 0.5``
  and service-time SCV <= 2 (Tijms, *A First Course in Stochastic Models*, 2003, sec. 5.6).
  Against the simulator (same routing policy, Azure conversation prompts) the mean wait agrees
  within the noise at ``c = 1``, is 5-20% low at ``c = 2-4`` and 30-40% low at ``c = 8``: the
  router ranks prefill instances by queued prompt tokens, counting the running prompt in full
  rather than what is left of it, which balances worse than least remaining work, so M/G/c is
  a lower bound there. ``bench/goodput.py`` reports the resulting TTFT error.
- **TTFT** ``= W_prefill + S_i + exposed transfer + W_kv``. KV streams layer by layer while the
  prompt computes, so only ``max(T / L, T - S_i (L - 1) / L)`` of the transfer time ``T`` shows
  (``L`` layers). ``W_kv`` is the wait for decode KV blocks (below), which the router reserves
  before prefill.
- **Decode pool.** Batch per instance from Little's law: ``n = lambda E[m] / D x step``, solved
  as a fixed point because the step a sequence sees depends on ``n``: it is the decode step at
  the *size-biased* batch (a sequence is more likely to be in a large batch; mean ``n + Var/n``),
  each sequence holding the context ``ctx`` a running sequence holds on average over its steps,
  divided by ``1 - stall`` (the fraction of time the worker prefills short prompts locally). The
  batch varies with variance ``n (scv(blocks) + 1 / D)``: the router balances free KV blocks,
  not sequence counts, so counts vary with request sizes, plus the pool total's Poisson
  fluctuation. No fixed point below the batch cap means the pool cannot keep up.
- **KV blocks.** A request holds ``ceil((l_i + o_i) / block)`` blocks (reservation for the
  prompt plus its output, as a trace replay sets ``max_tokens``) from routing to its last token,
  i.e. for ``R_i = TTFT_i + m_i x TPOT``. An instance has ``k = (num_blocks - packing loss) /
  (time-weighted mean blocks)`` slots (packing loss: p99 - mean request blocks); requests that
  find no free slot wait: another M/G/c queue with ``c = D x k`` servers and service ``R``.
- **TPOT per request** is normal: mean = the step with stalls, plus half a step (after its first
  token a sequence joins the batch at the next step boundary) spread over its ``m_i`` steps;
  spread = the step's variance under the batch law, reduced by averaging over the request's own
  steps (M/G/infinity autocorrelation ``E[(S - h)+] / E[S]``, see ``averaging_factor``), and a
  compound-Poisson number of local-prefill stalls in its window.
- **Attainment** ``= mean_i P(TTFT_i <= slo) x P(TPOT_i <= slo)`` (independent within a request).

**Local-prefill threshold.** A decode worker prefills a short prompt itself as a separate engine
pass (the worker agent does not piggyback it on a decode step), stalling its ``n`` running
sequences for ``Delta(u) = prefill_time_s([u])`` on the decode shape. Each of them loses
``Delta / m`` of TPOT, so in units of the TPOT bound the batch pays ``n Delta(u) / (E[m] x
slo.tpot_s)`` (running sequences are length-biased, so ``E[1/m]`` over them is ``1 / E[m]``).
The request itself saves, in units of the TTFT bound, ``(W_prefill + S(u) + transfer - step/2 -
Delta(u)) / slo.ttft_s``. The threshold is the largest ``u`` (in blocks of 16 tokens) where the
saving covers the cost; it grows when the prefill queue is long and shrinks with the decode
batch. It is kept only if the predicted attainment with it stays at the target (or, below the
target, does not drop): the stalls must fit in the TPOT budget. The router compares it with
the prompt's uncached tokens (``RoutingConfig.local_prefill_threshold_tokens``).

Everything here is a pure function of frozen values: no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.capacity.arrival_process import WindowSeries
from pdserve.capacity.latency_model import (
    Prediction,
    TtftGroup,
    batch_step_moments,
    batch_variance,
    kv_admission,
    tpot_attainment,
    tpot_percentile,
    ttft_cdf,
    ttft_percentile,
    unstable_prediction,
)
from pdserve.capacity.plan_inputs import Demand, DisaggConfig, Slo
from pdserve.capacity.queueing import NO_WAIT, mgc_wait, moments, smallest_fixed_point
from pdserve.capacity.workload import (
    Workload,
    averaging_factor,
    decode_step_grid_s,
    prefill_times_s,
    transfer_exposed_s,
)

THRESHOLD_STEP_TOKENS = 16
"""Granularity of the local-prefill threshold (one KV block of the default size)."""

MAX_THRESHOLD_TOKENS = 4096
"""Largest local-prefill threshold considered."""


@dataclass(frozen=True, slots=True)
class _DecodeState:
    batch: float
    """Mean running sequences per instance."""
    step_s: float
    """Mean decode step a running sequence sees."""
    step_var_s2: float
    mean_tpot_s: float
    """Mean time per token including local-prefill stalls."""
    stall_fraction: float
    stall_rate_per_s: float
    stall_second_moment_s2: float


def _decode_state(config: DisaggConfig, workload: Workload, rate_per_s: float,
                  local: np.ndarray, local_prefill_s: np.ndarray) -> _DecodeState | None:
    num_decode = config.num_decode
    token_rate = rate_per_s * float(workload.steps.mean()) / num_decode
    grid = decode_step_grid_s(config.decode, workload)
    stall_rate = rate_per_s * float(local.mean()) / num_decode
    stall_mean = float(local_prefill_s[local].mean()) if local.any() else 0.0
    stall_fraction = stall_rate * stall_mean
    if stall_fraction >= 1.0:
        return None

    block_size = config.decode.block_size_tokens

    def excess(batch: float) -> float:
        variance = batch_variance(workload, batch, num_decode, block_size)
        step = batch_step_moments(grid, batch, variance)[0]
        return token_rate * step / (1.0 - stall_fraction) - batch

    batch = smallest_fixed_point(excess, float(config.decode.max_batch_size))
    if batch is None:
        return None
    variance = batch_variance(workload, batch, num_decode, config.decode.block_size_tokens)
    step, step_var = batch_step_moments(grid, batch, variance)
    second = float((local_prefill_s[local] ** 2).mean()) if local.any() else 0.0
    return _DecodeState(batch=batch, step_s=step, step_var_s2=step_var,
                        mean_tpot_s=step / (1.0 - stall_fraction), stall_fraction=stall_fraction,
                        stall_rate_per_s=stall_rate, stall_second_moment_s2=second)


def _tpot_moments(state: _DecodeState, workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """Per-request TPOT mean and spread (``[num_samples]``, seconds).

    Mean: the mean step with stalls, plus half a step once per request (after its first token
    a sequence joins the batch at the next step boundary). Spread: the batch fluctuation
    averaged over the request's steps, and a compound-Poisson number of local-prefill stalls
    in its window.
    """
    steps = np.maximum(workload.steps, 1.0)
    mean = state.mean_tpot_s * (1.0 + 0.5 / steps)
    batch_sd = np.sqrt(state.step_var_s2 * averaging_factor(workload)) / (
        1.0 - state.stall_fraction)
    window = steps * state.mean_tpot_s
    stall_sd = np.sqrt(state.stall_rate_per_s * window * state.stall_second_moment_s2) / steps
    return mean, np.sqrt(batch_sd ** 2 + stall_sd ** 2)


def predict(config: DisaggConfig, demand: Demand, slo: Slo) -> Prediction:
    """The analytic prediction for ``config`` under ``demand`` (module docstring)."""
    return predict_workload(config, Workload.of(demand), demand.rate_per_s, slo)


def predict_workload(config: DisaggConfig, workload: Workload, rate_per_s: float, slo: Slo,
                     with_percentiles: bool = True,
                     decode_rate_per_s: float | None = None) -> Prediction:
    """``predict`` for a workload already built, at ``rate_per_s``; without percentiles (NaN
    then) it is the cheap form the planner's searches evaluate many times.
    ``decode_rate_per_s`` (default ``rate_per_s``) is the rate the decode pool sees, which
    differs from the prefill pool's during a burst (``arrival_process``)."""
    evaluated = _evaluate(config, workload, rate_per_s, slo, decode_rate_per_s)
    if evaluated.groups is None or not with_percentiles:
        return evaluated.prediction
    return dataclasses.replace(
        evaluated.prediction,
        ttft_s=ttft_percentile(evaluated.groups, slo.percentile, workload.size),
        tpot_s=tpot_percentile(evaluated.tpot_mean, evaluated.tpot_sd, evaluated.has_steps,
                               slo.percentile))


def predict_mixture(config: DisaggConfig, workload: Workload, rate_per_s: float,
                    series: WindowSeries, slo: Slo, with_percentiles: bool = True) -> Prediction:
    """The prediction for arrivals at mean rate ``rate_per_s`` that arrive as ``series``
    (``arrival_process``): attainment by ``series_attainment``; percentiles over the mixture of
    the series' levels, each by the stationary model (a level the prefill pool cannot keep up
    with counts as infinitely late there). The means, utilisation and batch reported are the
    mean rate's (what an operator would watch on average)."""
    at_mean = predict_workload(config, workload, rate_per_s, slo, with_percentiles=False)
    attainment = series_attainment(config, workload, rate_per_s, series, slo)
    ttft_p = tpot_p = math.nan
    if with_percentiles:
        cache: dict[float, _DecodeState | None] = {}
        parts = [(level.share, _evaluate(config, workload, rate_per_s * level.prefill_factor,
                                         slo, rate_per_s * level.decode_factor, cache))
                 for level in series.levels]
        stable = [(share, part) for share, part in parts if part.groups is not None]
        ttft_p = _mixture_percentile(stable, slo.percentile, lambda part, x: float(
            ttft_cdf(part.groups or [], x, workload.size).mean()), 600.0)
        tpot_p = _mixture_percentile(stable, slo.percentile, lambda part, x: float(
            tpot_attainment(part.tpot_mean, part.tpot_sd, part.has_steps, x)[
                part.has_steps].mean()) if part.has_steps.any() else 1.0, 10.0)
    return dataclasses.replace(at_mean, attainment=attainment, ttft_s=ttft_p, tpot_s=tpot_p)


def series_attainment(config: DisaggConfig, workload: Workload, rate_per_s: float,
                      series: WindowSeries, slo: Slo) -> float:
    """SLO attainment of arrivals at mean rate ``rate_per_s`` arriving as ``series``.

    Calm windows: the stationary model at the window's level (pointwise stationary
    approximation, ``arrival_process``). Congested windows (the prefill pool is overloaded in
    it, or still works off the backlog an earlier one left): the fluid approximation of the
    prefill queue across windows, ``B_{k+1} = max(0, B_k + (rho_k - 1) x window)`` (Lindley's
    recursion on the work in seconds per instance; ``rho_k`` the utilisation the work that
    arrived in the window would cause, ``WindowSeries.prefill_load``), a
    request in window ``k`` waiting ``B_k + (rho_k - 1) x window / 2`` on average and meeting
    TTFT when that wait plus its own prefill and transfer fits in the bound; its TPOT as at the
    window's decode level. The fluid part ignores the random wait on top of the backlog (the
    backlog dominates there) and the wait for KV room."""
    cache: dict[float, _DecodeState | None] = {}
    evaluations = [_evaluate(config, workload, rate_per_s * level.prefill_factor, slo,
                             rate_per_s * level.decode_factor, cache) for level in series.levels]
    stationary = np.array([e.prediction.attainment for e in evaluations])
    attained = stationary[series.cell]
    remote = workload.uncached > config.local_prefill_threshold_tokens
    if not remote.any():
        return float(np.dot(series.share, attained))
    prefill_s = prefill_times_s(config.prefill, workload)
    mean_utilization = (rate_per_s * float(remote.mean()) * float(prefill_s[remote].mean())
                        / config.num_prefill)
    utilization = mean_utilization * series.prefill_load
    growth_s = (utilization - 1.0) * series.window_s
    before = np.concatenate(([0.0], np.cumsum(growth_s)[:-1]))
    backlog_s = before - np.minimum(0.0, np.minimum.accumulate(before))
    wait_s = np.maximum(0.0, backlog_s + growth_s / 2.0)
    congested = (utilization >= 1.0) | (backlog_s > CONGESTED_BACKLOG_SLOS * slo.ttft_s)
    if not congested.any():
        return float(np.dot(series.share, attained))
    fixed = np.sort((prefill_s + transfer_exposed_s(config.prefill, workload, prefill_s))[remote])
    remote_share = float(remote.mean())
    ttft_ok = (remote_share * np.searchsorted(fixed, slo.ttft_s - wait_s[congested],
                                              side="right") / fixed.size + (1.0 - remote_share))
    tpot_by_level = np.array([_tpot_ok(cache.get(rate_per_s * level.decode_factor), workload,
                                       slo) for level in series.levels])
    attained = attained.copy()
    attained[congested] = ttft_ok * tpot_by_level[series.cell[congested]]
    return float(np.dot(series.share, attained))


CONGESTED_BACKLOG_SLOS = 0.05
"""A window whose fluid backlog exceeds this share of the TTFT bound is congested."""


def _tpot_ok(decode: _DecodeState | None, workload: Workload, slo: Slo) -> float:
    """Mean ``P(TPOT_i <= slo)`` at a decode state (0 if the pool cannot keep up)."""
    if decode is None:
        return 0.0
    tpot_mean, tpot_sd = _tpot_moments(decode, workload)
    return float(tpot_attainment(tpot_mean, tpot_sd, workload.steps > 0, slo.tpot_s).mean())


def _mixture_percentile(parts: Sequence[tuple[float, _Evaluated]], percentile: float,
                        cdf: Callable[[_Evaluated, float], float], high_s: float) -> float:
    """The ``percentile`` of a mixture of laws (unstable parts count as infinitely late):
    bisection on the mixture's CDF up to ``high_s``; ``inf`` beyond it."""
    target = percentile / 100.0

    def mixed(x: float) -> float:
        return sum(share * cdf(part, x) for share, part in parts)

    if mixed(high_s) < target:
        return math.inf
    low, high = 0.0, high_s
    for _ in range(50):
        middle = 0.5 * (low + high)
        if mixed(middle) >= target:
            high = middle
        else:
            low = middle
    return high


@dataclass(frozen=True, slots=True)
class _Evaluated:
    """One stationary evaluation: the prediction without percentiles, and (stable only) the
    per-request laws percentiles are read from."""

    prediction: Prediction
    groups: list[TtftGroup] | None = None
    tpot_mean: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    tpot_sd: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    has_steps: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=bool))


def _evaluate(config: DisaggConfig, workload: Workload, rate_per_s: float, slo: Slo,
              decode_rate_per_s: float | None = None,
              decode_cache: dict[float, _DecodeState | None] | None = None) -> _Evaluated:
    """The stationary model at ``rate_per_s`` (prefill) and ``decode_rate_per_s`` (decode);
    ``decode_cache`` shares decode states between evaluations at the same decode rate."""
    decode_rate = rate_per_s if decode_rate_per_s is None else decode_rate_per_s
    threshold = config.local_prefill_threshold_tokens
    local = workload.uncached <= threshold
    remote = ~local
    prefill_s = prefill_times_s(config.prefill, workload)
    local_prefill_s = prefill_times_s(config.decode, workload)
    mean_service, scv = moments(prefill_s[remote])
    remote_rate = rate_per_s * float(remote.mean())
    prefill_wait = mgc_wait(remote_rate, mean_service, scv, config.num_prefill)
    if decode_cache is not None and decode_rate in decode_cache:
        decode = decode_cache[decode_rate]
    else:
        decode = _decode_state(config, workload, decode_rate, local, local_prefill_s)
        if decode_cache is not None:
            decode_cache[decode_rate] = decode
    if decode is None or not prefill_wait.is_stable:
        return _Evaluated(unstable_prediction(rate_per_s))
    transfer_s = transfer_exposed_s(config.prefill, workload, prefill_s)
    fixed = np.where(remote, prefill_s + transfer_s, decode.step_s / 2.0 + local_prefill_s)
    queue_mean = np.where(remote, prefill_wait.mean_s, 0.0)
    residence = fixed + queue_mean + workload.steps * decode.mean_tpot_s
    kv = kv_admission(config.decode, workload, decode_rate, config.num_decode, residence)
    if not kv.wait.is_stable:
        return _Evaluated(unstable_prediction(rate_per_s, kv.num_slots))
    groups = [TtftGroup(remote, fixed[remote], prefill_wait, kv.wait),
              TtftGroup(local, fixed[local], NO_WAIT, kv.wait)]
    has_steps = workload.steps > 0
    tpot_mean, tpot_sd = _tpot_moments(decode, workload)
    ttft_ok = ttft_cdf(groups, slo.ttft_s, workload.size)
    tpot_ok = tpot_attainment(tpot_mean, tpot_sd, has_steps, slo.tpot_s)
    attainment = float((ttft_ok * tpot_ok).mean())
    prediction = Prediction(
        rate_per_s=rate_per_s,
        attainment=attainment,
        ttft_s=math.nan,
        tpot_s=math.nan,
        mean_ttft_s=float((fixed + queue_mean).mean()) + kv.wait.mean_s,
        mean_tpot_s=float(tpot_mean[has_steps].mean()) if has_steps.any() else 0.0,
        mean_queue_wait_s=prefill_wait.mean_s,
        mean_kv_wait_s=kv.wait.mean_s,
        prefill_utilization=remote_rate * mean_service / config.num_prefill,
        decode_batch_size=decode.batch,
        num_kv_slots=kv.num_slots,
        local_prefill_fraction=float(local.mean()),
    )
    return _Evaluated(prediction, groups, tpot_mean, tpot_sd, has_steps)


# -- local-prefill threshold -------------------------------------------------------------------


def local_prefill_threshold_tokens(config: DisaggConfig, demand: Demand, slo: Slo) -> int:
    """The local-prefill threshold (uncached prompt tokens) for ``config`` under ``demand``
    (module docstring: stall cost to the batch vs TTFT saved, each in units of its SLO)."""
    return _threshold(config, Workload.of(demand), demand.rate_per_s, slo)


def _threshold(config: DisaggConfig, workload: Workload, rate_per_s: float, slo: Slo) -> int:
    base_config = dataclasses.replace(config, local_prefill_threshold_tokens=0)
    base = predict_workload(base_config, workload, rate_per_s, slo, with_percentiles=False)
    if not base.is_stable:
        return 0
    prefill_perf, decode_perf = config.prefill.perf(), config.decode.perf()
    mean_steps = max(1.0, float(workload.steps.mean()))
    step_s = batch_step_moments(decode_step_grid_s(config.decode, workload),
                                base.decode_batch_size)[0]
    best = 0
    for tokens in range(THRESHOLD_STEP_TOKENS, MAX_THRESHOLD_TOKENS + 1, THRESHOLD_STEP_TOKENS):
        stall_s = decode_perf.prefill_time_s([tokens])
        cost = base.decode_batch_size * stall_s / (mean_steps * slo.tpot_s)
        remote_s = base.mean_queue_wait_s + prefill_perf.prefill_time_s([tokens]) + (
            prefill_perf.kv_transfer_time_s(tokens) / prefill_perf.model.num_layers)
        saving = (remote_s - step_s / 2.0 - stall_s) / slo.ttft_s
        if cost <= saving:
            best = tokens
        elif saving < 0:
            break
    if best == 0:
        return 0
    with_best = dataclasses.replace(config, local_prefill_threshold_tokens=best)
    kept = predict_workload(with_best, workload, rate_per_s, slo, with_percentiles=False)
    floor = min(base.attainment, slo.attainment_target)
    return best if kept.attainment >= floor else 0


def with_threshold(config: DisaggConfig, workload: Workload, rate_per_s: float,
                   slo: Slo) -> DisaggConfig:
    """``config`` with the local-prefill threshold derived for it at ``rate_per_s``."""
    return dataclasses.replace(config, local_prefill_threshold_tokens=_threshold(
        dataclasses.replace(config, local_prefill_threshold_tokens=0), workload, rate_per_s, slo))

