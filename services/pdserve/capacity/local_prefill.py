"""The live local-prefill threshold: what the governor computes for a deployment from what it
observed in one interval, and what it publishes to the routers (a pin wins over the computation).

The computation is the planner's (``disaggregated.local_prefill_threshold_tokens``: the stall a
local prefill costs the decode batch against the TTFT it saves, each in units of its SLO), run on
the pools as they are now (ready instances, at least one each) and the interval's demand: its
arrival rate, the prompt lengths of its requests (their tickets) and the estimated mean output
length (exponential lengths with that mean, ``Demand.from_means``). Simulated instances
(``speedup`` simulated seconds per wall second) are planned in their own time: rates divided by
the speed-up, SLO bounds multiplied by it.

Pure functions of frozen values: no clock, no I/O. The governor (``governor.autoscaling``) runs
``compute_threshold`` off the event loop and ``decide_threshold`` on each pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.capacity.disaggregated import local_prefill_threshold_tokens
from pdserve.capacity.plan_inputs import Demand, DisaggConfig, InstanceShape, Slo
from pdserve.common.types import PublishedThreshold, ThresholdSource

MAX_PROMPT_SAMPLES = 4096
"""Prompt lengths of one interval the computation reads (evenly subsampled beyond it)."""


@dataclass(frozen=True, slots=True)
class ThresholdInputs:
    """What one interval showed of a deployment. ``prompt_tokens``: the prompt length of each
    request that arrived in it (any order); ``rate_per_s``: its arrival rate (wall seconds);
    ``num_prefill``/``num_decode``: ready instances now."""

    deployment: str
    shape: InstanceShape
    rate_per_s: float
    prompt_tokens: tuple[int, ...]
    mean_output_tokens: float
    num_prefill: int
    num_decode: int
    slo: Slo
    speedup: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        """The inputs as the durable decision record keeps them (the length distribution as
        its count, mean and percentiles, not every sample)."""
        prompts = sorted(self.prompt_tokens)

        def quantile(q: float) -> int:
            return prompts[min(len(prompts) - 1, int(q * len(prompts)))] if prompts else 0

        return {
            "model": self.shape.model, "gpu": self.shape.gpu, "tp_size": self.shape.tp_size,
            "arrival_rate_per_s": self.rate_per_s, "num_requests": len(prompts),
            "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else 0.0,
            "prompt_tokens_p10": quantile(0.10), "prompt_tokens_p50": quantile(0.50),
            "prompt_tokens_p90": quantile(0.90), "prompt_tokens_max": prompts[-1] if prompts else 0,
            "mean_output_tokens": self.mean_output_tokens, "prefix_hit_rate": 0.0,
            "num_prefill_ready": self.num_prefill, "num_decode_ready": self.num_decode,
            "slo_ttft_ms": self.slo.ttft_s * 1000.0, "slo_tpot_ms": self.slo.tpot_s * 1000.0,
            "slo_percentile": self.slo.percentile, "speedup": self.speedup,
        }


@dataclass(frozen=True, slots=True)
class ComputedThreshold:
    """The planner's threshold for one interval, or None with the reason it could not say."""

    threshold_tokens: int | None
    reason: str
    inputs: Mapping[str, Any] = field(default_factory=dict)


def _subsample(values: Sequence[int], limit: int) -> tuple[int, ...]:
    if len(values) <= limit:
        return tuple(values)
    step = len(values) / limit
    return tuple(values[int(i * step)] for i in range(limit))


def compute_threshold(inputs: ThresholdInputs) -> ComputedThreshold:
    """The planner's local-prefill threshold for the interval (module docstring). None when
    the interval had no request (nothing to plan from: the threshold in force stays)."""
    recorded = inputs.as_dict()
    prompts = [max(1, int(p)) for p in inputs.prompt_tokens]
    if not prompts or inputs.rate_per_s <= 0:
        return ComputedThreshold(None, "no requests in the interval", recorded)
    prompts = list(_subsample(prompts, MAX_PROMPT_SAMPLES))
    outputs = Demand.from_means(1.0, 1.0, max(1.0, inputs.mean_output_tokens),
                                num_points=len(prompts)).output_tokens
    speedup = inputs.speedup
    demand = Demand(inputs.rate_per_s / speedup, tuple(prompts), outputs)
    slo = Slo(inputs.slo.ttft_s * speedup, inputs.slo.tpot_s * speedup, inputs.slo.percentile)
    config = DisaggConfig(inputs.shape, inputs.shape, max(1, inputs.num_prefill),
                          max(1, inputs.num_decode))
    threshold = local_prefill_threshold_tokens(config, demand, slo)
    reason = ("planner: local prefill up to the threshold keeps the SLO attainment" if threshold
              else "planner: no local prefill pays for its decode stalls")
    return ComputedThreshold(threshold, reason, recorded)


@dataclass(frozen=True, slots=True)
class ThresholdDecision:
    """What the governor puts in force for a deployment this pass, and why."""

    threshold_tokens: int
    source: ThresholdSource
    reason: str
    computed_tokens: int | None
    """What the planner computed this pass (also recorded while pinned); None: nothing."""

    def differs_from(self, published: PublishedThreshold | None) -> bool:
        """Whether publishing it changes what the routers read."""
        return (published is None or published.threshold_tokens != self.threshold_tokens
                or published.source is not self.source)


def decide_threshold(pin_tokens: int | None,
                     computed: ComputedThreshold | None) -> ThresholdDecision | None:
    """A pin wins; otherwise the planner's value; None when there is neither (the threshold in
    force, or the routers' own setting, stays)."""
    computed_tokens = computed.threshold_tokens if computed is not None else None
    if pin_tokens is not None:
        return ThresholdDecision(pin_tokens, ThresholdSource.PINNED, "pinned by an operator",
                                 computed_tokens)
    if computed is None or computed_tokens is None:
        return None
    return ThresholdDecision(computed_tokens, ThresholdSource.COMPUTED, computed.reason,
                             computed_tokens)
