"""Building blocks shared by the analytic models of a disaggregated deployment
(``disaggregated``) and of the colocated baseline (``colocated``): what a model predicts
(``Prediction``), the decode batch law (size-biased step moments, the batch-size variance under
KV-balanced routing), KV-slot admission as an M/G/c queue, and TTFT/TPOT attainment and
percentiles from per-request laws. Pure functions of frozen values and arrays."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.capacity.plan_inputs import InstanceShape
from pdserve.capacity.queueing import (
    UNSTABLE,
    WaitDistribution,
    mgc_wait,
    moments,
    normal_cdf,
    poisson_pmf,
    sum_ccdf,
)
from pdserve.capacity.workload import Workload


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the model predicts at ``rate_per_s``. Latencies in seconds at the SLO percentile
    (``ttft_s``, ``tpot_s``) and as means; ``inf`` when a pool cannot keep up
    (``is_stable`` False, attainment 0)."""

    rate_per_s: float
    attainment: float
    ttft_s: float
    tpot_s: float
    mean_ttft_s: float
    mean_tpot_s: float
    mean_queue_wait_s: float
    """Mean wait for a prefill slot (disaggregated: the prefill pool; colocated: the chunk
    scheduler), over requests that prefill there."""
    mean_kv_wait_s: float
    prefill_utilization: float
    decode_batch_size: float
    """Mean running (decoding) sequences per instance."""
    num_kv_slots: int
    """Requests of the demand's length mix one instance's KV blocks hold at once."""
    local_prefill_fraction: float = 0.0
    is_stable: bool = True



def unstable_prediction(rate_per_s: float, num_kv_slots: int = 0) -> Prediction:
    return Prediction(rate_per_s=rate_per_s, attainment=0.0, ttft_s=math.inf, tpot_s=math.inf,
                      mean_ttft_s=math.inf, mean_tpot_s=math.inf, mean_queue_wait_s=math.inf,
                      mean_kv_wait_s=math.inf, prefill_utilization=math.inf,
                      decode_batch_size=math.inf, num_kv_slots=num_kv_slots, is_stable=False)


@dataclass(frozen=True, slots=True)
class KvAdmission:
    """KV slots per instance and the wait for a slot (M/G/c over ``num_instances x slots``)."""

    num_slots: int
    wait: WaitDistribution


