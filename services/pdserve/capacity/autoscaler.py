"""The cold-start-aware autoscaler: a pure ``ScalingPolicy`` that sizes the prefill and decode
pools of one deployment ahead of demand.

A new instance serves only ``cold_start_s`` after it is launched (minutes for a large model), so
every decision sizes the pools for the demand expected over the next ``lead_s = cold_start_s +
interval_s`` (the instances launched now are ready after the cold start, and the next decision
can correct course one interval later). Each call:

1. **Forecast** (``forecast.DemandForecaster``): Holt's damped linear trend on the per-interval
   arrival rates, plus a surge test for steep ramps; the policy sizes for the highest forecast
   on the path from now to the lead.
2. **Headroom** from forecast error (same module): a quantile of the errors of the forecasts
   made one lead time earlier, never less than ``min_headroom_fraction`` of the forecast.
3. **Demand to instances** with the capacity and performance models (``sizing.size_pools``),
   each pool from its own quantities, backlog cleared within the lead.
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

import math
from collections import deque
from dataclasses import dataclass, field, replace

from pdserve.capacity.controls import AutoscalerConfig, AutoscalerControls
from pdserve.capacity.forecast import DemandForecaster, Forecast
from pdserve.capacity.scaling import PoolObservation, ScalingDecision, ScalingObservation
from pdserve.capacity.sizing import (
    InstanceProfile,
    PoolSizing,
    SizingDemand,
    instances_for,
    size_pools,
)

RATE_LIMIT_WINDOW_S = 60.0
"""``max_step_per_minute`` counts target changes over this rolling window."""

DEFAULT_CONFIG = AutoscalerConfig()
NO_CONTROLS = AutoscalerControls()
"""The operator's controls until any are set: no bounds but the defaults, no budget."""

_EPSILON = 1e-9


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


class Autoscaler:
    """The cold-start-aware autoscaler of one deployment (module docstring). Implements
    ``ScalingPolicy``: synchronous, no I/O, state only in memory (forecast, error history,
    hysteresis windows). Operator controls change with ``set_controls``."""

    def __init__(self, profile: InstanceProfile, config: AutoscalerConfig = DEFAULT_CONFIG,
                 controls: AutoscalerControls = NO_CONTROLS) -> None:
        controls.check(profile)
        self.profile = profile
        self.config = config
        self._controls = controls
        self._forecaster = DemandForecaster(config)
        self._pools = {True: _PoolState(), False: _PoolState()}  # keyed by is_prefill

    @property
    def controls(self) -> AutoscalerControls:
        return self._controls

    def set_controls(self, controls: AutoscalerControls) -> None:
        """Replace the operator controls (checked first; nothing changes if they are bad)."""
        controls.check(self.profile)
        self._controls = controls

    # -- deciding -------------------------------------------------------------------------

    def decide(self, observation: ScalingObservation) -> ScalingDecision:
        self._forecaster.observe(observation)
        forecast = self._forecaster.forecast(observation)
        mean_prompt_tokens = self._forecaster.mean_prompt_tokens
        demand = SizingDemand(
            arrival_rate_per_s=forecast.rate_per_s + forecast.headroom_per_s,
            mean_prompt_tokens=mean_prompt_tokens or 1.0,
            mean_output_tokens=self._forecaster.mean_output_tokens or 1.0,
            num_queued_prefill_tokens=observation.prefill.num_queued_tokens,
            num_queued_decode_seqs=(observation.decode.num_queued_tokens
                                    / max(1.0, mean_prompt_tokens)),
            backlog_horizon_s=forecast.lead_s,
            mean_squared_prompt_tokens=self._forecaster.mean_squared_prompt_tokens,
            mean_cubed_prompt_tokens=self._forecaster.mean_cubed_prompt_tokens,
            mean_squared_output_tokens=self._forecaster.mean_squared_output_tokens,
            mean_prompt_output_tokens=self._forecaster.mean_prompt_output_tokens,
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
                         config.scale_down_noise_multiple * self._forecaster.noise_fraction())
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

    def _inputs(self, observation: ScalingObservation, forecast: Forecast, demand: SizingDemand,
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
            "mean_squared_prompt_tokens": demand.mean_squared_prompt_tokens,
            "mean_cubed_prompt_tokens": demand.mean_cubed_prompt_tokens,
            "mean_squared_output_tokens": demand.mean_squared_output_tokens,
            "mean_prompt_output_tokens": demand.mean_prompt_output_tokens,
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
