"""The live local-prefill threshold: the planner's computation on one interval's observations,
and the decision a pin overrides (``pdserve.capacity.local_prefill``)."""

from __future__ import annotations

import pytest

from pdserve.capacity.disaggregated import local_prefill_threshold_tokens
from pdserve.capacity.local_prefill import (
    ComputedThreshold,
    ThresholdInputs,
    compute_threshold,
    decide_threshold,
)
from pdserve.capacity.plan_inputs import Demand, DisaggConfig, InstanceShape, Slo
from pdserve.common.types import PublishedThreshold, ThresholdSource

SHAPE = InstanceShape("llama-3.1-8b", "h100-sxm-80gb", 1)
SLO = Slo(ttft_s=2.0, tpot_s=0.1)
PROMPTS = Demand.from_means(5.0, 2000.0, 8.0, num_points=64).prompt_tokens
"""Exponential prompt lengths, mean 2,000 tokens."""


def _inputs(rate_per_s: float = 5.0, prompt_tokens: tuple[int, ...] = PROMPTS,
            speedup: float = 1.0, **kwargs: object) -> ThresholdInputs:
    values: dict[str, object] = dict(deployment="llama", shape=SHAPE, rate_per_s=rate_per_s,
                                     prompt_tokens=prompt_tokens, mean_output_tokens=8.0,
                                     num_prefill=1, num_decode=1, slo=SLO, speedup=speedup)
    values.update(kwargs)
    return ThresholdInputs(**values)  # type: ignore[arg-type]


def test_the_computation_is_the_planners_on_the_observed_demand() -> None:
    computed = compute_threshold(_inputs())
    demand = Demand(5.0, PROMPTS, Demand.from_means(1.0, 1.0, 8.0, num_points=64)
                    .output_tokens)
    expected = local_prefill_threshold_tokens(DisaggConfig(SHAPE, SHAPE, 1, 1), demand, SLO)
    assert computed.threshold_tokens == expected
    assert expected > 0  # long prompts on a busy prefill pool: some local prefill pays
    assert computed.inputs["arrival_rate_per_s"] == 5.0
    assert computed.inputs["prompt_tokens_p50"] == sorted(PROMPTS)[32]
    assert computed.inputs["num_requests"] == 64
    assert computed.inputs["num_prefill_ready"] == 1 and computed.inputs["slo_ttft_ms"] == 2000.0


def test_simulated_instances_are_planned_in_their_own_time() -> None:
    fast = compute_threshold(_inputs(rate_per_s=500.0, speedup=100.0))
    assert fast.threshold_tokens == compute_threshold(_inputs(rate_per_s=5.0)).threshold_tokens
    assert fast.inputs["speedup"] == 100.0


def test_an_interval_without_requests_computes_nothing() -> None:
    for inputs in (_inputs(prompt_tokens=()), _inputs(rate_per_s=0.0)):
        computed = compute_threshold(inputs)
        assert computed.threshold_tokens is None and "no requests" in computed.reason


def test_a_pin_wins_and_the_computation_is_kept_beside_it() -> None:
    computed = ComputedThreshold(96, "planner")
    pinned = decide_threshold(512, computed)
    assert pinned is not None
    assert (pinned.threshold_tokens, pinned.source, pinned.computed_tokens) == (
        512, ThresholdSource.PINNED, 96)
    assert decide_threshold(0, None) is not None  # pinned at 0: always remote
    plain = decide_threshold(None, computed)
    assert plain is not None and (plain.threshold_tokens, plain.source) == (
        96, ThresholdSource.COMPUTED)
    assert decide_threshold(None, ComputedThreshold(None, "no requests")) is None
    assert decide_threshold(None, None) is None


@pytest.mark.parametrize("published, differs", [
    (None, True),
    (PublishedThreshold("llama", 96, ThresholdSource.COMPUTED, 4, 0.0), False),
    (PublishedThreshold("llama", 64, ThresholdSource.COMPUTED, 4, 0.0), True),
    (PublishedThreshold("llama", 96, ThresholdSource.PINNED, 4, 0.0), True),
])
def test_only_a_change_is_published(published: PublishedThreshold | None, differs: bool) -> None:
    decision = decide_threshold(None, ComputedThreshold(96, "planner"))
    assert decision is not None and decision.differs_from(published) is differs
