"""Decode sizing checked on the discrete-event simulator: a KV-bound pool sized from the length
moments holds its load, where the same pool sized from the means alone queues without bound.

Long prompts and short outputs make the blocks held while a prompt is prefilled (reserved on the
decode instance at routing) a large share of the KV: the means-only arithmetic does not see it.
"""

from __future__ import annotations

from pdserve.capacity.sizing import (
    InstanceProfile,
    LengthMoments,
    SizingConfig,
    instances_for,
    size_pools,
)
from pdserve.sim import ClusterSpec, SimConfig, SloSpec, simulate
from pdserve.sim.traces import LengthSpec, synthetic_trace

MODEL, GPU, TP = "llama-3.1-70b", "h100-sxm-80gb", 4
PROMPT = LengthSpec(16_000, 1.5, 1_000, 120_000)
OUTPUT = LengthSpec(200, 1.0, 8, 4_000)
DURATION_S = 2_400.0


def test_kv_bound_decode_sized_from_the_moments_holds_where_the_means_alone_queue() -> None:
    profile = InstanceProfile.from_catalog(MODEL, GPU, prefill_tp_size=TP, decode_tp_size=TP)
    sizing = SizingConfig(tpot_slo_s=0.1)
    probe = synthetic_trace(20_000, 1.0, seed=3, prompt=PROMPT, output=OUTPUT)
    moments = LengthMoments.measured(probe.prompt_tokens, probe.output_tokens)
    means = LengthMoments.of(moments.prompt, moments.output)
    # The load three decode instances serve at the target utilisation by the means alone.
    rate = 3 * size_pools(profile, sizing, means.demand(1.0)).decode_rate_per_instance
    by_means = size_pools(profile, sizing, means.demand(rate))
    by_moments = size_pools(profile, sizing, moments.demand(rate))
    assert instances_for(by_means.num_decode) == 3
    assert instances_for(by_moments.num_decode) == 4
    # Prefill is plentiful in both runs, so only the decode pools differ.
    num_prefill = instances_for(by_moments.num_prefill) + 2
    trace = synthetic_trace(int(rate * DURATION_S), rate, seed=4, prompt=PROMPT, output=OUTPUT)

    def admission_waits(num_decode: int) -> list[float]:
        """Mean wait for decode KV room of the requests arriving in each 10-minute window
        after the first 5 minutes."""
        result = simulate(trace, SimConfig(ClusterSpec(num_prefill, num_decode, model=MODEL,
                                                       gpu=GPU, tp_size=TP),
                                           slo=SloSpec(ttft_ms=5_000, tpot_ms=100)))
        waits = []
        for start in (300.0, 900.0, 1_500.0):
            window = (result.arrival_s > start) & (result.arrival_s <= start + 600.0)
            waits.append(float(result.admission_wait_s[window].mean()))
        return waits

    short = admission_waits(3)
    assert short[0] > 10.0 and short[2] > 2 * short[0]  # over capacity: the queue only grows
    held = admission_waits(4)
    assert max(held) < 1.0
