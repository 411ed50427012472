"""Colocated baseline: the mixed-step cost agrees with both pure phases, prefill chunks slow
decode steps more as they grow, the interference shows in TPOT and TTFT, and the search returns
its best configuration."""

from __future__ import annotations

import itertools

import pytest

from pdserve.capacity import colocated as co
from pdserve.capacity import workload as wl
from pdserve.capacity.plan_inputs import Demand, InstanceShape, Slo
from pdserve.common.errors import InvalidArgumentError

SHAPE = InstanceShape("llama-3.1-70b", "h100", 4)
SLO = Slo(ttft_s=1.0, tpot_s=0.05)
CASES = [("llama-3.1-70b", "h100", 4), ("llama-3.1-8b", "a100-sxm-80gb", 1),
         ("mixtral-8x7b", "h100", 2), ("deepseek-v3", "h200", 8)]


def _perf(case: tuple[str, str, int]) -> object:
    return InstanceShape(*case).perf()


@pytest.mark.parametrize("case", CASES)
def test_mixed_step_reduces_to_the_pure_phases(case: tuple[str, str, int]) -> None:
    perf = _perf(case)
    for batch, context in ((1, 900), (32, 40_000), (200, 300_000)):
        assert co.mixed_step_time_s(perf, batch, context, 0) == pytest.approx(
            perf.decode_step_time_s(batch, context), rel=1e-12)
    for prompt in (64, 1000, 8000):
        assert co.mixed_step_time_s(perf, 0, 0, prompt, 0) == pytest.approx(
            perf.prefill_time_s([prompt]), rel=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_decode_slowdown_grows_with_chunk_size(case: tuple[str, str, int]) -> None:
    perf = _perf(case)
    batch, context = 48, 48 * 1500
    decode_s = perf.decode_step_time_s(batch, context)
    slowdowns = [co.mixed_step_time_s(perf, batch, context, chunk, 1000) - decode_s
                 for chunk in (16, 64, 256, 1024, 4096)]
    assert slowdowns[0] >= 0
    assert all(a < b for a, b in itertools.pairwise(slowdowns))
    # Piggybacking never costs more than running the chunk as its own pass, and a big chunk
    # costs at least its compute at the prefill efficiency (no free lunch once compute-bound).
    for chunk in (64, 1024, 4096):
        mixed = co.mixed_step_time_s(perf, batch, context, chunk, 0)
        assert mixed <= decode_s + perf.prefill_time_s([chunk]) + 1e-12
    big = co.mixed_step_time_s(perf, batch, context, 4096, 0)
    assert big >= perf.prefill_time_s([4096]) - perf.efficiency.prefill_overhead_s


def test_chunk_offset_reproduces_causal_attention_work() -> None:
    workload = wl.Workload.of(Demand(1.0, (1000, 3000), (10, 10)))
    for chunk in (100.0, 500.0):
        offset = co.chunk_offset_tokens(workload, chunk)
        # Per prompt token: E[l^2] / E[l] = (1e6 + 9e6) / 4000 = 2500 = 2 o + c.
        assert 2 * offset + chunk == pytest.approx(2500.0)


def _demand(rate_per_s: float) -> Demand:
    return Demand.from_means(rate_per_s, 1000, 200, num_points=128)


def test_prefill_load_inflates_tpot_and_ttft() -> None:
    config = co.ColocatedConfig(SHAPE, 4, 512)
    light, heavy = (co.predict_colocated(config, _demand(rate), SLO) for rate in (1.0, 10.0))
    assert light.is_stable and heavy.is_stable
    assert heavy.prefill_utilization > light.prefill_utilization
    assert heavy.mean_tpot_s > light.mean_tpot_s
    assert heavy.ttft_s > light.ttft_s
    assert heavy.attainment <= light.attainment
    # With (almost) no load, a sequence runs alone: pure decode steps of a batch of one.
    idle = co.predict_colocated(config, _demand(1e-6), SLO)
    context = wl.context_per_sequence(wl.Workload.of(_demand(1.0)))
    assert idle.mean_tpot_s == pytest.approx(SHAPE.perf().decode_step_time_s(1, context),
                                             rel=1e-3)
    assert not co.predict_colocated(config, _demand(500.0), SLO).is_stable


def test_bigger_chunks_shorten_ttft() -> None:
    small, big = (co.predict_colocated(co.ColocatedConfig(SHAPE, 4, budget), _demand(8.0), SLO)
                  for budget in (256, 2048))
    assert big.ttft_s < small.ttft_s


def test_best_colocated_is_the_best_of_what_it_tried() -> None:
    shapes = (SHAPE, InstanceShape("llama-3.1-70b", "h100", 8))
    best, tried = co.best_colocated(_demand(8.0), SLO, shapes, 16, token_budgets=(256, 1024))
    assert len(tried) == 4
    assert best is tried[0]
    assert all(best.goodput_per_gpu >= r.goodput_per_gpu for r in tried)
    rate = best.goodput_rate_per_s
    demand = _demand(rate)
    assert co.predict_colocated(best.config, demand, SLO).attainment >= 0.9
    assert co.predict_colocated(best.config, demand.with_rate(rate * 1.01), SLO).attainment < 0.9


def test_bad_colocated_input() -> None:
    with pytest.raises(InvalidArgumentError, match="num_instances"):
        co.ColocatedConfig(SHAPE, 0, 512)
    with pytest.raises(InvalidArgumentError, match="token_budget"):
        co.ColocatedConfig(SHAPE, 1, 1)
    with pytest.raises(InvalidArgumentError, match="tp_size 3"):
        co.best_colocated(_demand(1.0), SLO, (InstanceShape("llama-3.1-70b", "h100", 3),), 12)
