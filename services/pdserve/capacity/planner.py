"""SLO planner for disaggregated serving: how many prefill and decode instances a demand needs.

Inputs are values: a ``Demand`` (arrival rate, paired prompt/output length samples, prefix-hit
rate), an ``Slo`` (TTFT and TPOT bounds at a percentile) and ``InstanceShape``s (model, GPU, TP,
engine settings) for each pool. ``plan`` returns the cheapest ``DisaggConfig`` (fewest GPUs)
whose predicted SLO attainment -- the fraction of requests meeting *both* bounds -- reaches the
percentile, with the local-prefill threshold that goes with it and its goodput per GPU.

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

**Goodput** (DistServe, OSDI'24): the highest arrival rate at which at least the target fraction
(90%) of requests meet both SLOs, divided by the GPUs; ``max_rate`` finds it by bisection over
the rate, for this analytic model or any other attainment function (e.g. the simulator's).

Everything here is a pure function of frozen values: no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import get_gpu, get_model
from pdserve.perf.kv_budget import CapacityConfig, CapacityReport, capacity_report
from pdserve.perf.perf_model import PerfModel, perf_model_for

MAX_SAMPLES = 4096
"""Length samples the model evaluates (a trace is subsampled evenly to this many)."""

THRESHOLD_STEP_TOKENS = 16
"""Granularity of the local-prefill threshold (one KV block of the default size)."""

MAX_THRESHOLD_TOKENS = 4096
"""Largest local-prefill threshold considered."""


# -- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Demand:
    """What arrives: Poisson arrivals at ``rate_per_s``; request ``i`` of the sample has
    ``prompt_tokens[i]`` prompt and ``output_tokens[i]`` output tokens (pairs, e.g. trace rows).

    ``prefix_hit_rate`` is the fraction of prompt tokens found in a prefix cache, in [0, 1).
    """

    rate_per_s: float
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    prefix_hit_rate: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rate_per_s >= 0.0 and math.isfinite(self.rate_per_s)):
            raise InvalidArgumentError(
                f"rate_per_s must be a finite number >= 0, got {self.rate_per_s}", field="rate")
        if not self.prompt_tokens or len(self.prompt_tokens) != len(self.output_tokens):
            raise InvalidArgumentError(
                f"need the same non-zero number of prompt and output lengths, got "
                f"{len(self.prompt_tokens)} and {len(self.output_tokens)}", field="lengths")
        if min(self.prompt_tokens) < 1 or min(self.output_tokens) < 1:
            raise InvalidArgumentError("prompt and output lengths must be >= 1 token",
                                       field="lengths")
        if not 0.0 <= self.prefix_hit_rate < 1.0:
            raise InvalidArgumentError(
                f"prefix_hit_rate must be in [0, 1), got {self.prefix_hit_rate}",
                field="prefix_hit_rate")

    @classmethod
    def from_means(cls, rate_per_s: float, mean_prompt_tokens: float, mean_output_tokens: float,
                   prefix_hit_rate: float = 0.0, num_points: int = 256) -> Demand:
        """Lengths known only by their means: taken as exponential (the maximum-entropy law of
        a positive quantity with a given mean; real chat traces have a coefficient of variation
        near 1), as ``num_points`` evenly spaced quantiles, prompt and output independent."""
        if not (mean_prompt_tokens >= 1 and mean_output_tokens >= 1):
            raise InvalidArgumentError(
                f"mean lengths must be >= 1 token, got {mean_prompt_tokens} and "
                f"{mean_output_tokens}", field="lengths")
        quantiles = (np.arange(num_points) + 0.5) / num_points
        shape = -np.log1p(-quantiles)
        prompts = np.maximum(1, np.rint(shape * mean_prompt_tokens)).astype(int)
        outputs = np.maximum(1, np.rint(shape * mean_output_tokens)).astype(int)
        # Pair prompt quantile k with output quantile (k x stride) mod N: independent lengths.
        stride = next(s for s in range(num_points // 2 + 1, num_points) if math.gcd(s, num_points)
                      == 1) if num_points > 2 else 1
        outputs = outputs[(np.arange(num_points) * stride) % num_points]
        return cls(rate_per_s, tuple(int(x) for x in prompts), tuple(int(x) for x in outputs),
                   prefix_hit_rate)

    def with_rate(self, rate_per_s: float) -> Demand:
        return dataclasses.replace(self, rate_per_s=rate_per_s)

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(self.prompt_tokens) / len(self.prompt_tokens)

    @property
    def mean_output_tokens(self) -> float:
        return sum(self.output_tokens) / len(self.output_tokens)


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency bounds: TTFT and TPOT (mean time per output token after the first), both met by
    at least ``percentile`` percent of requests (DistServe's goodput uses 90)."""

    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise InvalidArgumentError(
                f"SLO bounds must be > 0, got ttft {self.ttft_s} s and tpot {self.tpot_s} s",
                field="slo")
        if not 0.0 < self.percentile < 100.0:
            raise InvalidArgumentError(
                f"percentile must be in (0, 100), got {self.percentile}", field="percentile")

    @property
    def attainment_target(self) -> float:
        return self.percentile / 100.0


