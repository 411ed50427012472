"""SLO planner for disaggregated serving: how many prefill and decode instances a demand needs.

Inputs are values: a ``Demand`` (arrival rate, paired prompt/output length samples, prefix-hit
rate), an ``Slo`` (TTFT and TPOT bounds at a percentile) and ``InstanceShape``s (model, GPU, TP,
engine settings) for each pool. ``plan`` returns the cheapest ``DisaggConfig`` (fewest GPUs)
whose predicted SLO attainment -- the fraction of requests meeting *both* bounds -- reaches the
percentile, with the local-prefill threshold that goes with it and its goodput per GPU.

The analytic model behind every prediction (queueing in each pool, TTFT, TPOT, the local-prefill
threshold) is ``disaggregated``'s; this module searches pool sizes against it. A demand with an
observed arrival pattern (``Demand.arrivals``, e.g. a trace's timestamps) is predicted as the
sequence of windows its bursts make (``arrival_process``; calm windows by the stationary
model at their own rate, congested ones by the fluid backlog across windows:
``disaggregated.series_attainment``), so pools are sized for the bursts at the SLO's time
scale, not for the mean rate; without one, arrivals are Poisson. ``ArrivalModel`` is that
choice, evaluated at any rate.

**Goodput** (DistServe, OSDI'24): the highest arrival rate at which at least the target fraction
(90%) of requests meet both SLOs, divided by the GPUs; ``max_rate`` finds it by bisection over
the rate, for this analytic model or any other attainment function (e.g. the simulator's).

Everything here is a pure function of frozen values: no clock, no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pdserve.capacity.arrival_process import WindowSeries
from pdserve.capacity.disaggregated import (
    predict_mixture,
    predict_workload,
    series_attainment,
    with_threshold,
)
from pdserve.capacity.latency_model import Prediction
from pdserve.capacity.plan_inputs import Demand, DisaggConfig, InstanceShape, Slo
from pdserve.capacity.workload import Workload
from pdserve.common.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's answer: the cheapest configuration meeting the SLO at the demand's rate,
    its prediction there, and its goodput (requests/s at ``slo.percentile`` attainment)."""

    config: DisaggConfig
    prediction: Prediction
    goodput_rate_per_s: float
    goodput_per_gpu: float


@dataclass(frozen=True, slots=True, eq=False)
class ArrivalModel:
    """How a demand's arrivals are predicted: Poisson at the rate (``demand.arrivals`` None),
    or its observed pattern rescaled to the rate, in windows of the TTFT bound (the prefill
    pool's time scale) with each window's decode intensity over a request's decode time at the
    TPOT bound (at least the TTFT bound); see ``arrival_process`` and
    ``disaggregated.series_attainment``."""

    demand: Demand
    slo: Slo
    workload: Workload

    @classmethod
    def of(cls, demand: Demand, slo: Slo) -> ArrivalModel:
        return cls(demand, slo, Workload.of(demand))

    @property
    def is_poisson(self) -> bool:
        return self.demand.arrivals is None

    def windows(self, rate_per_s: float) -> WindowSeries | None:
        """The window series at mean rate ``rate_per_s`` (None for Poisson)."""
        arrivals = self.demand.arrivals
        if arrivals is None or rate_per_s <= 0:
            return None
        decode_window_s = (self.slo.ttft_s
                           + float(self.workload.steps.mean()) * self.slo.tpot_s)
        return arrivals.windows(rate_per_s, self.slo.ttft_s, decode_window_s)

    def predict(self, config: DisaggConfig, rate_per_s: float | None = None,
                with_percentiles: bool = True) -> Prediction:
        rate = self.demand.rate_per_s if rate_per_s is None else rate_per_s
        series = self.windows(rate)
        if series is None:
            return predict_workload(config, self.workload, rate, self.slo, with_percentiles)
        return predict_mixture(config, self.workload, rate, series, self.slo, with_percentiles)

    def attainment(self, config: DisaggConfig, rate_per_s: float | None = None) -> float:
        rate = self.demand.rate_per_s if rate_per_s is None else rate_per_s
        series = self.windows(rate)
        if series is None:
            return predict_workload(config, self.workload, rate, self.slo, False).attainment
        return series_attainment(config, self.workload, rate, series, self.slo)


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
    model = ArrivalModel.of(demand, slo)
    return max_rate(lambda rate: model.attainment(config, rate), slo.attainment_target,
                    max(demand.rate_per_s, 1e-3))


def goodput_per_gpu(config: DisaggConfig, demand: Demand, slo: Slo) -> float:
    return goodput_rate_per_s(config, demand, slo) / config.num_gpus


# -- planning ----------------------------------------------------------------------------------


def _feasible_config(prefill: InstanceShape, decode: InstanceShape, num_prefill: int,
                     num_decode: int, model: ArrivalModel) -> tuple[DisaggConfig, float]:
    config = with_threshold(DisaggConfig(prefill, decode, num_prefill, num_decode),
                            model.workload, model.demand.rate_per_s, model.slo)
    return config, model.attainment(config)


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


