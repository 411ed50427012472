"""How one deployment's autoscaler is configured: its tunables (``AutoscalerConfig``: sizing,
forecast, headroom, hysteresis; fixed when the governor starts) and the operator's controls
(``AutoscalerControls`` with a ``PoolBounds`` per pool: dry run, freeze, bounds, a manual
override, a step limit and a GPU budget; changed at run time through ``SetAutoscalerControls``
and kept in the durable store)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pdserve.capacity.sizing import InstanceProfile, SizingConfig
from pdserve.common.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    """Tunables of the autoscaler (the operator's controls are ``AutoscalerControls``).

    ``alpha``/``beta``: smoothing of level and trend, in (0, 1]; ``damping``: trend damping phi
    in (0, 1]. ``error_window``: intervals of forecast errors kept. ``scale_down_delay_s``: how
    long the need must stay below the current size before the pool shrinks;
    ``scale_down_margin``: how far below (a fraction of the need), the hysteresis band, widened
    to ``scale_down_noise_multiple`` times the rate's relative one-interval noise when that is
    larger (noisier demand needs a wider band not to flap). ``surge_horizon_s`` None projects a
    detected surge over the whole lead. The defaults above were chosen on
    ``bench/autoscale.py``'s day (several seeds): they trade GPU-hours against the share of a
    +60% burst the running instances absorb before new ones are ready.

    ``length_memory_requests``: the request lengths' moments are those of about this many of
    the latest requests (weighted by arrivals; 0: the latest interval's alone), so that their
    sampling noise does not depend on the rate; 2,000 keeps the decode need's noise from a
    long-tailed prompt distribution near 4% (see ``DemandForecaster._learn_lengths``) and
    takes half of a change of lengths within a minute at 30 requests per second.
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
    length_memory_requests: float = 2000.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "damping", "headroom_quantile"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InvalidArgumentError(f"{name} must be in (0, 1], got {value}", field=name)
        for name in ("min_headroom_fraction", "initial_headroom_fraction", "scale_down_delay_s",
                     "scale_down_margin", "scale_down_noise_multiple", "max_scale_down_fraction",
                     "length_memory_requests"):
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
