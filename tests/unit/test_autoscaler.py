"""The cold-start-aware autoscaler as a pure policy, driven through a small fluid model of two
pools (instances launched at t serve from t + cold start; removed ones leave at once).

The fluid model lives here on purpose: it checks the policy's arithmetic against demand it
knows exactly, without the discrete-event simulator's queueing noise.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from pdserve.capacity.autoscaler import Autoscaler
from pdserve.capacity.controls import AutoscalerConfig, AutoscalerControls, PoolBounds
from pdserve.capacity.forecast import DemandForecaster, HoltForecaster
from pdserve.capacity.scaling import PoolObservation, ScalingDecision, ScalingObservation
from pdserve.capacity.sizing import (
    DecodeLimit,
    InstanceProfile,
    LengthMoments,
    SizingConfig,
    SizingDemand,
    decode_batch_limit,
    decode_kv_blocks_held,
    decode_rate_per_instance,
    instances_for,
    size_pools,
)
from pdserve.common.errors import InvalidArgumentError

PROFILE = InstanceProfile.from_catalog("llama-3.1-70b", "h100-sxm-80gb", prefill_tp_size=4,
                                       decode_tp_size=4)
SIZING = SizingConfig()
INTERVAL_S = 60.0
COLD_START_S = 600.0
PROMPT, OUTPUT = 1155.0, 211.0


def need(rate: float, prompt: float = PROMPT, output: float = OUTPUT) -> tuple[int, int]:
    sizing = size_pools(PROFILE, SIZING, SizingDemand(rate, prompt, output))
    return instances_for(sizing.num_prefill), instances_for(sizing.num_decode)


@dataclass
class FluidPool:
    """Instances of one pool: ready ones and (ready time) of starting ones."""

    num_ready: int = 0
    starting: list[float] = field(default_factory=list)

    def advance(self, now_s: float) -> None:
        self.num_ready += sum(1 for t in self.starting if t <= now_s)
        self.starting = [t for t in self.starting if t > now_s]

    def apply(self, target: int, now_s: float, cold_start_s: float) -> None:
        live = self.num_ready + len(self.starting)
        if target > live:
            self.starting += [now_s + cold_start_s] * (target - live)
        for _ in range(live - target):  # drain: not-yet-ready instances first
            if self.starting:
                self.starting.pop()
            else:
                self.num_ready -= 1

    def observe(self) -> PoolObservation:
        return PoolObservation(num_ready=self.num_ready, num_starting=len(self.starting),
                               num_draining=0, utilization=0.5)


@dataclass
class Run:
    times_s: list[float]
    rates: list[float]
    decisions: list[ScalingDecision]
    ready: list[tuple[int, int]]  # (prefill, decode) ready at each decision, before it acts


def drive(policy: Autoscaler, rate_at: Callable[[float], float], num_intervals: int, *,
          prompt_at: Callable[[float], float] = lambda t: PROMPT,
          output_at: Callable[[float], float] = lambda t: OUTPUT,
          start: tuple[int, int] = (1, 1), actuate: bool = True) -> Run:
    """Call the policy once per interval with the last interval's rate; the fluid pools follow
    its targets unless ``actuate`` is False (dry run)."""
    prefill, decode = FluidPool(num_ready=start[0]), FluidPool(num_ready=start[1])
    run = Run([], [], [], [])
    history: list[float] = []
    for i in range(1, num_intervals + 1):
        now_s = i * INTERVAL_S
        prefill.advance(now_s)
        decode.advance(now_s)
        rate = rate_at(now_s)
        history.append(rate)
        decision = policy.decide(ScalingObservation(
            now_s=now_s, deployment="d", interval_s=INTERVAL_S,
            arrival_rates_per_s=tuple(history[-30:]), mean_prompt_tokens=prompt_at(now_s),
            mean_output_tokens=output_at(now_s), prefill=prefill.observe(),
            decode=decode.observe(), cold_start_s=COLD_START_S,
        ))
        run.times_s.append(now_s)
        run.rates.append(rate)
        run.decisions.append(decision)
        run.ready.append((prefill.num_ready, decode.num_ready))
        if actuate:
            prefill.apply(decision.num_prefill, now_s, COLD_START_S)
            decode.apply(decision.num_decode, now_s, COLD_START_S)
    return run


def noisy(base: Callable[[float], float], sd_fraction: float,
          seed: int) -> Callable[[float], float]:
    rng = random.Random(seed)
    cache: dict[float, float] = {}

    def rate(t: float) -> float:
        if t not in cache:
            cache[t] = max(0.0, base(t) * (1.0 + rng.gauss(0.0, sd_fraction)))
        return cache[t]
    return rate


def ramp(t: float) -> float:
    """Flat at 10 req/s for an hour, then +0.5 req/s per minute for an hour, then flat."""
    minutes = t / 60.0
    return 10.0 + 0.5 * min(60.0, max(0.0, minutes - 60.0))


# -- forecasting and look-ahead ----------------------------------------------------------


def test_holt_follows_a_linear_trend() -> None:
    forecaster = HoltForecaster(alpha=0.5, beta=0.3, damping=1.0)
    for i in range(100):
        forecaster.update(5.0 + 2.0 * i)
    assert forecaster.forecast(10) == pytest.approx(5.0 + 2.0 * 109, rel=1e-3)
    assert forecaster.path_max(10) == forecaster.forecast(10)


def test_scales_up_ahead_of_a_ramp_by_the_lead_time() -> None:
    run = drive(Autoscaler(PROFILE), ramp, 180)
    lead_intervals = math.ceil((COLD_START_S + INTERVAL_S) / INTERVAL_S)
    checked = 0
    for i, (t, decision) in enumerate(zip(run.times_s, run.decisions, strict=True)):
        if t < 63 * 60 or i + lead_intervals >= len(run.times_s):
            continue  # the ramp starts at 60 min; three intervals of it show the trend
        ahead = need(ramp(t + COLD_START_S))
        assert decision.num_prefill >= ahead[0], (t, decision.inputs)
        assert decision.num_decode >= ahead[1], (t, decision.inputs)
        checked += 1
    assert checked > 100
    # What was decided a lead time earlier is what serves: ready instances cover the demand
    # throughout the ramp, although every instance takes 10 minutes to start.
    for t, rate, ready in zip(run.times_s, run.rates, run.ready, strict=True):
        if t >= 63 * 60 + COLD_START_S:
            assert ready[0] >= need(rate)[0] and ready[1] >= need(rate)[1], (t, rate, ready)


def test_a_policy_blind_to_the_lead_falls_behind_on_the_same_ramp() -> None:
    """The control for the test above: look ahead one interval only (as if starts were
    instant) and the ready instances trail the ramp."""
    policy = Autoscaler(PROFILE)
    prefill, decode = FluidPool(num_ready=1), FluidPool(num_ready=1)
    num_short = 0
    history: list[float] = []
    for i in range(1, 181):
        now_s = i * INTERVAL_S
        prefill.advance(now_s)
        decode.advance(now_s)
        history.append(ramp(now_s))
        if now_s >= 75 * 60 and prefill.num_ready < need(ramp(now_s))[0]:
            num_short += 1
        decision = policy.decide(ScalingObservation(
            now_s=now_s, deployment="d", interval_s=INTERVAL_S,
            arrival_rates_per_s=tuple(history[-30:]), mean_prompt_tokens=PROMPT,
            mean_output_tokens=OUTPUT, prefill=prefill.observe(), decode=decode.observe(),
            cold_start_s=0.0))
        prefill.apply(decision.num_prefill, now_s, COLD_START_S)
        decode.apply(decision.num_decode, now_s, COLD_START_S)
    assert num_short > 10


def test_headroom_grows_with_forecast_error() -> None:
    config = AutoscalerConfig(min_headroom_fraction=0.0)
    headrooms = []
    for noise in (0.0, 0.1, 0.2, 0.4):
        run = drive(Autoscaler(PROFILE, config), noisy(lambda t: 20.0, noise, seed=1), 120)
        inputs = run.decisions[-1].inputs
        assert inputs["headroom_source"] == "lead"
        headrooms.append(inputs["headroom_per_s"])
    assert headrooms[0] < 0.05 * 20.0  # a perfect forecast needs next to none
    assert all(a < b for a, b in itertools.pairwise(headrooms)), headrooms
    # With the default floor, calm demand gets the floor and rough demand more, and more
    # instances follow from it.
    calm = drive(Autoscaler(PROFILE), lambda t: 20.0, 120).decisions[-1]
    rough = drive(Autoscaler(PROFILE), noisy(lambda t: 20.0, 0.4, seed=1), 120).decisions[-1]
    floor = AutoscalerConfig().min_headroom_fraction * calm.inputs["forecast_rate_per_s"]
    assert calm.inputs["headroom_per_s"] == pytest.approx(floor)
    assert rough.inputs["headroom_per_s"] > 1.5 * floor
    assert rough.num_prefill > calm.num_prefill


def test_a_burst_raises_the_headroom_that_follows() -> None:
    config = AutoscalerConfig(min_headroom_fraction=0.0)
    run = drive(Autoscaler(PROFILE, config),
                lambda t: 20.0 if not 60 * 60 <= t < 90 * 60 else 20.0 + 0.6 * (t / 60 - 60), 110)
    before = run.decisions[59].inputs["headroom_per_s"]
    after = run.decisions[-1].inputs["headroom_per_s"]
    assert after > 5 * max(before, 0.01)


def test_decisions_carry_their_inputs_and_forecast() -> None:
    run = drive(Autoscaler(PROFILE), ramp, 80)
    inputs = run.decisions[-1].inputs
    json.dumps(inputs, allow_nan=False)
    for key in ("forecast_rate_per_s", "forecast_lead_s", "headroom_per_s", "prefill_need",
                "decode_need", "prefill_target", "decode_target", "prefill_rate_per_instance",
                "decode_rate_per_instance", "mean_prompt_tokens", "is_dry_run"):
        assert key in inputs, key
    assert inputs["forecast_lead_s"] == COLD_START_S + INTERVAL_S
    assert inputs["prefill_target"] == run.decisions[-1].num_prefill
    assert inputs["forecast_rate_per_s"] > inputs["observed_rate_per_s"]  # ramping: ahead


# -- hysteresis ----------------------------------------------------------------------------


def _changes(values: list[int]) -> list[tuple[int, int]]:
    """(index, delta) of every change."""
    return [(i, b - a) for i, (a, b) in enumerate(itertools.pairwise(values), start=1) if b != a]


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_hysteresis_prevents_flapping_on_noise(seed: int) -> None:
    config = AutoscalerConfig()
    run = drive(Autoscaler(PROFILE, config), noisy(lambda t: 18.0, 0.08, seed), 240)
    delay = int(config.scale_down_delay_s / INTERVAL_S)
    for pool in (0, 1):
        targets = [(d.num_prefill, d.num_decode)[pool] for d in run.decisions][30:]
        changes = _changes(targets)
        assert len(changes) <= 4, changes
        for (i, a), (j, b) in itertools.pairwise(changes):
            if a > 0 > b:  # up, then down: only after the scale-down delay
                assert j - i >= delay, changes


def test_scale_down_waits_then_steps() -> None:
    config = AutoscalerConfig(scale_down_delay_s=600.0, max_scale_down_fraction=0.1)
    run = drive(Autoscaler(PROFILE, config), lambda t: 60.0 if t < 120 * 60 else 6.0, 200,
                start=(12, 12))
    drop = next(i for i, t in enumerate(run.times_s) if t >= 120 * 60)
    prefill = [d.num_prefill for d in run.decisions]
    assert prefill[drop - 1] > need(6.0)[0] + 3
    first_down = next(i for i in range(drop, len(prefill)) if prefill[i] < prefill[drop - 1])
    assert (first_down - drop) * INTERVAL_S >= config.scale_down_delay_s
    for a, b in zip(prefill[drop:], prefill[drop + 1:], strict=False):
        assert a - b <= max(1, math.floor(0.1 * a))
    assert prefill[-1] < prefill[drop - 1] / 2  # it does get there


# -- operator controls ------------------------------------------------------------------------


def test_gpu_budget_caps_both_pools() -> None:
    controls = AutoscalerControls(max_gpus=40)
    run = drive(Autoscaler(PROFILE, controls=controls), lambda t: 80.0, 30)
    unlimited = drive(Autoscaler(PROFILE), lambda t: 80.0, 30)
    for decision in run.decisions:
        assert decision.num_prefill * 4 + decision.num_decode * 4 <= 40
        assert decision.num_prefill >= 1 and decision.num_decode >= 1
    last = unlimited.decisions[-1]
    assert (last.num_prefill + last.num_decode) * 4 > 40  # the cap did bind
    assert run.decisions[-1].num_prefill + run.decisions[-1].num_decode == 10


def test_min_and_max_bounds() -> None:
    controls = AutoscalerControls(prefill_bounds=PoolBounds(3, 5),
                                  decode_bounds=PoolBounds(2, 1000))
    low = drive(Autoscaler(PROFILE, controls=controls), lambda t: 0.2, 30)
    high = drive(Autoscaler(PROFILE, controls=controls), lambda t: 60.0, 30)
    assert all(d.num_prefill == 3 for d in low.decisions[1:])
    assert all(d.num_decode >= 2 for d in low.decisions)
    assert all(3 <= d.num_prefill <= 5 for d in high.decisions)
    assert high.decisions[-1].num_prefill == 5 and high.decisions[-1].num_decode > 5


def test_freeze_holds_targets() -> None:
    policy = Autoscaler(PROFILE)
    drive(policy, lambda t: 10.0, 20, start=need(10.0))
    before = policy.decide(_observation(21, 10.0, (3, 3)))
    policy.set_controls(AutoscalerControls(is_frozen=True))
    frozen = [policy.decide(_observation(22 + i, 50.0, (3, 3))) for i in range(5)]
    assert all((d.num_prefill, d.num_decode) == (before.num_prefill, before.num_decode)
               for d in frozen)
    assert all(d.inputs["decode_desired"] > before.num_decode for d in frozen)  # it would have
    policy.set_controls(AutoscalerControls())
    thawed = policy.decide(_observation(27, 50.0, (3, 3)))
    assert thawed.num_prefill > before.num_prefill


def _observation(i: int, rate: float, ready: tuple[int, int],
                 starting: tuple[int, int] = (0, 0)) -> ScalingObservation:
    return ScalingObservation(
        now_s=i * INTERVAL_S, deployment="d", interval_s=INTERVAL_S,
        arrival_rates_per_s=(rate,), mean_prompt_tokens=PROMPT, mean_output_tokens=OUTPUT,
        prefill=PoolObservation(ready[0], starting[0], 0, 0.5),
        decode=PoolObservation(ready[1], starting[1], 0, 0.5), cold_start_s=COLD_START_S)


def test_dry_run_recommends_from_what_runs() -> None:
    """Dry-run decisions are computed as usual but nothing actuates them, so each one starts
    from the pool as observed (here it never grows) and says it is a dry run."""
    dry = Autoscaler(PROFILE, controls=AutoscalerControls(is_dry_run=True, max_step_per_minute=2))
    live = Autoscaler(PROFILE, controls=AutoscalerControls(max_step_per_minute=2))
    dry_run = drive(dry, lambda t: 40.0, 10, actuate=False)
    live_run = drive(live, lambda t: 40.0, 10, start=(1, 1))
    assert all(d.inputs["is_dry_run"] == 1 for d in dry_run.decisions)
    assert all(d.inputs["is_dry_run"] == 0 for d in live_run.decisions)
    # Not actuated: every recommendation is "the 1 running + 2 allowed this minute".
    assert [d.num_prefill for d in dry_run.decisions] == [3] * 10
    # Actuated: the limit accumulates towards the need.
    assert live_run.decisions[-1].num_prefill > 3


def test_override_pins_targets_until_it_expires() -> None:
    policy = Autoscaler(PROFILE)
    drive(policy, lambda t: 10.0, 20, start=need(10.0))
    policy.set_controls(AutoscalerControls(override_prefill_instances=9,
                                           override_until_s=25 * INTERVAL_S))
    pinned = [policy.decide(_observation(21 + i, 10.0, need(10.0))) for i in range(4)]
    assert all(d.num_prefill == 9 for d in pinned)
    assert all(d.num_decode == need(10.0)[1] or d.num_decode <= need(15.0)[1] for d in pinned)
    assert "override" in pinned[0].reason
    after = [policy.decide(_observation(25 + i, 10.0, (9, need(10.0)[1]))) for i in range(20)]
    assert "override" not in after[0].reason
    assert after[-1].num_prefill < 9  # back under the autoscaler (through its scale-down delay)


def test_rate_limit_bounds_changes_per_minute() -> None:
    controls = AutoscalerControls(max_step_per_minute=3)
    policy = Autoscaler(PROFILE, controls=controls)
    run = drive(policy, lambda t: 5.0 if t < 30 * 60 else 60.0, 60, start=need(5.0))
    for pool in (0, 1):
        targets = [(d.num_prefill, d.num_decode)[pool] for d in run.decisions]
        for a, b in itertools.pairwise(targets):
            assert abs(b - a) <= 3
    assert run.decisions[-1].num_prefill >= need(60.0)[0]  # limited, not stuck


@pytest.mark.parametrize("controls, field_name", [
    (AutoscalerControls(prefill_bounds=PoolBounds(-1, 4)), "prefill_bounds.min_instances"),
    (AutoscalerControls(decode_bounds=PoolBounds(5, 4)), "decode_bounds.max_instances"),
    (AutoscalerControls(override_prefill_instances=50, prefill_bounds=PoolBounds(1, 10)),
     "override_prefill_instances"),
    (AutoscalerControls(max_step_per_minute=-1), "max_step_per_minute"),
    (AutoscalerControls(max_gpus=-2), "max_gpus"),
    (AutoscalerControls(max_gpus=6, prefill_bounds=PoolBounds(1, 9),
                        decode_bounds=PoolBounds(1, 9)), "max_gpus"),  # 2 x TP4 = 8 GPUs
    (AutoscalerControls(override_until_s=math.inf), "override_until_s"),
])
def test_bad_controls_name_the_field(controls: AutoscalerControls, field_name: str) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        Autoscaler(PROFILE, controls=controls)
    assert error.value.field == field_name
    policy = Autoscaler(PROFILE)
    with pytest.raises(InvalidArgumentError):
        policy.set_controls(controls)
    assert policy.controls == AutoscalerControls()


def test_controls_round_trip_through_plain_values() -> None:
    controls = AutoscalerControls(is_dry_run=True, prefill_bounds=PoolBounds(2, 7),
                                  override_decode_instances=4, override_until_s=123.5,
                                  max_step_per_minute=2, max_gpus=64)
    values = json.loads(json.dumps(controls.as_dict()))
    assert AutoscalerControls.from_dict(values) == controls


# -- the two pools are sized from different things -------------------------------------------


def test_output_length_moves_decode_only() -> None:
    base = drive(Autoscaler(PROFILE), lambda t: 20.0, 40)
    longer = drive(Autoscaler(PROFILE), lambda t: 20.0, 40, output_at=lambda t: 3 * OUTPUT)
    a, b = base.decisions[-1], longer.decisions[-1]
    assert b.num_prefill == a.num_prefill
    assert b.num_decode >= 2 * a.num_decode


def test_prompt_length_moves_prefill_far_more_than_decode() -> None:
    base = drive(Autoscaler(PROFILE), lambda t: 20.0, 40)
    longer = drive(Autoscaler(PROFILE), lambda t: 20.0, 40, prompt_at=lambda t: 3 * PROMPT)
    a, b = base.decisions[-1], longer.decisions[-1]
    assert b.num_prefill >= 2.5 * a.num_prefill
    # Decode sees longer prompts only as a longer context to read per step.
    assert b.num_decode / a.num_decode < 0.6 * b.num_prefill / a.num_prefill


def test_a_long_tail_of_prompts_at_the_same_mean_adds_prefill_only() -> None:
    def decide(mean_squared: float) -> ScalingDecision:
        return Autoscaler(PROFILE).decide(ScalingObservation(
            now_s=INTERVAL_S, deployment="d", interval_s=INTERVAL_S,
            arrival_rates_per_s=(40.0,), mean_prompt_tokens=4 * PROMPT,
            mean_output_tokens=OUTPUT, mean_squared_prompt_tokens=mean_squared,
            prefill=FluidPool(num_ready=8).observe(), decode=FluidPool(num_ready=8).observe(),
            cold_start_s=COLD_START_S))

    unknown, uniform, tail = decide(0.0), decide((4 * PROMPT) ** 2), decide(6 * (4 * PROMPT) ** 2)
    assert (uniform.num_prefill, uniform.num_decode) == (unknown.num_prefill, unknown.num_decode)
    assert tail.num_prefill > uniform.num_prefill
    assert tail.num_decode == uniform.num_decode
    assert tail.inputs["mean_squared_prompt_tokens"] == 6 * (4 * PROMPT) ** 2
    # The per-instance rate is the mean prefill time's, from the two moments.
    seconds = PROFILE.prefill_perf.mean_prefill_time_s(4 * PROMPT, 6 * (4 * PROMPT) ** 2)
    assert tail.inputs["prefill_rate_per_instance"] == pytest.approx(
        SIZING.prefill_target_utilization / seconds)


def test_output_length_change_midway_scales_decode_alone() -> None:
    run = drive(Autoscaler(PROFILE), lambda t: 20.0, 120,
                output_at=lambda t: OUTPUT if t < 60 * 60 else 2.5 * OUTPUT)
    before, after = run.decisions[58], run.decisions[-1]
    assert after.num_prefill == before.num_prefill
    assert after.num_decode > 1.8 * before.num_decode


def test_size_pools_is_monotone_in_rate() -> None:
    needs = [size_pools(PROFILE, SIZING, SizingDemand(r, PROMPT, OUTPUT))
             for r in (1, 5, 25, 125)]
    assert all(a.num_prefill < b.num_prefill and a.num_decode < b.num_decode
               for a, b in itertools.pairwise(needs))
    backlog = size_pools(PROFILE, SIZING, replace(SizingDemand(25, PROMPT, OUTPUT),
                                                  num_queued_prefill_tokens=200_000))
    assert backlog.num_prefill > needs[2].num_prefill
    assert backlog.num_decode == needs[2].num_decode


def _grid_moments(prompts: list[int], outputs: list[int]) -> tuple[list[tuple[int, int]],
                                                                    LengthMoments]:
    """Every (prompt, output) pair of the two lists (so the lengths are exactly independent)
    and their moments."""
    pairs = list(itertools.product(prompts, outputs))
    return pairs, LengthMoments.measured([p for p, _ in pairs], [o for _, o in pairs])


def test_decode_kv_held_is_the_rate_times_each_requests_block_seconds() -> None:
    # Long prompts (compute-bound prefill, where the moments are exact), spread outputs.
    rng = random.Random(5)
    prompts = [int(min(80_000, max(2_000, rng.lognormvariate(math.log(9_000), 0.9))))
               for _ in range(40)]
    outputs = [int(min(2_000, max(8, rng.lognormvariate(math.log(250), 0.8)))) for _ in range(30)]
    pairs, moments = _grid_moments(prompts, outputs)
    batch, block = 24, PROFILE.block_size_tokens
    step_s = PROFILE.decode_perf.decode_step_time_s(
        batch, math.ceil(batch * moments.running_context_tokens))
    rate = batch / (moments.output * step_s)
    # Each request holds (prompt + output) tokens' blocks, the last one half used on average,
    # from routing (its prompt prefilled alone) to its last token (output steps).
    block_seconds = sum(((p + o) / block + 0.5)
                        * (PROFILE.prefill_perf.prefill_time_s([p]) + o * step_s)
                        for p, o in pairs) / len(pairs)
    held = decode_kv_blocks_held(PROFILE, SIZING, batch, moments)
    assert held == pytest.approx(rate * block_seconds, rel=1e-9)
    # Counting only the running batch at the mean reservation misses a good part of it.
    means_only = batch * math.ceil((moments.prompt + moments.output) / block)
    assert held > 1.15 * means_only
    assert decode_kv_blocks_held(PROFILE, SIZING, 0, moments) == 0.0


def test_kv_bound_decode_sizing_counts_long_prompts_held_through_prefill() -> None:
    prompts = [3_000, 6_000, 12_000, 24_000, 60_000]
    _, spread = _grid_moments(prompts, [100, 200, 400, 800])
    same_means = LengthMoments.of(spread.prompt, spread.output)
    batch, limit = decode_batch_limit(PROFILE, SIZING, spread.prompt, spread.output, spread)
    assert limit is DecodeLimit.KV
    # The batch is the largest whose blocks held fit: one more does not.
    assert decode_kv_blocks_held(PROFILE, SIZING, batch, spread) <= PROFILE.decode_num_blocks
    assert decode_kv_blocks_held(PROFILE, SIZING, batch + 1, spread) > PROFILE.decode_num_blocks
    spread_rate, _, _ = decode_rate_per_instance(PROFILE, SIZING, spread.prompt, spread.output,
                                                 spread)
    mean_rate, _, _ = decode_rate_per_instance(PROFILE, SIZING, spread.prompt, spread.output,
                                               same_means)
    assert spread_rate < 0.9 * mean_rate
    # size_pools reads the moments off the demand; with none it takes the means alone.
    demand = SizingDemand(10.0, spread.prompt, spread.output,
                          mean_squared_prompt_tokens=spread.prompt_squared,
                          mean_cubed_prompt_tokens=spread.prompt_cubed,
                          mean_squared_output_tokens=spread.output_squared,
                          mean_prompt_output_tokens=spread.prompt_output)
    assert size_pools(PROFILE, SIZING, demand).decode_rate_per_instance == spread_rate
    assert size_pools(PROFILE, SIZING, SizingDemand(10.0, spread.prompt, spread.output)
                      ).decode_rate_per_instance == mean_rate


def test_the_autoscaler_sizes_decode_from_the_observed_moments() -> None:
    _, spread = _grid_moments([3_000, 6_000, 12_000, 24_000, 60_000], [100, 200, 400, 800])

    def decide(**moments: float) -> ScalingDecision:
        return Autoscaler(PROFILE).decide(ScalingObservation(
            now_s=INTERVAL_S, deployment="d", interval_s=INTERVAL_S,
            arrival_rates_per_s=(20.0,), mean_prompt_tokens=spread.prompt,
            mean_output_tokens=spread.output, prefill=FluidPool(num_ready=40).observe(),
            decode=FluidPool(num_ready=10).observe(), cold_start_s=COLD_START_S, **moments))

    means = decide()
    seen = decide(mean_squared_prompt_tokens=spread.prompt_squared,
                  mean_cubed_prompt_tokens=spread.prompt_cubed,
                  mean_squared_output_tokens=spread.output_squared,
                  mean_prompt_output_tokens=spread.prompt_output)
    assert seen.num_decode > means.num_decode
    assert seen.inputs["mean_cubed_prompt_tokens"] == spread.prompt_cubed
    assert seen.inputs["mean_squared_output_tokens"] == spread.output_squared
    assert seen.inputs["mean_prompt_output_tokens"] == spread.prompt_output


def test_length_moments_are_measured_per_request_and_refuse_mismatched_lengths() -> None:
    moments = LengthMoments.measured([1, 3], [10, 20])
    assert (moments.prompt, moments.output) == (2.0, 15.0)
    assert (moments.prompt_squared, moments.prompt_cubed) == (5.0, 14.0)
    assert (moments.output_squared, moments.prompt_output) == (250.0, 35.0)
    assert moments.demand(3.0).mean_cubed_prompt_tokens == 14.0
    with pytest.raises(InvalidArgumentError) as error:
        LengthMoments.measured([1, 2], [3])
    assert error.value.field == "output_tokens"
    with pytest.raises(InvalidArgumentError):
        LengthMoments.measured([], [])


def test_length_moments_are_those_of_the_latest_requests_whatever_the_rate() -> None:
    def observation(i: int, rate: float, prompt: float, cubed: float = 0.0) -> ScalingObservation:
        return ScalingObservation(
            now_s=i * INTERVAL_S, deployment="d", interval_s=INTERVAL_S,
            arrival_rates_per_s=(rate,), mean_prompt_tokens=prompt, mean_output_tokens=OUTPUT,
            mean_squared_prompt_tokens=prompt * prompt, mean_cubed_prompt_tokens=cubed,
            prefill=FluidPool(num_ready=1).observe(), decode=FluidPool(num_ready=1).observe(),
            cold_start_s=COLD_START_S)

    smoothed = DemandForecaster(AutoscalerConfig())
    latest = DemandForecaster(AutoscalerConfig(length_memory_requests=0.0))
    # The first observation is taken as it is.
    for forecaster in (smoothed, latest):
        forecaster.observe(observation(1, 1.0, 1_000.0, 1e9))
        assert forecaster.mean_prompt_tokens == 1_000.0
        assert forecaster.mean_cubed_prompt_tokens == 1e9
    # 60 requests an interval whose mean prompt swings 1,000 / 3,000 (sampling noise): the
    # moments of the last ~2,000 requests hardly move; the latest interval's follow each swing.
    swings = []
    for i in range(2, 122):
        prompt = 3_000.0 if i % 2 else 1_000.0
        smoothed.observe(observation(i, 1.0, prompt, 1e9))
        latest.observe(observation(i, 1.0, prompt, 1e9))
        assert latest.mean_prompt_tokens == prompt
        swings.append(smoothed.mean_prompt_tokens)
    assert max(abs(b - a) for a, b in itertools.pairwise(swings)) < 100.0  # of a 2,000 swing
    assert 1_800.0 < swings[-1] < 2_200.0
    # A repeated observation (the same interval) teaches nothing.
    before = smoothed.mean_prompt_tokens
    smoothed.observe(observation(121, 1.0, 9_000.0, 1e9))
    assert smoothed.mean_prompt_tokens == before
    # At 100 requests/s (6,000 an interval) a change of lengths is followed within 3 intervals.
    for i in range(122, 125):
        smoothed.observe(observation(i, 100.0, 8_000.0, 1e9))
    assert smoothed.mean_prompt_tokens == pytest.approx(8_000.0, rel=0.03)
    # A moment the observation does not know is unknown from then on (not a stale blend).
    smoothed.observe(observation(125, 100.0, 8_000.0, 0.0))
    assert smoothed.mean_cubed_prompt_tokens == 0.0
    with pytest.raises(InvalidArgumentError) as error:
        AutoscalerConfig(length_memory_requests=-1.0)
    assert error.value.field == "length_memory_requests"
