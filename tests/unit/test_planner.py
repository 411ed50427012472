"""SLO planner: queueing formulas against hand computations, monotonicity, the planner meeting
its own predictions (and being minimal), the goodput definition, the local-prefill threshold,
and bad input."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pdserve.capacity import disaggregated as dg
from pdserve.capacity import planner as pl
from pdserve.capacity import queueing as qu
from pdserve.capacity import workload as wl
from pdserve.capacity.plan_inputs import Demand, DisaggConfig, InstanceShape, Slo
from pdserve.common.errors import InvalidArgumentError

SHAPE = InstanceShape("llama-3.1-70b", "h100", 4)
SHAPES = (SHAPE,)
SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def _demand(rate_per_s: float, prefix_hit_rate: float = 0.0) -> Demand:
    return Demand.from_means(rate_per_s, 1000, 200, prefix_hit_rate=prefix_hit_rate,
                             num_points=128)


# -- queueing by hand --------------------------------------------------------------------------


def test_erlang_c_matches_hand_computation() -> None:
    # M/M/2, a = 1 Erlang: C = (a^2/2! * 2/(2-1)) / (1 + a + a^2/2! * 2/(2-1)) = 1/3.
    assert qu.erlang_c(2, 1.0) == pytest.approx(1.0 / 3.0, rel=1e-12)
    # M/M/1: the probability of waiting is the utilisation.
    assert qu.erlang_c(1, 0.7) == pytest.approx(0.7, rel=1e-12)
    # M/M/3, a = 2: sum_{k<3} 2^k/k! = 5, tail term 8/6 * 3 = 4 -> C = 4/9.
    assert qu.erlang_c(3, 2.0) == pytest.approx(4.0 / 9.0, rel=1e-12)
    assert qu.erlang_c(4, 4.0) == 1.0


def test_single_server_wait_is_pollaczek_khinchine() -> None:
    # M/D/1: lambda = 2/s, S = 0.3 s: Wq = lambda E[S^2] / (2 (1 - rho)) = 2*0.09/(2*0.4).
    wait = qu.mgc_wait(2.0, 0.3, 0.0, 1)
    assert wait.mean_s == pytest.approx(0.225, rel=1e-12)
    assert wait.prob_wait == pytest.approx(0.6, rel=1e-12)
    # M/M/1 (scv 1): Wq = rho / (mu - lambda) = 0.6 / (10/3 - 2).
    assert qu.mgc_wait(2.0, 0.3, 1.0, 1).mean_s == pytest.approx(0.6 / (10 / 3 - 2), rel=1e-12)


def test_mmc_wait_is_exact_for_exponential_service() -> None:
    # M/M/2, lambda = 1, mu = 1: Wq = C / (c mu - lambda) = (1/3) / 1; tail P(W > t) = C e^{-t}.
    wait = qu.mgc_wait(1.0, 1.0, 1.0, 2)
    assert wait.mean_s == pytest.approx(1.0 / 3.0, rel=1e-12)
    assert float(wait.ccdf(np.array([2.0]))[0]) == pytest.approx(math.exp(-2.0) / 3.0, rel=1e-12)
    assert qu.mgc_wait(3.0, 1.0, 1.0, 2) is qu.UNSTABLE


def test_sum_of_waits_has_the_right_atom_and_mean() -> None:
    first, second = qu.WaitDistribution(0.4, 0.2), qu.WaitDistribution(0.7, 0.5)
    at_zero = float(qu.sum_ccdf(first, second, np.array([0.0]))[0])
    assert at_zero == pytest.approx(1.0 - 0.6 * 0.3, rel=1e-12)
    grid = np.linspace(0.0, 20.0, 200_001)
    mean = float(np.trapezoid(qu.sum_ccdf(first, second, grid), grid))
    assert mean == pytest.approx(first.mean_s + second.mean_s, rel=1e-4)
    same = qu.WaitDistribution(0.5, 0.3)
    mean_same = float(np.trapezoid(qu.sum_ccdf(same, same, grid), grid))
    assert mean_same == pytest.approx(2 * same.mean_s, rel=1e-4)


def test_normal_cdf_known_values() -> None:
    values = qu.normal_cdf(np.array([0.0, 1.0, -1.959964, 3.0]))
    assert values == pytest.approx([0.5, 0.841344746, 0.025, 0.998650102], abs=2e-7)


# -- goodput definition ------------------------------------------------------------------------


def test_max_rate_finds_the_90_percent_crossing() -> None:
    # Attainment falls linearly: 1 - rate / 100 -> 90% is met up to rate 10 exactly.
    rate = pl.max_rate(lambda r: 1.0 - r / 100.0, 0.9, 1.0, relative_tolerance=1e-6)
    assert rate == pytest.approx(10.0, rel=1e-5)
    assert rate <= 10.0
    # A step: everything met up to 7.5 req/s, nothing above.
    rate = pl.max_rate(lambda r: 1.0 if r <= 7.5 else 0.0, 0.9, 50.0, relative_tolerance=1e-6)
    assert rate == pytest.approx(7.5, rel=1e-5)
    assert pl.max_rate(lambda r: 0.5, 0.9, 1.0) == 0.0


def test_goodput_is_the_rate_where_attainment_crosses_the_target() -> None:
    demand = _demand(10.0)
    config = DisaggConfig(SHAPE, SHAPE, 2, 2)
    rate = pl.goodput_rate_per_s(config, demand, SLO)
    assert rate > 0
    assert dg.predict(config, demand.with_rate(rate), SLO).attainment >= 0.9
    assert dg.predict(config, demand.with_rate(rate * 1.01), SLO).attainment < 0.9
    assert pl.goodput_per_gpu(config, demand, SLO) == pytest.approx(rate / 16)
    strict = dataclasses.replace(SLO, percentile=99.0)
    assert pl.goodput_rate_per_s(config, demand, strict) < rate


# -- predictions -------------------------------------------------------------------------------


def test_prediction_degrades_with_load_and_becomes_unstable() -> None:
    config = DisaggConfig(SHAPE, SHAPE, 2, 2)
    light, heavy = (dg.predict(config, _demand(rate), SLO) for rate in (2.0, 12.0))
    assert light.is_stable and heavy.is_stable
    assert heavy.mean_queue_wait_s > light.mean_queue_wait_s
    assert heavy.ttft_s > light.ttft_s
    assert heavy.decode_batch_size > light.decode_batch_size
    assert heavy.mean_tpot_s > light.mean_tpot_s
    assert heavy.attainment <= light.attainment
    overloaded = dg.predict(config, _demand(200.0), SLO)
    assert not overloaded.is_stable and overloaded.attainment == 0.0


def test_decode_batch_follows_littles_law() -> None:
    demand = _demand(8.0)
    config = DisaggConfig(SHAPE, SHAPE, 4, 3)
    prediction = dg.predict(config, demand, SLO)
    workload = wl.Workload.of(demand)
    # mean_tpot_s adds half a step per request (joining the batch); the rest is the step.
    has_steps = workload.steps > 0
    join = float((1.0 + 0.5 / workload.steps[has_steps]).mean())
    step_s = prediction.mean_tpot_s / join
    expected = demand.rate_per_s * float(workload.steps.mean()) * step_s / 3
    assert prediction.decode_batch_size == pytest.approx(expected, rel=1e-6)


def test_prefix_hits_reduce_prefill_work() -> None:
    config = DisaggConfig(SHAPE, SHAPE, 2, 2)
    cold = dg.predict(config, _demand(10.0), SLO)
    warm = dg.predict(config, _demand(10.0, prefix_hit_rate=0.5), SLO)
    assert warm.prefill_utilization < 0.6 * cold.prefill_utilization
    assert warm.mean_ttft_s < cold.mean_ttft_s


# -- planning ----------------------------------------------------------------------------------


def _plan(rate_per_s: float, slo: Slo = SLO) -> pl.Plan:
    return pl.plan(_demand(rate_per_s), slo, SHAPES, SHAPES)


def test_plan_meets_its_own_predictions_and_is_minimal() -> None:
    result = _plan(12.0)
    config, prediction = result.config, result.prediction
    assert prediction.attainment >= SLO.attainment_target
    assert prediction.ttft_s <= SLO.ttft_s
    assert prediction.tpot_s <= SLO.tpot_s
    workload = wl.Workload.of(_demand(12.0))
    for fewer in (dataclasses.replace(config, num_prefill=config.num_prefill - 1),
                  dataclasses.replace(config, num_decode=config.num_decode - 1)):
        if fewer.num_prefill < 1 or fewer.num_decode < 1:
            continue
        fewer = dg.with_threshold(fewer, workload, 12.0, SLO)
        assert dg.predict(fewer, _demand(12.0), SLO).attainment < SLO.attainment_target
    assert result.goodput_rate_per_s >= 12.0
    assert result.goodput_per_gpu == pytest.approx(result.goodput_rate_per_s / config.num_gpus)


def test_higher_rate_needs_more_instances() -> None:
    low, high = _plan(4.0).config, _plan(16.0).config
    assert high.num_prefill >= low.num_prefill and high.num_decode >= low.num_decode
    assert high.num_gpus > low.num_gpus


@pytest.mark.parametrize("tighter", [Slo(ttft_s=0.3, tpot_s=0.05), Slo(ttft_s=1.0, tpot_s=0.032)])
def test_tighter_slo_needs_more_instances(tighter: Slo) -> None:
    loose, tight = _plan(12.0).config, _plan(12.0, tighter).config
    assert tight.num_prefill >= loose.num_prefill and tight.num_decode >= loose.num_decode
    assert tight.num_gpus > loose.num_gpus


def test_plan_picks_the_cheaper_shape() -> None:
    shapes = (InstanceShape("llama-3.1-70b", "h100", 4), InstanceShape("llama-3.1-70b", "h100", 8))
    both = pl.plan(_demand(12.0), SLO, shapes, shapes)
    for prefill in shapes:
        for decode in shapes:
            only = pl.plan(_demand(12.0), SLO, (prefill,), (decode,))
            assert both.config.num_gpus <= only.config.num_gpus


def test_sweep_covers_every_split_and_contains_the_plan_ratio() -> None:
    result = _plan(12.0)
    points = pl.sweep_pd(_demand(12.0), SLO, SHAPE, SHAPE, result.config.num_gpus)
    assert [p.config.num_prefill for p in points] == list(range(1, len(points) + 1))
    assert all(p.config.num_gpus <= result.config.num_gpus for p in points)
    best = max(points, key=lambda p: p.goodput_per_gpu)
    planned = next(p for p in points if p.config.num_prefill == result.config.num_prefill)
    assert best.goodput_per_gpu >= planned.goodput_per_gpu > 0


# -- local-prefill threshold -------------------------------------------------------------------


def test_threshold_grows_with_the_prefill_queue() -> None:
    demand = Demand.from_means(14.0, 400, 200, num_points=128)
    busy = DisaggConfig(SHAPE, SHAPE, 1, 4)
    idle = DisaggConfig(SHAPE, SHAPE, 6, 4)
    assert dg.predict(busy, demand, SLO).mean_queue_wait_s > 5 * dg.predict(
        idle, demand, SLO).mean_queue_wait_s
    busy_threshold = dg.local_prefill_threshold_tokens(busy, demand, SLO)
    idle_threshold = dg.local_prefill_threshold_tokens(idle, demand, SLO)
    assert busy_threshold > idle_threshold >= 0
    with_local = dataclasses.replace(busy, local_prefill_threshold_tokens=busy_threshold)
    prediction = dg.predict(with_local, demand, SLO)
    assert prediction.local_prefill_fraction > 0
    assert prediction.mean_queue_wait_s < dg.predict(busy, demand, SLO).mean_queue_wait_s
    assert prediction.attainment >= min(dg.predict(busy, demand, SLO).attainment,
                                        SLO.attainment_target)


def test_local_prefill_stalls_slow_decode() -> None:
    demand = Demand.from_means(10.0, 300, 200, num_points=128)
    remote = DisaggConfig(SHAPE, SHAPE, 3, 3)
    local = dataclasses.replace(remote, local_prefill_threshold_tokens=4096)
    assert dg.predict(local, demand, SLO).mean_tpot_s > dg.predict(remote, demand, SLO).mean_tpot_s


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "named"), [
    (InstanceShape("no-such-model", "h100", 4), "no-such-model"),
    (InstanceShape("llama-3.1-70b", "no-such-gpu", 4), "no-such-gpu"),
    (InstanceShape("llama-3.1-70b", "h100", 3), "tp_size 3"),
    (InstanceShape("llama-3.1-70b", "a100-sxm-40gb", 1), "does not fit"),
])
def test_bad_shapes_name_the_value(shape: InstanceShape, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        pl.plan(_demand(1.0), SLO, (shape,), SHAPES)


def test_bad_demand_and_slo() -> None:
    with pytest.raises(InvalidArgumentError, match="rate"):
        Demand(-1.0, (10,), (10,))
    with pytest.raises(InvalidArgumentError, match="same non-zero number"):
        Demand(1.0, (10, 20), (10,))
    with pytest.raises(InvalidArgumentError, match=">= 1 token"):
        Demand(1.0, (0,), (10,))
    with pytest.raises(InvalidArgumentError, match="prefix_hit_rate"):
        Demand(1.0, (10,), (10,), prefix_hit_rate=1.0)
    with pytest.raises(InvalidArgumentError, match="SLO"):
        Slo(ttft_s=0.0, tpot_s=0.1)
    with pytest.raises(InvalidArgumentError, match="percentile"):
        Slo(ttft_s=1.0, tpot_s=0.1, percentile=100.0)
    with pytest.raises(InvalidArgumentError, match="instance"):
        DisaggConfig(SHAPE, SHAPE, 0, 1)


def test_unreachable_slo_is_reported() -> None:
    # The unloaded decode step of this shape is ~29 ms: a 10 ms TPOT bound cannot be met.
    with pytest.raises(InvalidArgumentError, match="no configuration"):
        pl.plan(_demand(4.0), Slo(ttft_s=1.0, tpot_s=0.01), SHAPES, SHAPES, max_gpus=64)


# -- against the simulator ---------------------------------------------------------------------


def test_planner_predictions_agree_with_the_simulator() -> None:
    """Planned configuration, same demand (Poisson arrivals, the plan's length sample): the
    simulator's p90 TTFT within 25% (the prefill-queue model is a lower bound, see the planner's
    docstring), p90 TPOT within 8%, attainment within 5 points."""
    sim = pytest.importorskip("pdserve.sim")
    traces = pytest.importorskip("pdserve.sim.traces")
    from pdserve.router.policy import RoutingConfig

    demand = _demand(12.0)
    config = _plan(12.0).config
    sizes = traces.Trace(np.zeros(len(demand.prompt_tokens)),
                         np.asarray(demand.prompt_tokens), np.asarray(demand.output_tokens))
    trace = traces.synthetic_trace(7200, 12.0, seed=3, sizes=sizes)
    simulated = sim.simulate(trace, sim.SimConfig(
        cluster=sim.ClusterSpec(config.num_prefill, config.num_decode, model=SHAPE.model,
                                gpu=SHAPE.gpu, tp_size=SHAPE.tp_size, prefill_batch_tokens=1),
        routing=RoutingConfig(local_prefill_threshold_tokens=config.local_prefill_threshold_tokens),
        slo=sim.SloSpec(ttft_ms=SLO.ttft_s * 1000, tpot_ms=SLO.tpot_s * 1000)))
    counted = simulated.arrival_s >= 60.0
    has_steps = counted & (simulated.output_tokens > 1)
    ttft = float(np.percentile(simulated.ttft_s[counted], 90))
    tpot = float(np.percentile(simulated.tpot_s[has_steps], 90))
    predicted = dg.predict(config, demand, SLO)
    assert predicted.ttft_s == pytest.approx(ttft, rel=0.25)
    assert predicted.tpot_s == pytest.approx(tpot, rel=0.08)
    assert predicted.attainment == pytest.approx(float(simulated.met_slo()[counted].mean()),
                                                 abs=0.05)