@dataclass(frozen=True, slots=True)
class InstanceShape:
    """One engine instance: ``model`` on ``tp_size`` GPUs of type ``gpu`` (catalog names), with
    the engine settings capacity depends on. ``max_batch_size`` caps running sequences."""

    model: str
    gpu: str
    tp_size: int
    block_size_tokens: int = 16
    gpu_memory_utilization: float = 0.9
    max_batch_size: int = 256

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise InvalidArgumentError(
                f"max_batch_size must be >= 1, got {self.max_batch_size}", field="max_batch_size")

    def perf(self) -> PerfModel:
        """The calibrated performance model (cached per shape)."""
        return _perf_for(self.model, self.gpu, self.tp_size)

    def capacity(self) -> CapacityReport:
        """KV capacity; raises ``InvalidArgumentError`` for an unknown name, a TP that cannot
        shard the model, or a model that does not fit."""
        return _capacity_for(self)

    def check(self) -> None:
        """Raise ``InvalidArgumentError`` unless the shape is usable (see ``capacity``)."""
        self.capacity()


@functools.cache
def _perf_for(model: str, gpu: str, tp_size: int) -> PerfModel:
    return perf_model_for(model, gpu, tp_size)


@functools.cache
def _capacity_for(shape: InstanceShape) -> CapacityReport:
    config = CapacityConfig(tp_size=shape.tp_size, block_size_tokens=shape.block_size_tokens,
                            gpu_memory_utilization=shape.gpu_memory_utilization)
    return capacity_report(get_model(shape.model), get_gpu(shape.gpu), config)


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """A disaggregated deployment: ``num_prefill`` prefill and ``num_decode`` decode instances."""

    prefill: InstanceShape
    decode: InstanceShape
    num_prefill: int
    num_decode: int
    local_prefill_threshold_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise InvalidArgumentError(
                f"need >= 1 instance per pool, got {self.num_prefill} prefill and "
                f"{self.num_decode} decode", field="num_instances")

    @property
    def num_prefill_gpus(self) -> int:
        return self.num_prefill * self.prefill.tp_size

    @property
    def num_decode_gpus(self) -> int:
        return self.num_decode * self.decode.tp_size

    @property
    def num_gpus(self) -> int:
        return self.num_prefill_gpus + self.num_decode_gpus

    @property
    def pd_ratio(self) -> float:
        """Prefill GPUs per decode GPU."""
        return self.num_prefill_gpus / self.num_decode_gpus