def kv_admission(shape: InstanceShape, workload: Workload, rate_per_s: float,
                 num_instances: int, residence_s: np.ndarray) -> KvAdmission:
    """Requests hold ``ceil((l + o) / block)`` blocks for ``residence_s`` each; slots are the
    instance's blocks, less a packing loss of (p99 - mean) request blocks, over the
    residence-weighted mean blocks per request."""
    report = shape.capacity()
    blocks = np.ceil((workload.prompt + workload.output) / report.block_size_tokens)
    weights = np.maximum(residence_s, 1e-9)
    mean_blocks = max(1.0, float(np.average(blocks, weights=weights)))
    # Packing loss: a large request needs that many blocks free on one instance, so about a
    # large request's worth of blocks (beyond the mean) is unusable on average.
    usable = report.num_blocks - max(0.0, float(np.percentile(blocks, 99)) - mean_blocks)
    num_slots = int(max(0.0, usable) // mean_blocks)
    if num_slots < 1:
        return KvAdmission(0, UNSTABLE)
    mean_residence, scv = moments(residence_s)
    return KvAdmission(num_slots, mgc_wait(rate_per_s, mean_residence, scv,
                                           num_slots * num_instances))


def tpot_attainment(mean_tpot_s: float | np.ndarray, sd_s: np.ndarray, has_steps: np.ndarray,
                    tpot_slo_s: float) -> np.ndarray:
    """``P(TPOT_i <= slo)`` per request, TPOT_i normal(mean_i, sd_i); 1 for one-token outputs."""
    sd = np.maximum(sd_s, 1e-12)
    prob = normal_cdf((tpot_slo_s - mean_tpot_s) / sd)
    return np.where(has_steps, prob, 1.0)


def tpot_percentile(mean_tpot_s: float | np.ndarray, sd_s: np.ndarray, has_steps: np.ndarray,
                    percentile: float) -> float:
    """The ``percentile`` of TPOT over requests with at least one decode step."""
    mean = np.broadcast_to(np.asarray(mean_tpot_s, dtype=float), sd_s.shape)[has_steps]
    sd = np.maximum(sd_s[has_steps], 1e-12)
    if sd.size == 0:
        return 0.0
    target = percentile / 100.0
    low, high = float(mean.min()), float((mean + 10.0 * sd).max())
    for _ in range(60):
        middle = 0.5 * (low + high)
        if float(normal_cdf((middle - mean) / sd).mean()) >= target:
            high = middle
        else:
            low = middle
    return high


def batch_step_moments(grid_s: np.ndarray, mean_batch: float,
                       batch_variance: float | None = None) -> tuple[float, float]:
    """Mean and variance of the step a running sequence sees, when an instance's number of
    running sequences has mean ``mean_batch`` and variance ``batch_variance`` (default: Poisson,
    the M/G/infinity occupancy; otherwise a normal law on the integers), capped at the grid's
    largest batch. A sequence sees the size-biased batch (it is more likely to be in a large
    one): mean ``n + variance / n``, i.e. itself plus Poisson(n) others in the Poisson case."""
    cap = grid_s.size - 1
    variance = mean_batch if batch_variance is None else batch_variance
    num_terms = int(mean_batch + 12.0 * math.sqrt(max(variance, 1.0)) + 12.0)
    k = np.arange(num_terms)
    if batch_variance is None:
        pmf = poisson_pmf(mean_batch, num_terms)
    elif variance <= 1e-12:
        pmf = np.interp(k, [math.floor(mean_batch), math.floor(mean_batch) + 1],
                        [1.0 - mean_batch % 1.0, mean_batch % 1.0], left=0.0, right=0.0)
    else:
        pmf = np.exp(-0.5 * (k - mean_batch) ** 2 / variance)
    seen = pmf * k
    if float(seen.sum()) <= 0.0:  # an empty pool: a sequence would run alone
        seen = (k == 1).astype(float)
    steps = grid_s[np.minimum(k, cap)]
    total = float(seen.sum())
    mean = float((seen * steps).sum()) / total
    return mean, max(0.0, float((seen * steps * steps).sum()) / total - mean * mean)


def batch_variance(workload: Workload, mean_batch: float, num_instances: int,
                   block_size_tokens: int) -> float:
    """Variance of one instance's running-sequence count.

    The router places each request on the decode instance with the most free KV blocks, so
    blocks in use stay balanced across instances while the *count* of sequences holding them
    varies with their sizes: ``n x scv(blocks)`` (sizes weighted by time in the batch), plus
    the pool total's own Poisson fluctuation shared by ``D`` instances, ``n / D``.
    """
    blocks = np.ceil((workload.prompt + workload.output) / block_size_tokens)
    weights = np.maximum(workload.steps, 1e-9)
    _, scv = moments(blocks, weights)
    return mean_batch * (scv + 1.0 / num_instances)


@dataclass(frozen=True, slots=True)
class TtftGroup:
    """Requests (a boolean mask over the sample) whose TTFT is ``fixed_s + W1 + W2``."""

    mask: np.ndarray
    fixed_s: np.ndarray
    first: WaitDistribution
    second: WaitDistribution


def ttft_cdf(groups: Sequence[TtftGroup], x_s: float, num_samples: int) -> np.ndarray:
    """``P(TTFT_i <= x)`` per request (``[num_samples]``)."""
    prob = np.zeros(num_samples)
    for group in groups:
        prob[group.mask] = 1.0 - sum_ccdf(group.first, group.second, x_s - group.fixed_s)
    return prob


def ttft_percentile(groups: Sequence[TtftGroup], percentile: float, num_samples: int) -> float:
    target = percentile / 100.0
    low = 0.0
    high = max(float(g.fixed_s.max()) + 50.0 * (g.first.mean_given_wait_s
                                                 + g.second.mean_given_wait_s + 1e-3)
               for g in groups if g.fixed_s.size)
    for _ in range(60):
        middle = 0.5 * (low + high)
        if float(ttft_cdf(groups, middle, num_samples).mean()) >= target:
            high = middle
        else:
            low = middle
    return high
