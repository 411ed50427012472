"""The cold-start-aware autoscaler: a pure ``ScalingPolicy`` that sizes the prefill and decode
pools of one deployment ahead of demand.

A new instance serves only ``cold_start_s`` after it is launched (minutes for a large model), so
every decision sizes the pools for the demand expected over the next ``lead_s = cold_start_s +
interval_s`` (the instances launched now are ready after the cold start, and the next decision
can correct course one interval later). Each call:

1. **Forecast.** Holt's linear trend (double exponential smoothing, with a damped trend after
   Gardner & McKenzie 1985) on the per-interval arrival rates: ``level`` follows the rate,
   ``trend`` its change per interval; the forecast ``h`` intervals ahead is ``level + (phi + ... +
   phi^h) x trend``. The policy sizes for the highest forecast on the path from now to the lead
   (a falling forecast keeps today's level). Holt's trend is smoothed to stay quiet on noise, so
   it learns a steep ramp slowly; a **surge test** covers that case: a least-squares slope over
   the last ``surge_window`` rates whose t statistic against the one-interval noise reaches
   ``surge_t_stat`` is projected over the lead (``surge_horizon_s``), and the larger forecast
   wins. No daily (seasonal) term: learning one takes at least a day of history per deployment,
   and over a 10-minute lead the daily envelope is a near-linear ramp (a 10:1 sine day changes
   by under 4% in 10 minutes), which the trend term follows.
2. **Headroom** from forecast error: the ``headroom_quantile`` of the absolute errors of the
   forecasts this policy made one lead time earlier, scored against the smoothed level when
   their target interval arrives (the sampling noise of one short interval is not forecast
   error; bunching within an interval is what the target utilisation is for), over the last
   ``error_window`` intervals. Until enough of those exist, the same quantile of one-interval
   errors times ``sqrt(lead in intervals)`` (the random-walk growth of error with horizon);
   before any error is known, ``initial_headroom_fraction`` of the forecast. Never less than
   ``min_headroom_fraction`` of the forecast: a burst that nothing forecasts has to be met by
   what already runs until new instances are ready, a lead time later (``bench/autoscale.py``
   measures the trade-off this floor makes).
3. **Demand to instances** with the capacity and performance models (``size_pools``): prefill is
   compute: one instance prefills ``speedup / prefill_time_s(mean prompt)`` requests per second,
   sized at ``prefill_target_utilization`` (TTFT includes queue wait). Decode is KV memory and
   batch: an instance runs at most ``min(max_batch_size, KV blocks / blocks per sequence,
   largest batch whose step time meets the TPOT SLO)`` sequences, each for ``mean_output x
   step_time`` seconds; sized at ``decode_target_utilization`` of the throughput that batch
   delivers (see ``decode_rate_per_instance`` for why throughput, not batch). Backlog (queued
   prompt tokens, sequences waiting for KV room) is added as the rate that clears it within the
   lead. The two pools are sized from different quantities (prompt length for prefill; output
   length, context and KV for decode), so they scale independently.
4. **Operator controls and damping** per pool, in this order: a manual override (until it
   expires) or a freeze short-circuits the rest; otherwise scale up at once, scale down only when
   the highest need over the last ``scale_down_delay_s`` (as Kubernetes' HPA stabilisation
   window does), raised by a margin (``scale_down_margin``, or ``scale_down_noise_multiple``
   times the rate's relative noise when that is wider), fits in fewer instances, and by at
   most ``max(1, max_scale_down_fraction x previous)`` per decision; then min/max bounds; then
   the GPU budget (both pools, GPUs per instance from the tensor-parallel degree; cut the pool
   with more headroom over its need first); then at most ``max_step_per_minute`` instances
   added or removed per pool in any 60 s. Removal always goes through drain, by the pool
   managers.

Every decision carries, in ``ScalingDecision.inputs``, the figures it was computed from: the
forecast (``forecast_*``), headroom, per-instance capacities, the raw and final target of each
pool and why, and the controls in force. Times are seconds on the caller's clock
(``ScalingObservation.now_s``); the policy reads no other clock and does no I/O.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pdserve.capacity.scaling import PoolObservation, ScalingDecision, ScalingObservation
from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import get_gpu, get_model
from pdserve.perf.kv_budget import CapacityConfig, blocks_per_request, capacity_report
from pdserve.perf.perf_model import PerfModel, perf_model_for

RATE_LIMIT_WINDOW_S = 60.0
"""``max_step_per_minute`` counts target changes over this rolling window."""

_EPSILON = 1e-9


# -- capacity of one instance ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstanceProfile:
    """What one prefill and one decode instance of a deployment can do.

    ``decode_num_blocks`` is the KV blocks of one decode instance (``kv_budget``); ``speedup``
    is simulated seconds per wall second of the instances (sim workers run faster than the
    hardware they model; 1 on real GPUs), so capacities are per second of the caller's clock.
    """

    prefill_perf: PerfModel
    decode_perf: PerfModel
    decode_num_blocks: int
    block_size_tokens: int = 16
    max_batch_size: int = 256
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.decode_num_blocks < 1:
            raise InvalidArgumentError(
                f"decode_num_blocks must be >= 1, got {self.decode_num_blocks}",
                field="decode_num_blocks")
        if self.block_size_tokens < 1:
            raise InvalidArgumentError(
                f"block_size_tokens must be >= 1, got {self.block_size_tokens}",
                field="block_size_tokens")
        if self.max_batch_size < 1:
            raise InvalidArgumentError(
                f"max_batch_size must be >= 1, got {self.max_batch_size}", field="max_batch_size")
        if not (math.isfinite(self.speedup) and self.speedup > 0):
            raise InvalidArgumentError(f"speedup must be > 0, got {self.speedup}", field="speedup")

    @property
    def num_gpus_per_prefill(self) -> int:
        return self.prefill_perf.tp_size

    @property
    def num_gpus_per_decode(self) -> int:
        return self.decode_perf.tp_size

    @classmethod
    def from_catalog(cls, model: str, gpu: str, *, prefill_tp_size: int = 1,
                     decode_tp_size: int = 1, block_size_tokens: int = 16,
                     max_batch_size: int = 256, gpu_memory_utilization: float = 0.9,
                     max_num_blocks: int = 0, speedup: float = 1.0) -> InstanceProfile:
        """A profile from catalog names: calibrated performance models, estimated KV capacity
        (capped at ``max_num_blocks`` when > 0, as sim workers may be)."""
        report = capacity_report(get_model(model), get_gpu(gpu), CapacityConfig(
            tp_size=decode_tp_size, block_size_tokens=block_size_tokens,
            gpu_memory_utilization=gpu_memory_utilization))
        num_blocks = report.num_blocks
        if max_num_blocks > 0:
            num_blocks = min(num_blocks, max_num_blocks)
        return cls(
            prefill_perf=perf_model_for(model, gpu, prefill_tp_size),
            decode_perf=perf_model_for(model, gpu, decode_tp_size),
            decode_num_blocks=num_blocks, block_size_tokens=block_size_tokens,
            max_batch_size=max_batch_size, speedup=speedup,
        )


@dataclass(frozen=True, slots=True)
class SizingConfig:
    """How demand becomes instances.

    ``tpot_slo_s`` bounds the decode batch (the step time of a full batch must meet it);
    ``*_target_utilization`` is the share of an instance's throughput the plan uses at the
    forecast demand (the rest absorbs arrivals bunching within an interval: TTFT includes queue
    wait; decode throughput at the TPOT-limited batch). ``kv_growth_fraction``: share of the output a sequence's KV reservation covers (1 =
    the whole output, as the router reserves an expected length up front; 0.5 = the average
    footprint of sequences that grow block by block).
    """

    tpot_slo_s: float = 0.1
    prefill_target_utilization: float = 0.75
    decode_target_utilization: float = 0.8
    kv_growth_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tpot_slo_s) and self.tpot_slo_s > 0):
            raise InvalidArgumentError(f"tpot_slo_s must be > 0, got {self.tpot_slo_s}",
                                       field="tpot_slo_s")
        for name in ("prefill_target_utilization", "decode_target_utilization"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InvalidArgumentError(f"{name} must be in (0, 1], got {value}", field=name)
        if not 0.0 <= self.kv_growth_fraction <= 1.0:
            raise InvalidArgumentError(
                f"kv_growth_fraction must be in [0, 1], got {self.kv_growth_fraction}",
                field="kv_growth_fraction")


class DecodeLimit(enum.StrEnum):
    """What caps the batch of a decode instance."""

    MAX_BATCH = "max_batch"
    KV = "kv"
    TPOT = "tpot"


@dataclass(frozen=True, slots=True)
class Demand:
    """Demand to size for: request rate (per second of the caller's clock), mean lengths, and
    work already waiting (prompt tokens queued for prefill; sequences waiting for decode KV)."""

    arrival_rate_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    num_queued_prefill_tokens: float = 0.0
    num_queued_decode_seqs: float = 0.0
    backlog_horizon_s: float = 60.0
    """Backlog is served within this long (the autoscaler uses its lead time)."""


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """Instances each pool needs for a ``Demand`` (fractional: round up to decide) and the
    per-instance capacities behind them (requests per second at the target utilisation)."""

    num_prefill: float
    num_decode: float
    prefill_rate_per_instance: float
    decode_rate_per_instance: float
    decode_batch_size: float
    decode_limit: DecodeLimit


def prefill_rate_per_instance(profile: InstanceProfile, sizing: SizingConfig,
                              mean_prompt_tokens: float) -> float:
    """Requests per second one prefill instance serves at the target utilisation.

    Costed as one prompt of the mean length per batch: slightly pessimistic (batching shares the
    fixed overhead and weight reads) and blind to the spread of lengths (attention is quadratic
    in the prompt), which the target utilisation leaves room for.
    """
    prompt = max(1, round(mean_prompt_tokens))
    seconds = profile.prefill_perf.prefill_time_s([prompt]) / profile.speedup
    return sizing.prefill_target_utilization / seconds


def decode_batch_limit(profile: InstanceProfile, sizing: SizingConfig, mean_prompt_tokens: float,
                       mean_output_tokens: float) -> tuple[int, DecodeLimit]:
    """The largest batch one decode instance can run, and what limits it.

    KV: ``num_blocks // blocks per sequence`` with ``prompt + kv_growth_fraction x output``
    tokens per sequence. TPOT: the largest batch whose step time (sequences at their average
    context, ``prompt + output / 2``) meets ``tpot_slo_s`` (at least 1: a lone sequence that
    misses it cannot be helped by more instances).
    """
    perf = profile.decode_perf
    kv_tokens = mean_prompt_tokens + sizing.kv_growth_fraction * mean_output_tokens
    kv_blocks = max(1, blocks_per_request(max(1, math.ceil(kv_tokens)), profile.block_size_tokens))
    kv_batch = max(1, profile.decode_num_blocks // kv_blocks)
    context = mean_prompt_tokens + mean_output_tokens / 2.0
    limit, cap = DecodeLimit.MAX_BATCH, profile.max_batch_size
    if kv_batch < cap:
        limit, cap = DecodeLimit.KV, kv_batch
    tpot_s = sizing.tpot_slo_s * profile.speedup  # the model's own seconds

    def meets(batch: int) -> bool:
        return perf.decode_step_time_s(batch, math.ceil(batch * context)) <= tpot_s

    if meets(cap):
        return cap, limit
    low, high = 1, cap  # meets(low) may be false; the answer is then 1
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            low = middle
        else:
            high = middle
    return low, DecodeLimit.TPOT


def decode_rate_per_instance(profile: InstanceProfile, sizing: SizingConfig,
                             mean_prompt_tokens: float,
                             mean_output_tokens: float) -> tuple[float, float, DecodeLimit]:
    """Requests per second one decode instance serves at the target utilisation, the batch it
    runs then, and what limits the batch.

    A request holds a batch slot for ``mean_output x step_time(batch)`` seconds, so an instance
    running ``batch`` sequences completes ``batch / (output x step)`` requests per second
    (Little's law). The target utilisation applies to that *throughput* at the largest allowed
    batch, not to the batch: decode steps of large models grow almost linearly with the batch
    once compute-bound, so a batch at 80% of the TPOT limit can deliver nearly 100% of the
    throughput, and an instance offered more than its maximum throughput does not degrade
    gently: its batch grows until every sequence on it misses the TPOT SLO.
    """
    max_batch, limit = decode_batch_limit(profile, sizing, mean_prompt_tokens, mean_output_tokens)
    context = mean_prompt_tokens + mean_output_tokens / 2.0
    output = max(1.0, mean_output_tokens)

    def rate_at(batch: int) -> float:
        step_s = profile.decode_perf.decode_step_time_s(
            batch, math.ceil(batch * context)) / profile.speedup
        return batch / (output * step_s)

    rate = sizing.decode_target_utilization * rate_at(max_batch)
    low, high = 1, max_batch  # the smallest batch that sustains ``rate`` (rate_at increases)
    while low < high:
        middle = (low + high) // 2
        if rate_at(middle) >= rate:
            high = middle
        else:
            low = middle + 1
    return rate, float(low), limit


def size_pools(profile: InstanceProfile, sizing: SizingConfig, demand: Demand) -> PoolSizing:
    """Instances each pool needs for ``demand`` (pure; the oracle in ``bench/autoscale.py`` and
    the planner's callers use the same arithmetic)."""
    prefill_rate = prefill_rate_per_instance(profile, sizing, demand.mean_prompt_tokens)
    decode_rate, batch, limit = decode_rate_per_instance(
        profile, sizing, demand.mean_prompt_tokens, demand.mean_output_tokens)
    horizon_s = max(demand.backlog_horizon_s, _EPSILON)
    prefill_backlog_rate = (demand.num_queued_prefill_tokens
                            / max(1.0, demand.mean_prompt_tokens) / horizon_s)
    decode_backlog_rate = demand.num_queued_decode_seqs / horizon_s
    rate = max(0.0, demand.arrival_rate_per_s)
    return PoolSizing(
        num_prefill=(rate + prefill_backlog_rate) / prefill_rate,
        num_decode=(rate + decode_backlog_rate) / decode_rate,
        prefill_rate_per_instance=prefill_rate,
        decode_rate_per_instance=decode_rate,
        decode_batch_size=batch,
        decode_limit=limit,
    )


def instances_for(need: float) -> int:
    """Whole instances for a fractional need (a hair over an integer does not add one)."""
    return max(0, math.ceil(need - 1e-6))


# -- forecasting ----------------------------------------------------------------------------


class HoltForecaster:
    """Holt's linear trend with a damped trend, in error-correction form, on values observed
    once per interval. ``forecast(h)`` is the value expected ``h`` intervals after the last one
    observed; never negative (rates)."""

    def __init__(self, alpha: float, beta: float, damping: float) -> None:
        self.alpha = alpha
        self.beta = beta
        self.damping = damping
        self.level: float | None = None
        self.trend = 0.0
        self.num_observed = 0

    def update(self, value: float) -> float | None:
        """Observe the next interval's value; returns the one-interval error (None at first)."""
        self.num_observed += 1
        if self.level is None:
            self.level = value
            return None
        expected = self.level + self.damping * self.trend
        error = value - expected
        self.level = expected + self.alpha * error
        self.trend = self.damping * self.trend + self.alpha * self.beta * error
        return error

    def forecast(self, num_intervals: int) -> float:
        if self.level is None:
            return 0.0
        phi = self.damping
        weight = (num_intervals if phi == 1.0
                  else phi * (1.0 - phi ** num_intervals) / (1.0 - phi))
        return max(0.0, self.level + weight * self.trend)

    def path_max(self, num_intervals: int) -> float:
        """Highest forecast from now (``h = 0``) to ``num_intervals`` ahead: the damped trend
        is monotone, so one end or the other."""
        return max(self.forecast(0), self.forecast(num_intervals))


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between order statistics."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


# -- operator controls ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolBounds:
    """Never fewer than ``min_instances`` nor more than ``max_instances`` in a pool."""

    min_instances: int = 1
    max_instances: int = 10_000

    def clamp(self, value: int) -> int:
        return min(self.max_instances, max(self.min_instances, value))


@dataclass(frozen=True, slots=True)
class AutoscalerControls:
    """What an operator sets (``SetAutoscalerControls``).

    ``override_*_instances`` (None = none) pin a pool's target until ``override_until_s``
    (caller's clock); ``max_step_per_minute`` 0 and ``max_gpus`` 0 mean no limit.
    """

    is_dry_run: bool = False
    is_frozen: bool = False
    prefill_bounds: PoolBounds = PoolBounds()
    decode_bounds: PoolBounds = PoolBounds()
    override_prefill_instances: int | None = None
    override_decode_instances: int | None = None
    override_until_s: float = 0.0
    max_step_per_minute: int = 0
    max_gpus: int = 0

    def check(self, profile: InstanceProfile | None = None) -> None:
        """Raise ``InvalidArgumentError`` naming the first field that is out of range or
        inconsistent with another (``profile`` gives GPUs per instance for the budget)."""
        for name, bounds in (("prefill_bounds", self.prefill_bounds),
                             ("decode_bounds", self.decode_bounds)):
            if bounds.min_instances < 0:
                raise InvalidArgumentError(f"{name}.min_instances must be >= 0",
                                           field=f"{name}.min_instances")
            if bounds.max_instances < max(1, bounds.min_instances):
                raise InvalidArgumentError(
                    f"{name}.max_instances must be >= max(1, min_instances "
                    f"{bounds.min_instances}), got {bounds.max_instances}",
                    field=f"{name}.max_instances")
        for name, value, bounds in (
                ("override_prefill_instances", self.override_prefill_instances,
                 self.prefill_bounds),
                ("override_decode_instances", self.override_decode_instances,
                 self.decode_bounds)):
            if value is not None and not bounds.min_instances <= value <= bounds.max_instances:
                raise InvalidArgumentError(
                    f"{name} must be within the pool's bounds [{bounds.min_instances}, "
                    f"{bounds.max_instances}], got {value}", field=name)
        if not math.isfinite(self.override_until_s):
            raise InvalidArgumentError("override_until_s must be finite",
                                       field="override_until_s")
        if self.max_step_per_minute < 0:
            raise InvalidArgumentError("max_step_per_minute must be >= 0 (0 = no limit)",
                                       field="max_step_per_minute")
        if self.max_gpus < 0:
            raise InvalidArgumentError("max_gpus must be >= 0 (0 = no budget)", field="max_gpus")
        if self.max_gpus and profile is not None:
            floor = (self.prefill_bounds.min_instances * profile.num_gpus_per_prefill
                     + self.decode_bounds.min_instances * profile.num_gpus_per_decode)
            if floor > self.max_gpus:
                raise InvalidArgumentError(
                    f"max_gpus {self.max_gpus} is below the {floor} GPUs the pools' minimum "
                    f"instances need", field="max_gpus")

    def override_for(self, is_prefill: bool, now_s: float) -> int | None:
        if now_s >= self.override_until_s:
            return None
        return self.override_prefill_instances if is_prefill else self.override_decode_instances

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (for the durable store), inverse of ``from_dict``."""
        values: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, PoolBounds):
                value = {"min_instances": value.min_instances,
                         "max_instances": value.max_instances}
            values[item.name] = value
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AutoscalerControls:
        known = {item.name for item in fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            if name not in known:
                continue
            if name.endswith("_bounds"):
                value = PoolBounds(int(value["min_instances"]), int(value["max_instances"]))
            kwargs[name] = value
        return cls(**kwargs)


# -- the policy -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    """Tunables of the autoscaler (the operator's controls are ``AutoscalerControls``).

    ``alpha``/``beta``: smoothing of level and trend, in (0, 1]; ``damping``: trend damping phi
    in (0, 1]. ``error_window``: intervals of forecast errors kept. ``scale_down_delay_s``: how
    long the need must stay below the current size before the pool shrinks;
    ``scale_down_margin``: how far below (a fraction of the need), the hysteresis band, widened
    to ``scale_down_noise_multiple`` times the rate's relative one-interval noise when that is
    larger (noisier demand needs a wider band not to flap). ``surge_horizon_s`` None projects a
    detected surge over the whole lead. The defaults were chosen on ``bench/autoscale.py``'s day
    (several seeds): they trade GPU-hours against the share of a +60% burst the running
    instances absorb before new ones are ready.
    """

    sizing: SizingConfig = SizingConfig()
    alpha: float = 0.3
    beta: float = 0.1
    damping: float = 0.98
    error_window: int = 60
    min_lead_errors: int = 10
    headroom_quantile: float = 0.7
    min_headroom_fraction: float = 0.12
    initial_headroom_fraction: float = 0.2
    surge_window: int = 5
    surge_t_stat: float = 4.0
    surge_horizon_s: float | None = None
    scale_down_delay_s: float = 180.0
    scale_down_margin: float = 0.05
    scale_down_noise_multiple: float = 1.5
    max_scale_down_fraction: float = 0.1

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "damping", "headroom_quantile"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InvalidArgumentError(f"{name} must be in (0, 1], got {value}", field=name)
        for name in ("min_headroom_fraction", "initial_headroom_fraction", "scale_down_delay_s",
                     "scale_down_margin", "scale_down_noise_multiple", "max_scale_down_fraction"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"{name} must be >= 0, got {value}", field=name)
        if self.surge_window < 0 or self.surge_window == 1 or (
                self.surge_horizon_s is not None and not self.surge_horizon_s >= 0):
            raise InvalidArgumentError(
                "surge_window must be 0 (off) or >= 2, surge_horizon_s None or >= 0",
                field="surge_window")
        if self.error_window < 2 or self.min_lead_errors < 1:
            raise InvalidArgumentError("error_window must be >= 2 and min_lead_errors >= 1",
                                       field="error_window")


@dataclass(slots=True)
class _PoolState:
    """What the policy remembers about one pool between calls."""

    last_target: int | None = None
    need_history: deque[tuple[float, float]] = field(default_factory=deque)
    changes: deque[tuple[float, int]] = field(default_factory=deque)


@dataclass(frozen=True, slots=True)
class _PoolStep:
    """One pool's target and how it was reached (for the decision's inputs)."""

    target: int
    desired: int
    reason: str


@dataclass(frozen=True, slots=True)
class Forecast:
    """What the forecaster says at a decision: the path maximum over the lead, its headroom,
    and where the headroom came from (``lead`` errors, ``step`` errors x sqrt(lead), or
    ``initial``)."""

    rate_per_s: float
    level_per_s: float
    trend_per_s_per_interval: float
    lead_rate_per_s: float
    headroom_per_s: float
    headroom_source: str
    lead_s: float
    lead_intervals: int
    num_lead_errors: int


class Autoscaler:
    """The cold-start-aware autoscaler of one deployment (module docstring). Implements
    ``ScalingPolicy``: synchronous, no I/O, state only in memory (forecast, error history,
    hysteresis windows). Operator controls change with ``set_controls``."""

    def __init__(self, profile: InstanceProfile, config: AutoscalerConfig = AutoscalerConfig(),
                 controls: AutoscalerControls = AutoscalerControls()) -> None:
        controls.check(profile)
        self.profile = profile
        self.config = config
        self._controls = controls
        self._forecaster = HoltForecaster(config.alpha, config.beta, config.damping)
        self._step_errors: deque[float] = deque(maxlen=config.error_window)
        self._lead_errors: deque[float] = deque(maxlen=config.error_window)
        self._pending: deque[tuple[int, float]] = deque()  # (target interval index, forecast)
        self._recent: deque[float] = deque(maxlen=max(2, config.surge_window))
        self._last_now_s: float | None = None
        self._mean_prompt_tokens = 0.0
        self._mean_output_tokens = 0.0
        self._pools = {True: _PoolState(), False: _PoolState()}  # keyed by is_prefill

    @property
    def controls(self) -> AutoscalerControls:
        return self._controls

    def set_controls(self, controls: AutoscalerControls) -> None:
        """Replace the operator controls (checked first; nothing changes if they are bad)."""
        controls.check(self.profile)
        self._controls = controls

    # -- forecasting ----------------------------------------------------------------------

    def _observe(self, observation: ScalingObservation) -> None:
        rates = observation.arrival_rates_per_s
        if self._last_now_s is None:
            new = rates
        elif observation.now_s <= self._last_now_s:
            new = ()  # the same interval again: nothing new to learn
        else:
            elapsed = (observation.now_s - self._last_now_s) / observation.interval_s
            new = rates[-max(1, min(len(rates), round(elapsed))):] if rates else ()
        for rate in new:
            self._learn(max(0.0, float(rate)))
        if self._last_now_s is None or observation.now_s > self._last_now_s:
            self._last_now_s = observation.now_s
        if observation.mean_prompt_tokens > 0:
            self._mean_prompt_tokens = observation.mean_prompt_tokens
        if observation.mean_output_tokens > 0:
            self._mean_output_tokens = observation.mean_output_tokens

    def _learn(self, rate: float) -> None:
        self._recent.append(rate)
        error = self._forecaster.update(rate)
        if error is not None:
            self._step_errors.append(error)
        index = self._forecaster.num_observed
        while self._pending and self._pending[0][0] <= index:
            target_index, predicted = self._pending.popleft()
            if target_index == index:
                # Scored against the smoothed level, not the raw count of one interval: the
                # sampling noise of a short interval is not forecast error, and the target
                # utilisation already covers arrivals bunching within an interval.
                self._lead_errors.append(self._forecaster.forecast(0) - predicted)

    def _forecast(self, observation: ScalingObservation) -> Forecast:
        config = self.config
        lead_s = observation.cold_start_s + observation.interval_s
        lead = max(1, math.ceil(lead_s / observation.interval_s - 1e-9))
        forecaster = self._forecaster
        lead_rate = forecaster.forecast(lead)
        index = forecaster.num_observed
        if forecaster.level is not None and (not self._pending or self._pending[-1][0] < index + lead):
            self._pending.append((index + lead, lead_rate))
        rate = forecaster.path_max(lead)
        surge_slope, surge_t = self._surge()
        if surge_t >= config.surge_t_stat:
            horizon = lead if config.surge_horizon_s is None else min(
                lead, config.surge_horizon_s / observation.interval_s)
            rate = max(rate, self._recent[-1] + surge_slope * horizon)
        if len(self._lead_errors) >= config.min_lead_errors:
            error = _quantile([abs(e) for e in self._lead_errors], config.headroom_quantile)
            source = "lead"
        elif len(self._step_errors) >= 3:
            error = (_quantile([abs(e) for e in self._step_errors], config.headroom_quantile)
                     * math.sqrt(lead))
            source = "step"
        else:
            error = config.initial_headroom_fraction * rate
            source = "initial"
        headroom = max(error, config.min_headroom_fraction * rate)
        return Forecast(
            rate_per_s=rate, level_per_s=forecaster.forecast(0),
            trend_per_s_per_interval=forecaster.trend, lead_rate_per_s=lead_rate,
            headroom_per_s=headroom, headroom_source=source, lead_s=lead_s,
            lead_intervals=lead, num_lead_errors=len(self._lead_errors),
        )

    def _surge(self) -> tuple[float, float]:
        """Slope (per interval) of a least-squares line through the last ``surge_window``
        rates and its t statistic against the one-interval noise (robust: 1.4826 x the median
        absolute one-interval error). (0, 0) while either is unknown."""
        num = len(self._recent)
        if not self.config.surge_window or num < self.config.surge_window or len(self._step_errors) < 5:
            return 0.0, 0.0
        mean_x = (num - 1) / 2.0
        mean_y = sum(self._recent) / num
        sxx = sum((x - mean_x) ** 2 for x in range(num))
        slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(self._recent)) / sxx
        sigma = 1.4826 * _quantile([abs(e) for e in self._step_errors], 0.5)
        if sigma <= _EPSILON:
            return slope, math.inf if slope > 0 else 0.0
        return slope, slope / (sigma / math.sqrt(sxx))

    def _noise_fraction(self) -> float:
        """The one-interval noise of the rate relative to its level (robust: 1.4826 x the
        median absolute one-interval error), 0 while unknown."""
        level = self._forecaster.forecast(0)
        if len(self._step_errors) < 5 or level <= _EPSILON:
            return 0.0
        return 1.4826 * _quantile([abs(e) for e in self._step_errors], 0.5) / level

    # -- deciding -------------------------------------------------------------------------

    def decide(self, observation: ScalingObservation) -> ScalingDecision:
        self._observe(observation)
        forecast = self._forecast(observation)
        demand = Demand(
            arrival_rate_per_s=forecast.rate_per_s + forecast.headroom_per_s,
            mean_prompt_tokens=self._mean_prompt_tokens or 1.0,
            mean_output_tokens=self._mean_output_tokens or 1.0,
            num_queued_prefill_tokens=observation.prefill.num_queued_tokens,
            num_queued_decode_seqs=(observation.decode.num_queued_tokens
                                    / max(1.0, self._mean_prompt_tokens)),
            backlog_horizon_s=forecast.lead_s,
        )
        sizing = size_pools(self.profile, self.config.sizing, demand)
        now_s = observation.now_s
        prefill = self._pool_step(True, sizing.num_prefill, observation.prefill, now_s)
        decode = self._pool_step(False, sizing.num_decode, observation.decode, now_s)
        prefill, decode = self._fit_budget(prefill, decode, sizing)
        prefill = self._rate_limit(True, prefill, observation.prefill, now_s)
        decode = self._rate_limit(False, decode, observation.decode, now_s)
        prefill, decode = self._fit_budget(prefill, decode, sizing, is_final=True)
        self._commit(True, prefill.target, now_s)
        self._commit(False, decode.target, now_s)
        return ScalingDecision(
            num_prefill=prefill.target, num_decode=decode.target,
            reason=f"prefill: {prefill.reason}; decode: {decode.reason}",
            inputs=self._inputs(observation, forecast, demand, sizing, prefill, decode),
        )

    def _previous(self, is_prefill: bool, pool: PoolObservation) -> int:
        """The target the pool is heading to: the last one set (when actuated), else what runs
        or starts."""
        state = self._pools[is_prefill]
        if state.last_target is not None and not self._controls.is_dry_run:
            return state.last_target
        return pool.num_ready + pool.num_starting

    def _pool_step(self, is_prefill: bool, need: float, pool: PoolObservation,
                   now_s: float) -> _PoolStep:
        """One pool's target from its fractional ``need`` (forecast plus headroom): override or
        freeze, else up at once / down after the delay, outside a margin, in limited steps."""
        config, controls = self.config, self._controls
        state = self._pools[is_prefill]
        bounds = controls.prefill_bounds if is_prefill else controls.decode_bounds
        desired = instances_for(need)
        history = state.need_history
        history.append((now_s, need))
        while len(history) > 1 and history[1][0] <= now_s - config.scale_down_delay_s:
            history.popleft()  # keep one entry at or before the window's start
        previous = self._previous(is_prefill, pool)
        override = controls.override_for(is_prefill, now_s)
        if override is not None:
            return _PoolStep(override, desired,
                             f"manual override to {override} until t={controls.override_until_s:g}")
        if controls.is_frozen:
            return _PoolStep(previous, desired, f"frozen at {previous}")
        if desired >= previous:
            target, why = desired, ("scale up to forecast" if desired > previous else "hold")
        else:
            # Down only when even the highest need of the whole window, plus a margin, fits in
            # fewer instances: noise around an instance boundary then never flips the target.
            is_window_full = history[0][0] <= now_s - config.scale_down_delay_s
            margin = max(config.scale_down_margin,
                         config.scale_down_noise_multiple * self._noise_fraction())
            stable = instances_for(max(value for _, value in history) * (1.0 + margin))
            if not is_window_full or stable >= previous:
                target, why = previous, (
                    f"hold: need not below {previous} for {config.scale_down_delay_s:g} s")
            else:
                max_step = max(1, math.floor(config.max_scale_down_fraction * previous))
                target = max(stable, previous - max_step)
                why = (f"scale down (highest need over {config.scale_down_delay_s:g} s "
                       f"+ {margin:.0%}: {stable})")
        clamped = bounds.clamp(target)
        if clamped != target:
            why += f"; bounded to [{bounds.min_instances}, {bounds.max_instances}]"
        return _PoolStep(clamped, desired, why)

    def _fit_budget(self, prefill: _PoolStep, decode: _PoolStep, sizing: PoolSizing,
                    is_final: bool = False) -> tuple[_PoolStep, _PoolStep]:
        """Cut targets until both pools fit ``max_gpus``: each cut takes one instance from the
        pool whose target exceeds its need by the larger factor (never below its minimum)."""
        controls, profile = self._controls, self.profile
        if not controls.max_gpus:
            return prefill, decode
        num_prefill, num_decode = prefill.target, decode.target
        gpus_p, gpus_d = profile.num_gpus_per_prefill, profile.num_gpus_per_decode
        min_p = controls.prefill_bounds.min_instances
        min_d = controls.decode_bounds.min_instances
        while num_prefill * gpus_p + num_decode * gpus_d > controls.max_gpus:
            can_p, can_d = num_prefill > min_p, num_decode > min_d
            if not (can_p or can_d):
                break
            cover_p = num_prefill / max(sizing.num_prefill, _EPSILON)
            cover_d = num_decode / max(sizing.num_decode, _EPSILON)
            if can_p and (not can_d or cover_p >= cover_d):
                num_prefill -= 1
            else:
                num_decode -= 1
        note = f"; GPU budget {controls.max_gpus}" if not is_final else "; GPU budget (final)"
        if num_prefill != prefill.target:
            prefill = replace(prefill, target=num_prefill, reason=prefill.reason + note)
        if num_decode != decode.target:
            decode = replace(decode, target=num_decode, reason=decode.reason + note)
        return prefill, decode

    def _rate_limit(self, is_prefill: bool, step: _PoolStep, pool: PoolObservation,
                    now_s: float) -> _PoolStep:
        """At most ``max_step_per_minute`` instances added or removed in any 60 s (overrides
        are the operator's own and are not limited)."""
        controls = self._controls
        limit = controls.max_step_per_minute
        if not limit or controls.override_for(is_prefill, now_s) is not None:
            return step
        state = self._pools[is_prefill]
        while state.changes and state.changes[0][0] <= now_s - RATE_LIMIT_WINDOW_S:
            state.changes.popleft()
        used = 0 if controls.is_dry_run else sum(delta for _, delta in state.changes)
        allowance = max(0, limit - used)
        previous = self._previous(is_prefill, pool)
        delta = step.target - previous
        if abs(delta) <= allowance:
            return step
        target = previous + (allowance if delta > 0 else -allowance)
        return replace(step, target=target,
                       reason=step.reason + f"; rate limited to {limit}/min")

    def _commit(self, is_prefill: bool, target: int, now_s: float) -> None:
        state = self._pools[is_prefill]
        if self._controls.is_dry_run:
            state.last_target = None  # nothing was actuated: next time start from what runs
            return
        previous = state.last_target
        if previous is not None and target != previous:
            state.changes.append((now_s, abs(target - previous)))
        state.last_target = target

    def _inputs(self, observation: ScalingObservation, forecast: Forecast, demand: Demand,
                sizing: PoolSizing, prefill: _PoolStep,
                decode: _PoolStep) -> dict[str, float | int | str]:
        controls = self._controls
        inputs: dict[str, float | int | str] = {
            "forecast_rate_per_s": forecast.rate_per_s,
            "forecast_level_per_s": forecast.level_per_s,
            "forecast_trend_per_s_per_interval": forecast.trend_per_s_per_interval,
            "forecast_lead_rate_per_s": forecast.lead_rate_per_s,
            "forecast_lead_s": forecast.lead_s,
            "forecast_lead_intervals": forecast.lead_intervals,
            "forecast_num_lead_errors": forecast.num_lead_errors,
            "headroom_per_s": forecast.headroom_per_s,
            "headroom_source": forecast.headroom_source,
            "demand_rate_per_s": demand.arrival_rate_per_s,
            "observed_rate_per_s": (observation.arrival_rates_per_s[-1]
                                    if observation.arrival_rates_per_s else 0.0),
            "mean_prompt_tokens": demand.mean_prompt_tokens,
            "mean_output_tokens": demand.mean_output_tokens,
            "interval_s": observation.interval_s,
            "cold_start_s": observation.cold_start_s,
            "slo_attainment": observation.slo_attainment,
            "prefill_rate_per_instance": sizing.prefill_rate_per_instance,
            "decode_rate_per_instance": sizing.decode_rate_per_instance,
            "decode_batch_size": sizing.decode_batch_size,
            "decode_limit": sizing.decode_limit.value,
            "is_dry_run": int(controls.is_dry_run),
            "is_frozen": int(controls.is_frozen),
            "max_step_per_minute": controls.max_step_per_minute,
            "max_gpus": controls.max_gpus,
        }
        for name, step, pool, need, bounds, override in (
                ("prefill", prefill, observation.prefill, sizing.num_prefill,
                 controls.prefill_bounds, controls.override_prefill_instances),
                ("decode", decode, observation.decode, sizing.num_decode,
                 controls.decode_bounds, controls.override_decode_instances)):
            inputs.update({
                f"{name}_need": need,
                f"{name}_desired": step.desired,
                f"{name}_target": step.target,
                f"{name}_current": pool.num_ready + pool.num_starting,
                f"{name}_ready": pool.num_ready,
                f"{name}_starting": pool.num_starting,
                f"{name}_draining": pool.num_draining,
                f"{name}_utilization": pool.utilization,
                f"{name}_queued_tokens": pool.num_queued_tokens,
                f"{name}_min": bounds.min_instances,
                f"{name}_max": bounds.max_instances,
                f"{name}_override": override if override is not None else -1,
                f"{name}_reason": step.reason,
            })
        inputs["override_until_s"] = controls.override_until_s
        inputs["now_s"] = observation.now_s
        return {key: (value if not isinstance(value, float) or math.isfinite(value) else 0.0)
                for key, value in inputs.items()}