# -- outputs -----------------------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's answer: the cheapest configuration meeting the SLO at the demand's rate,
    its prediction there, and its goodput (requests/s at ``slo.percentile`` attainment)."""

    config: DisaggConfig
    prediction: Prediction
    goodput_rate_per_s: float
    goodput_per_gpu: float


# -- queueing ----------------------------------------------------------------------------------


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


# -- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """A demand's length sample as arrays (``[num_samples]``), subsampled to ``MAX_SAMPLES``.

    ``uncached`` = prompt tokens prefill computes; ``steps`` = decode steps (output - 1).
    ``key`` identifies the sample for caches.
    """

    prompt: np.ndarray
    output: np.ndarray
    uncached: np.ndarray
    steps: np.ndarray
    key: str
    _prefill_s: dict[tuple[str, str, int], np.ndarray] = dataclasses.field(
        default_factory=dict, repr=False)
    _grids: dict[tuple[object, ...], np.ndarray] = dataclasses.field(
        default_factory=dict, repr=False)

    @classmethod
    def of(cls, demand: Demand) -> Workload:
        return _workload(demand.prompt_tokens, demand.output_tokens, demand.prefix_hit_rate)

    @property
    def size(self) -> int:
        return int(self.prompt.size)


@functools.lru_cache(maxsize=16)
def _workload(prompt_tokens: tuple[int, ...], output_tokens: tuple[int, ...],
              prefix_hit_rate: float) -> Workload:
    prompt = np.asarray(prompt_tokens, dtype=float)
    output = np.asarray(output_tokens, dtype=float)
    if prompt.size > MAX_SAMPLES:
        index = np.linspace(0, prompt.size - 1, MAX_SAMPLES).round().astype(int)
        prompt, output = prompt[index], output[index]
    uncached = np.maximum(1.0, np.ceil(prompt * (1.0 - prefix_hit_rate)))
    digest = hashlib.blake2b(prompt.tobytes() + output.tobytes()
                             + repr(prefix_hit_rate).encode(), digest_size=12).hexdigest()
    return Workload(prompt=prompt, output=output, uncached=uncached,
                    steps=np.maximum(output - 1.0, 0.0), key=digest)


def prefill_times_s(shape: InstanceShape, workload: Workload) -> np.ndarray:
    """``prefill_time_s([u_i])`` on ``shape`` for every sample (cached on the workload)."""
    key = (shape.model, shape.gpu, shape.tp_size)
    times = workload._prefill_s.get(key)
    if times is None:
        perf = shape.perf()
        values = np.unique(workload.uncached)
        by_value = np.array([perf.prefill_time_s([int(v)]) for v in values])
        times = by_value[np.searchsorted(values, workload.uncached)]
        workload._prefill_s[key] = times
    return times


def transfer_exposed_s(shape: InstanceShape, workload: Workload,
                       prefill_s: np.ndarray) -> np.ndarray:
    """Transfer time left after layer-by-layer streaming: layer ``l`` moves once it is computed,
    so the last layer lands ``max(T / L, T - S (L - 1) / L)`` after compute ends (``T`` the
    whole prompt's transfer time, ``S`` the prefill time, ``L`` layers)."""
    perf = shape.perf()
    layers = perf.model.num_layers
    total = perf.kv_bytes_per_token_per_gpu * workload.prompt / perf.gpu.nic_bytes_per_s
    return np.maximum(total / layers, total - prefill_s * (layers - 1) / layers)


# -- decode pool -------------------------------------------------------------------------------


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


def context_per_sequence(workload: Workload, mask: np.ndarray | None = None) -> float:
    """Mean context (tokens) a decoding sequence holds, averaged over decode steps: request
    ``i`` contributes ``m_i`` steps at mean context ``l_i + 1 + m_i / 2``."""
    steps = workload.steps if mask is None else workload.steps[mask]
    prompt = workload.prompt if mask is None else workload.prompt[mask]
    total = float(steps.sum())
    if total <= 0.0:
        return float(prompt.mean()) if prompt.size else 0.0
    return float((steps * (prompt + 1.0 + steps / 2.0)).sum() / total)


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


def poisson_pmf(mean: float, num_terms: int) -> np.ndarray:
    """``P(N = k)`` for ``k < num_terms``, ``N ~ Poisson(mean)``."""
    k = np.arange(num_terms, dtype=float)
    if mean <= 0.0:
        return (k == 0).astype(float)
    log_pmf = -mean + np.concatenate(([0.0], np.cumsum(math.log(mean) - np.log(k[1:]))))
    return np.exp(log_pmf)


def decode_step_grid_s(shape: InstanceShape, workload: Workload) -> np.ndarray:
    """Decode step time at batch ``b`` for ``b = 0 .. max_batch_size`` (``[cap + 1]``), each
    sequence holding the workload's mean context; entry 0 is the step of a near-empty batch.
    Cached on the workload."""
    key = ("decode-grid", shape.model, shape.gpu, shape.tp_size, shape.max_batch_size)
    grid = workload._grids.get(key)
    if grid is None:
        perf = shape.perf()
        context = context_per_sequence(workload)
        grid = np.array([_decode_step_s(perf, float(b), context)
                         for b in range(shape.max_batch_size + 1)])
        workload._grids[key] = grid
    return grid


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


def averaging_factor(workload: Workload) -> np.ndarray:
    """Per request, the variance of the batch size averaged over the request's own ``m_i``
    steps, relative to the variance at one instant (``[num_samples]``, in (0, 1]).

    The occupancy of an M/G/infinity system has autocorrelation ``rho(h) = E[(S - h)+] / E[S]``
    (``S`` = time in the batch, here in steps); averaging over a window ``L`` leaves
    ``(2 / L^2) int_0^L (L - h) rho(h) dh`` of the variance. Short outputs see the full
    variance, outputs much longer than a typical stay see little. Cached on the workload.
    """
    key = ("averaging",)
    cached = workload._grids.get(key)
    if cached is not None:
        return cached
    stays = np.sort(workload.steps[workload.steps > 0])
    if stays.size == 0:
        factor = np.ones(workload.size)
    else:
        h = np.linspace(0.0, float(stays[-1]), 513)
        tail_sum = np.concatenate((np.cumsum(stays[::-1])[::-1], [0.0]))
        above = np.searchsorted(stays, h, side="right")
        excess = (tail_sum[above] - h * (stays.size - above)) / stays.size
        rho = excess / float(stays.mean())
        dh = np.diff(h)
        first = np.concatenate(([0.0], np.cumsum(0.5 * (rho[1:] + rho[:-1]) * dh)))
        second = np.concatenate(([0.0], np.cumsum(0.5 * (h[1:] * rho[1:] + h[:-1] * rho[:-1])
                                                   * dh)))
        window = np.maximum(workload.steps, 1.0)
        i1 = np.interp(window, h, first, right=first[-1])
        i2 = np.interp(window, h, second, right=second[-1])
        factor = np.clip(2.0 * (window * i1 - i2) / (window * window), 0.0, 1.0)
    workload._grids[key] = factor
    return factor


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


def unstable_prediction(rate_per_s: float, num_kv_slots: int = 0) -> Prediction:
    return Prediction(rate_per_s=rate_per_s, attainment=0.0, ttft_s=math.inf, tpot_s=math.inf,
                      mean_ttft_s=math.inf, mean_tpot_s=math.inf, mean_queue_wait_s=math.inf,
                      mean_kv_wait_s=math.inf, prefill_utilization=math.inf,
                      decode_batch_size=math.inf, num_kv_slots=num_kv_slots, is_stable=False)


def _decode_step_s(perf: PerfModel, batch: float, context_per_seq: float) -> float:
    """Decode step time at a fractional batch (the roofline is linear in the batch); a batch
    near 0 still pays the weight read and the overheads."""
    batch = max(batch, 1e-6)
    return perf.decode_step_time_s(batch, batch * context_per_seq)  # type: ignore[arg-type]


# -- disaggregated prediction --------------------------------------------------------------------


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
    return _predict(config, Workload.of(demand), demand.rate_per_s, slo)


def _predict(config: DisaggConfig, workload: Workload, rate_per_s: float, slo: Slo,
             with_percentiles: bool = True) -> Prediction:
    threshold = config.local_prefill_threshold_tokens
    local = workload.uncached <= threshold
    remote = ~local
    prefill_s = prefill_times_s(config.prefill, workload)
    local_prefill_s = prefill_times_s(config.decode, workload)
    mean_service, scv = moments(prefill_s[remote])
    remote_rate = rate_per_s * float(remote.mean())
    prefill_wait = mgc_wait(remote_rate, mean_service, scv, config.num_prefill)
    decode = _decode_state(config, workload, rate_per_s, local, local_prefill_s)
    if not prefill_wait.is_stable or decode is None:
        return unstable_prediction(rate_per_s)
    transfer_s = transfer_exposed_s(config.prefill, workload, prefill_s)
    fixed = np.where(remote, prefill_s + transfer_s, decode.step_s / 2.0 + local_prefill_s)
    queue_mean = np.where(remote, prefill_wait.mean_s, 0.0)
    residence = fixed + queue_mean + workload.steps * decode.mean_tpot_s
    kv = kv_admission(config.decode, workload, rate_per_s, config.num_decode, residence)
    if not kv.wait.is_stable:
        return unstable_prediction(rate_per_s, kv.num_slots)
    groups = [TtftGroup(remote, fixed[remote], prefill_wait, kv.wait),
              TtftGroup(local, fixed[local], NO_WAIT, kv.wait)]
    has_steps = workload.steps > 0
    tpot_mean, tpot_sd = _tpot_moments(decode, workload)
    ttft_ok = ttft_cdf(groups, slo.ttft_s, workload.size)
    tpot_ok = tpot_attainment(tpot_mean, tpot_sd, has_steps, slo.tpot_s)
    attainment = float((ttft_ok * tpot_ok).mean())
    if with_percentiles:
        ttft_p = ttft_percentile(groups, slo.percentile, workload.size)
        tpot_p = tpot_percentile(tpot_mean, tpot_sd, has_steps, slo.percentile)
    else:
        ttft_p = tpot_p = math.nan
    return Prediction(
        rate_per_s=rate_per_s,
        attainment=attainment,
        ttft_s=ttft_p,
        tpot_s=tpot_p,
        mean_ttft_s=float((fixed + queue_mean).mean()) + kv.wait.mean_s,
        mean_tpot_s=float(tpot_mean[has_steps].mean()) if has_steps.any() else 0.0,
        mean_queue_wait_s=prefill_wait.mean_s,
        mean_kv_wait_s=kv.wait.mean_s,
        prefill_utilization=remote_rate * mean_service / config.num_prefill,
        decode_batch_size=decode.batch,
        num_kv_slots=kv.num_slots,
        local_prefill_fraction=float(local.mean()),
    )


# -- local-prefill threshold -------------------------------------------------------------------


def local_prefill_threshold_tokens(config: DisaggConfig, demand: Demand, slo: Slo) -> int:
    """The local-prefill threshold (uncached prompt tokens) for ``config`` under ``demand``
    (module docstring: stall cost to the batch vs TTFT saved, each in units of its SLO)."""
    return _threshold(config, Workload.of(demand), demand.rate_per_s, slo)


def _threshold(config: DisaggConfig, workload: Workload, rate_per_s: float, slo: Slo) -> int:
    base_config = dataclasses.replace(config, local_prefill_threshold_tokens=0)
    base = _predict(base_config, workload, rate_per_s, slo, with_percentiles=False)
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
    with_threshold = _predict(dataclasses.replace(config, local_prefill_threshold_tokens=best),
                              workload, rate_per_s, slo, with_percentiles=False)
    floor = min(base.attainment, slo.attainment_target)
    return best if with_threshold.attainment >= floor else 0


def with_threshold(config: DisaggConfig, workload: Workload, rate_per_s: float,
                   slo: Slo) -> DisaggConfig:
    """``config`` with the local-prefill threshold derived for it at ``rate_per_s``."""
    return dataclasses.replace(config, local_prefill_threshold_tokens=_threshold(
        dataclasses.replace(config, local_prefill_threshold_tokens=0), workload, rate_per_s, slo))


# -- goodput -----------------------------------------------------------------------------------


def max_rate(attainment_at: Callable[[float], float], target: float, rate_guess_per_s: float,
             relative_tolerance: float = 2e-3, max_evaluations: int = 60) -> float:
    """The highest rate with ``attainment_at(rate) >= target``, by bracketing and bisection.

    Assumes attainment does not increase with the rate. Returns 0.0 if even a rate
    ``1e-6 x rate_guess_per_s`` misses the target.
    """
    if rate_guess_per_s <= 0:
        raise InvalidArgumentError(f"rate guess must be > 0, got {rate_guess_per_s}",
                                   field="rate")
    evaluations = 0
    low, high = 0.0, rate_guess_per_s
    while attainment_at(high) >= target:
        evaluations += 1
        low, high = high, 2.0 * high
        if evaluations >= max_evaluations:
            return low
    probe = high
    while low == 0.0:
        probe *= 0.5
        evaluations += 1
        if probe < 1e-6 * rate_guess_per_s or evaluations >= max_evaluations:
            return 0.0
        if attainment_at(probe) >= target:
            low = probe
        else:
            high = probe
    while high - low > relative_tolerance * high and evaluations < max_evaluations:
        middle = 0.5 * (low + high)
        evaluations += 1
        if attainment_at(middle) >= target:
            low = middle
        else:
            high = middle
    return low


def goodput_rate_per_s(config: DisaggConfig, demand: Demand, slo: Slo) -> float:
    """Highest rate (req/s) at which ``config`` meets both SLOs for ``slo.percentile`` % of
    requests, by the analytic model (the threshold in ``config`` is kept fixed)."""
    workload = Workload.of(demand)
    return max_rate(lambda rate: _predict(config, workload, rate, slo, False).attainment,
                    slo.attainment_target, max(demand.rate_per_s, 1e-3))


def goodput_per_gpu(config: DisaggConfig, demand: Demand, slo: Slo) -> float:
    return goodput_rate_per_s(config, demand, slo) / config.num_gpus


# -- planning ----------------------------------------------------------------------------------


def _feasible_config(prefill: InstanceShape, decode: InstanceShape, num_prefill: int,
                     num_decode: int, workload: Workload, rate_per_s: float,
                     slo: Slo) -> tuple[DisaggConfig, float]:
    config = with_threshold(DisaggConfig(prefill, decode, num_prefill, num_decode), workload,
                            rate_per_s, slo)
    return config, _predict(config, workload, rate_per_s, slo, False).attainment


def _min_count(is_enough: Callable[[int], bool], upper: int) -> int | None:
    """Smallest ``k`` in ``[1, upper]`` with ``is_enough(k)`` (monotone), or ``None``."""
    if upper < 1 or not is_enough(upper):
        return None
    low, high = 0, upper  # is_enough(high) holds; is_enough(low) does not (or low = 0)
    probe = 1
    while probe < high:
        if is_enough(probe):
            high = probe
            break
        low, probe = probe, probe * 2
    while high - low > 1:
        middle = (low + high) // 2
        if is_enough(middle):
            high = middle
        else:
            low = middle
    return high


def _plan_for_shapes(prefill: InstanceShape, decode: InstanceShape, workload: Workload,
                     rate_per_s: float, slo: Slo, max_gpus: int) -> DisaggConfig | None:
    target = slo.attainment_target
    max_prefill = (max_gpus - decode.tp_size) // prefill.tp_size
    max_decode = (max_gpus - prefill.tp_size) // decode.tp_size

    def feasible(num_prefill: int, num_decode: int) -> bool:
        return _feasible_config(prefill, decode, num_prefill, num_decode, workload, rate_per_s,
                                slo)[1] >= target

    min_prefill = _min_count(lambda p: feasible(p, max_decode), max_prefill)
    if min_prefill is None:
        return None
    best: tuple[int, float, DisaggConfig] | None = None
    floor_decode = _min_count(lambda d: feasible(max_prefill, d), max_decode) or 1
    for num_prefill in range(min_prefill, max_prefill + 1):
        if best is not None and num_prefill * prefill.tp_size + floor_decode * decode.tp_size \
                > best[0]:
            break
        upper = max_decode if best is None else min(
            max_decode, (best[0] - num_prefill * prefill.tp_size) // decode.tp_size)
        num_decode = _min_count(lambda d, p=num_prefill: feasible(p, d), upper)
        if num_decode is None:
            continue
        config, attainment = _feasible_config(prefill, decode, num_prefill, num_decode,
                                              workload, rate_per_s, slo)
        key = (config.num_gpus, -attainment)
        if best is None or key < (best[0], -best[1]):
            best = (config.num_gpus, attainment, config)
    return None if best is None else best[2]


def plan(demand: Demand, slo: Slo, prefill_shapes: Sequence[InstanceShape],
         decode_shapes: Sequence[InstanceShape], max_gpus: int = 4096) -> Plan:
    """The configuration with the fewest GPUs whose predicted attainment at ``demand`` reaches
    ``slo.percentile`` (ties: higher attainment), over every pair of shapes given.

    Raises ``InvalidArgumentError`` for an unusable shape, or when no configuration within
    ``max_gpus`` GPUs meets the SLO (e.g. a TPOT bound below the unloaded decode step).
    """
    if not prefill_shapes or not decode_shapes:
        raise InvalidArgumentError("give at least one prefill and one decode shape",
                                   field="shapes")
    for shape in (*prefill_shapes, *decode_shapes):
        shape.check()
    if demand.rate_per_s <= 0:
        raise InvalidArgumentError("planning needs a rate > 0", field="rate")
    workload = Workload.of(demand)
    best: tuple[int, float, DisaggConfig] | None = None
    for prefill in prefill_shapes:
        for decode in decode_shapes:
            config = _plan_for_shapes(prefill, decode, workload, demand.rate_per_s, slo,
                                      max_gpus)
            if config is None:
                continue
            attainment = _predict(config, workload, demand.rate_per_s, slo, False).attainment
            if best is None or (config.num_gpus, -attainment) < (best[0], -best[1]):
                best = (config.num_gpus, attainment, config)
    if best is None:
        raise InvalidArgumentError(
            f"no configuration of at most {max_gpus} GPUs meets TTFT <= {slo.ttft_s} s and "
            f"TPOT <= {slo.tpot_s} s for {slo.percentile:g}% of requests at "
            f"{demand.rate_per_s:g} req/s", field="slo")
    config = best[2]
    prediction = _predict(config, workload, demand.rate_per_s, slo)
    rate = max_rate(lambda r: _predict(config, workload, r, slo, False).attainment,
                    slo.attainment_target, demand.rate_per_s)
    return Plan(config=config, prediction=prediction, goodput_rate_per_s=rate,
                goodput_per_gpu=rate / config.num_gpus)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One P:D split of a GPU budget and its goodput."""

    config: DisaggConfig
    goodput_rate_per_s: float

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rate_per_s / self.config.num_gpus


def sweep_pd(demand: Demand, slo: Slo, prefill: InstanceShape, decode: InstanceShape,
             num_gpus: int, attainment_at: Callable[[DisaggConfig, float], float] | None = None
             ) -> tuple[SweepPoint, ...]:
    """Goodput of every split of ``num_gpus`` GPUs into prefill and decode instances.

    ``attainment_at(config, rate)`` evaluates a configuration (default: this module's model);
    pass the simulator's to sweep by simulation. Each split keeps the local-prefill threshold
    the planner derives for it at ``demand.rate_per_s``.
    """
    workload = Workload.of(demand)
    points = []
    for num_prefill in range(1, num_gpus // prefill.tp_size + 1):
        num_decode = (num_gpus - num_prefill * prefill.tp_size) // decode.tp_size
        if num_decode < 1:
            break
        config = with_threshold(DisaggConfig(prefill, decode, num_prefill, num_decode),
                                workload, demand.rate_per_s, slo)
        if attainment_at is None:
            def evaluate(rate: float, c: DisaggConfig = config) -> float:
                return _predict(c, workload, rate, slo, False).attainment
        else:
            def evaluate(rate: float, c: DisaggConfig = config) -> float:
                return attainment_at(c, rate)
        rate = max_rate(evaluate, slo.attainment_target, max(demand.rate_per_s, 1e-3))
        points.append(SweepPoint(config, rate))
    return tuple(points)