def _plan_for_shapes(prefill: InstanceShape, decode: InstanceShape, model: ArrivalModel,
                     max_gpus: int) -> DisaggConfig | None:
    target = model.slo.attainment_target
    max_prefill = (max_gpus - decode.tp_size) // prefill.tp_size
    max_decode = (max_gpus - prefill.tp_size) // decode.tp_size

    def feasible(num_prefill: int, num_decode: int) -> bool:
        return _feasible_config(prefill, decode, num_prefill, num_decode, model)[1] >= target

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
        num_decode = _min_count(functools.partial(feasible, num_prefill), upper)
        if num_decode is None:
            continue
        config, attainment = _feasible_config(prefill, decode, num_prefill, num_decode, model)
        key = (config.num_gpus, -attainment)
        if best is None or key < (best[0], -best[1]):
            best = (config.num_gpus, attainment, config)
    return None if best is None else best[2]


def plan(demand: Demand, slo: Slo, prefill_shapes: Sequence[InstanceShape],
         decode_shapes: Sequence[InstanceShape], max_gpus: int = 4096,
         is_same_tp: bool = False) -> Plan:
    """The configuration with the fewest GPUs whose predicted attainment at ``demand`` reaches
    ``slo.percentile`` (ties: higher attainment), over every pair of shapes given (only pairs
    of equal TP with ``is_same_tp``).

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
    model = ArrivalModel.of(demand, slo)
    best: tuple[int, float, DisaggConfig] | None = None
    for prefill in prefill_shapes:
        for decode in decode_shapes:
            if is_same_tp and prefill.tp_size != decode.tp_size:
                continue
            config = _plan_for_shapes(prefill, decode, model, max_gpus)
            if config is None:
                continue
            attainment = model.attainment(config)
            if best is None or (config.num_gpus, -attainment) < (best[0], -best[1]):
                best = (config.num_gpus, attainment, config)
    if best is None:
        raise InvalidArgumentError(
            f"no configuration of at most {max_gpus} GPUs meets TTFT <= {slo.ttft_s} s and "
            f"TPOT <= {slo.tpot_s} s for {slo.percentile:g}% of requests at "
            f"{demand.rate_per_s:g} req/s", field="slo")
    return evaluate_plan(best[2], model)


def evaluate_plan(config: DisaggConfig, model: ArrivalModel) -> Plan:
    """``config`` as a ``Plan``: its prediction at the demand's rate and its goodput."""
    prediction = model.predict(config)
    rate = max_rate(lambda r: model.attainment(config, r), model.slo.attainment_target,
                    model.demand.rate_per_s)
    return Plan(config=config, prediction=prediction, goodput_rate_per_s=rate,
                goodput_per_gpu=rate / config.num_gpus)


class _OnGpus(Protocol):
    @property
    def num_gpus(self) -> int: ...


ConfigT = TypeVar("ConfigT", bound=_OnGpus)


@dataclass(frozen=True, slots=True)
class GoodputPoint(Generic[ConfigT]):
    """A configuration (a P:D split of a GPU budget, a colocated deployment, ...) and its
    goodput: requests/s at ``slo.percentile`` attainment."""

    config: ConfigT
    goodput_rate_per_s: float

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rate_per_s / self.config.num_gpus


def sweep_pd(demand: Demand, slo: Slo, prefill: InstanceShape, decode: InstanceShape,
             num_gpus: int, attainment_at: Callable[[DisaggConfig, float], float] | None = None,
             relative_tolerance: float = 2e-3) -> tuple[GoodputPoint[DisaggConfig], ...]:
    """Goodput of every split of ``num_gpus`` GPUs into prefill and decode instances, each to
    ``relative_tolerance`` of its rate.

    ``attainment_at(config, rate)`` evaluates a configuration (default: this module's model);
    pass the simulator's to sweep by simulation. Each split keeps the local-prefill threshold
    the planner derives for it at ``demand.rate_per_s``.
    """
    model = ArrivalModel.of(demand, slo)
    workload = model.workload
    points = []
    for num_prefill in range(1, num_gpus // prefill.tp_size + 1):
        num_decode = (num_gpus - num_prefill * prefill.tp_size) // decode.tp_size
        if num_decode < 1:
            break
        config = with_threshold(DisaggConfig(prefill, decode, num_prefill, num_decode),
                                workload, demand.rate_per_s, slo)
        if attainment_at is None:
            def evaluate(rate: float, c: DisaggConfig = config) -> float:
                return model.attainment(c, rate)
        else:
            def evaluate(rate: float, c: DisaggConfig = config) -> float:
                return attainment_at(c, rate)
        rate = max_rate(evaluate, slo.attainment_target, max(demand.rate_per_s, 1e-3),
                        relative_tolerance=relative_tolerance)
        points.append(GoodputPoint(config, rate))
    return tuple(points)
