"""Queueing and probability formulas the latency models are built from: M/G/c waits (Erlang C
with the Allen-Cunneen correction), the law of a sum of two such waits, the normal CDF, sample
moments, the Poisson law and a fixed-point search. Pure functions of numbers and arrays."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdserve.common.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class WaitDistribution:
    """A queueing delay ``W``: 0 with probability ``1 - prob_wait``, else exponential with mean
    ``mean_given_wait_s``. An unstable queue has ``prob_wait`` 1 and an infinite mean."""

    prob_wait: float
    mean_given_wait_s: float

    @property
    def mean_s(self) -> float:
        return self.prob_wait * self.mean_given_wait_s if self.prob_wait > 0 else 0.0

    @property
    def is_stable(self) -> bool:
        return math.isfinite(self.mean_given_wait_s)

    def ccdf(self, t_s: np.ndarray) -> np.ndarray:
        """``P(W > t)`` elementwise."""
        t_s = np.asarray(t_s, dtype=float)
        if not self.is_stable:
            return np.ones_like(t_s)
        if self.prob_wait <= 0.0 or self.mean_given_wait_s <= 0.0:
            return (t_s < 0).astype(float)
        tail = self.prob_wait * np.exp(-np.maximum(t_s, 0.0) / self.mean_given_wait_s)
        return np.where(t_s < 0, 1.0, tail)


NO_WAIT = WaitDistribution(0.0, 0.0)
UNSTABLE = WaitDistribution(1.0, math.inf)


def erlang_c(num_servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in M/M/c with ``c = num_servers`` and offered load
    ``a = lambda E[S]`` (Erlangs); 1 when ``a >= c``. Uses the stable Erlang-B recursion."""
    if num_servers < 1:
        raise InvalidArgumentError(f"num_servers must be >= 1, got {num_servers}",
                                   field="num_servers")
    if offered_load <= 0.0:
        return 0.0
    if offered_load >= num_servers:
        return 1.0
    blocking = 1.0
    for k in range(1, num_servers + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
        if blocking < 1e-18 and k > offered_load:
            # Past the load, B(k) only falls (by a factor a / k per server): waiting is
            # negligible. Stopping here keeps pools of thousands of KV slots cheap.
            break
    rho = offered_load / num_servers
    return blocking / (1.0 - rho * (1.0 - blocking))


def mgc_wait(arrival_rate_per_s: float, mean_service_s: float, service_scv: float,
             num_servers: int) -> WaitDistribution:
    """Waiting time in an M/G/c FCFS queue (Allen-Cunneen mean, exponential conditional tail).

    ``service_scv`` is the squared coefficient of variation of the service time. Returns
    ``UNSTABLE`` when the utilisation ``lambda E[S] / c`` reaches 1.
    """
    offered = arrival_rate_per_s * mean_service_s
    if offered <= 0.0:
        return NO_WAIT
    if offered >= num_servers:
        return UNSTABLE
    prob_wait = erlang_c(num_servers, offered)
    mean_given_wait = (1.0 + service_scv) / 2.0 * mean_service_s / (num_servers - offered)
    return WaitDistribution(prob_wait, mean_given_wait)


def sum_ccdf(first: WaitDistribution, second: WaitDistribution, t_s: np.ndarray) -> np.ndarray:
    """``P(W1 + W2 > t)`` for independent waits (exact for the two-part form above)."""
    t_s = np.asarray(t_s, dtype=float)
    if not (first.is_stable and second.is_stable):
        return np.ones_like(t_s)
    p1, p2 = first.prob_wait, second.prob_wait
    if p1 <= 0.0 or first.mean_given_wait_s <= 0.0:
        return second.ccdf(t_s)
    if p2 <= 0.0 or second.mean_given_wait_s <= 0.0:
        return first.ccdf(t_s)
    m1, m2 = first.mean_given_wait_s, second.mean_given_wait_s
    t = np.maximum(t_s, 0.0)
    e1, e2 = np.exp(-t / m1), np.exp(-t / m2)
    if abs(m1 - m2) <= 1e-12 * max(m1, m2):
        both = (1.0 + t / m1) * e1
    else:
        both = (m1 * e1 - m2 * e2) / (m1 - m2)
    tail = p1 * (1 - p2) * e1 + (1 - p1) * p2 * e2 + p1 * p2 * both
    return np.where(t_s < 0, 1.0, tail)


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF elementwise (Abramowitz & Stegun 7.1.26, absolute error < 1.5e-7)."""
    x = np.asarray(x, dtype=float)
    z = np.abs(x) / math.sqrt(2.0)
    k = 1.0 / (1.0 + 0.3275911 * z)
    poly = k * (0.254829592 + k * (-0.284496736 + k * (1.421413741 + k * (-1.453152027
                                                                          + k * 1.061405429))))
    erf = 1.0 - poly * np.exp(-z * z)
    return 0.5 * (1.0 + np.sign(x) * erf)


def moments(values: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, float]:
    """Mean and squared coefficient of variation of a sample (optionally weighted)."""
    if values.size == 0:
        return 0.0, 0.0
    mean = float(np.average(values, weights=weights))
    if mean <= 0.0:
        return mean, 0.0
    second = float(np.average(values * values, weights=weights))
    return mean, max(0.0, second / (mean * mean) - 1.0)



def poisson_pmf(mean: float, num_terms: int) -> np.ndarray:
    """``P(N = k)`` for ``k < num_terms``, ``N ~ Poisson(mean)``."""
    k = np.arange(num_terms, dtype=float)
    if mean <= 0.0:
        return (k == 0).astype(float)
    log_pmf = -mean + np.concatenate(([0.0], np.cumsum(math.log(mean) - np.log(k[1:]))))
    return np.exp(log_pmf)



def smallest_fixed_point(excess: Callable[[float], float], upper: float) -> float | None:
    """Smallest ``n`` in ``[0, upper]`` with ``excess(n) <= 0``, where ``excess(0) >= 0``.

    ``excess(n)`` is (the batch the load implies when the batch is ``n``) minus ``n``; it is
    convex in ``n`` for a roofline step time, so it crosses zero at most twice: scan a grid for
    the first crossing, then bisect. ``None`` if there is none (the pool cannot keep up).
    """
    if excess(0.0) <= 0.0:
        return 0.0
    grid = np.linspace(0.0, upper, 65)
    previous = 0.0
    for point in grid[1:]:
        if excess(float(point)) <= 0.0:
            low, high = previous, float(point)
            for _ in range(40):
                middle = 0.5 * (low + high)
                if excess(middle) <= 0.0:
                    high = middle
                else:
                    low = middle
            return high
        previous = float(point)
    return None
