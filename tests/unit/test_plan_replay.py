"""Plans for bursty arrivals: the arrival model (``capacity.arrival_process``), the planner
sizing for bursts a Poisson model would absorb, the replay that checks a plan
(``sim.plan_check``), ``--rate`` on a trace keeping its bursts, and ``pdserve plan --json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.capacity import planner as pl
from pdserve.capacity.arrival_process import ArrivalProfile
from pdserve.capacity.plan_inputs import InstanceShape, Slo
from pdserve.cli import plan as plan_cmd
from pdserve.common.errors import InvalidArgumentError
from pdserve.sim import plan_check as pc
from pdserve.sim.traces import LengthSpec, Trace, synthetic_trace

SHAPE = InstanceShape("llama-3.1-8b", "h100", 1)
SLO = Slo(ttft_s=0.5, tpot_s=0.03, percentile=90.0)


def _bursty_trace(base_rate_per_s: float, duration_s: float = 600.0, seed: int = 0) -> Trace:
    """Poisson at ``base_rate_per_s``, four times that for the first 20 s of every 120 s: the
    bursts last 40 TTFT bounds, far longer than a queue takes to build."""
    rng = np.random.default_rng(seed)
    step_s = 0.5
    grid = np.arange(0.0, duration_s, step_s)
    rate = np.where(grid % 120.0 < 20.0, 4.0 * base_rate_per_s, base_rate_per_s)
    counts = rng.poisson(rate * step_s)
    times = np.sort(np.repeat(grid, counts) + step_s * rng.random(int(counts.sum())))
    prompts = LengthSpec(1000, 0.5, 16, 4000).sample(rng, times.size)
    outputs = LengthSpec(100, 0.5, 2, 400).sample(rng, times.size)
    return Trace(times - times[0], prompts, outputs, name="bursty")


def test_poisson_arrivals_give_one_calm_level() -> None:
    trace = synthetic_trace(4000, 10.0, seed=2)
    profile = ArrivalProfile(trace.arrival_s)
    assert profile.index_of_dispersion(5.0) == pytest.approx(1.0, abs=0.25)
    series = profile.windows(10.0, 1.0, 10.0)
    assert float(series.share.sum()) == pytest.approx(1.0)
    # The Poisson noise of the counts is taken out: every level sits near the mean rate
    # (raw counts over 1 s windows at 10 req/s spread to 2x and below 0.5x).
    assert all(abs(level.prefill_factor - 1.0) < 0.25 for level in series.levels)
    assert sum(lv.share * lv.prefill_factor for lv in series.levels) == pytest.approx(
        1.0, abs=0.02)


def test_bursts_are_found_and_kept_at_any_rate() -> None:
    trace = _bursty_trace(5.0)
    profile = ArrivalProfile(trace.arrival_s)
    assert profile.index_of_dispersion(5.0) > 5.0
    levels = profile.rate_mixture(trace.mean_rate_per_s, 1.0, 5.0)
    burst_share = sum(lv.share for lv in levels if lv.prefill_factor > 1.5)
    # 20 s of 120 at 4x the base rate: 4 x 20 / (4 x 20 + 100) = 44% of requests.
    assert burst_share == pytest.approx(0.44, abs=0.08)
    # Twice the rate with windows half as long: the same windows of the same arrivals.
    faster = profile.rate_mixture(2 * trace.mean_rate_per_s, 0.5, 2.5)
    assert [lv.prefill_factor for lv in faster] == pytest.approx(
        [lv.prefill_factor for lv in levels])
    with pytest.raises(InvalidArgumentError, match="arrival"):
        ArrivalProfile(np.array([1.0, 0.5]))


def test_rate_on_a_trace_compresses_its_own_gaps() -> None:
    trace = _bursty_trace(5.0, duration_s=300.0)
    for rate in (2.0, 30.0):
        scaled = pc.at_rate(trace, rate)
        assert scaled.mean_rate_per_s == pytest.approx(rate)
        assert scaled.num_requests == trace.num_requests
        gaps, scaled_gaps = np.diff(trace.arrival_s), np.diff(scaled.arrival_s)
        ratio = scaled_gaps[gaps > 0] / gaps[gaps > 0]
        assert ratio == pytest.approx(np.full(ratio.size, trace.mean_rate_per_s / rate))
        assert np.array_equal(scaled.prompt_tokens, trace.prompt_tokens)
    with pytest.raises(InvalidArgumentError, match="rate"):
        pc.at_rate(trace, 0.0)


def test_a_burst_a_poisson_model_absorbs_makes_the_planner_add_instances() -> None:
    trace = _bursty_trace(20.0, duration_s=300.0)
    demand = pc.demand_from_trace(trace)
    poisson = pl.plan(dataclasses.replace(demand, arrivals=None), SLO, [SHAPE], [SHAPE])
    bursty = pl.plan(demand, SLO, [SHAPE], [SHAPE])
    assert poisson.prediction.attainment >= SLO.attainment_target
    assert bursty.config.num_gpus > poisson.config.num_gpus
    assert bursty.prediction.attainment >= SLO.attainment_target
    # Poisson arrivals at the same mean rate: the Poisson plan holds there, not on the trace.
    calm = synthetic_trace(trace.num_requests, trace.mean_rate_per_s, seed=1, sizes=trace)
    assert pc.replay_config(poisson.config, calm, SLO).attainment() >= SLO.attainment_target
    assert pc.replay_config(poisson.config, trace, SLO).attainment() < SLO.attainment_target
    # The plan checked by replay meets the target on the trace itself.
    checked = pc.check_plan(demand, SLO, [SHAPE], [SHAPE], trace)
    assert checked.is_met and checked.replayed_attainment >= SLO.attainment_target
    assert checked.plan.config.num_gpus >= bursty.config.num_gpus
    assert checked.steps[-1].replayed_attainment == checked.replayed_attainment
    assert abs(checked.predicted_attainment - checked.replayed_attainment) < 0.1


def test_replay_misses_are_blamed_on_the_pool_that_caused_them() -> None:
    trace = _bursty_trace(20.0, duration_s=300.0)
    demand = pc.demand_from_trace(trace)
    small = dataclasses.replace(pl.plan(demand, SLO, [SHAPE], [SHAPE]).config, num_prefill=1)
    result = pc.replay_config(small, trace, SLO)
    num_prefill_misses, num_decode_misses = pc.blame(result)
    assert num_prefill_misses > num_decode_misses
    assert num_prefill_misses + num_decode_misses == round(
        result.num_requests * (1.0 - result.attainment()))


def test_a_mixed_tp_plan_is_replayed_with_each_pool_at_its_own_tp() -> None:
    trace = _bursty_trace(20.0, duration_s=120.0)
    demand = pc.demand_from_trace(trace)
    tp2 = dataclasses.replace(SHAPE, tp_size=2)
    # A plan with TP1 prefill and TP2 decode is checked by replay (it was refused when the
    # simulator ran one TP for both pools).
    checked = pc.check_plan(demand, SLO, [SHAPE], [tp2], trace, max_replays=1)
    mixed = checked.plan.config
    assert (mixed.prefill.tp_size, mixed.decode.tp_size) == (1, 2)
    result = pc.replay_config(mixed, trace, SLO)
    assert (result.config.cluster.prefill_tp, result.config.cluster.tp_size) == (1, 2)
    assert result.attainment() == checked.replayed_attainment
    # GPU-hours count each pool's instances at its own TP (all serve the whole run here).
    assert result.gpu_hours == pytest.approx(
        (mixed.num_prefill * 1 + mixed.num_decode * 2) * result.end_s / 3600)
    # Prefill batches are timed at the prefill pool's TP: TP2 prefill computes faster.
    both_tp2 = pc.replay_config(dataclasses.replace(mixed, prefill=tp2), trace, SLO)
    remote = ~result.is_local_prefill & ~both_tp2.is_local_prefill
    assert remote.mean() > 0.5
    assert np.median(both_tp2.compute_s[remote]) < 0.8 * np.median(result.compute_s[remote])


def _azure_csv(path: Path, trace: Trace) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, p, o in zip(trace.arrival_s, trace.prompt_tokens, trace.output_tokens, strict=True):
        hours, rest = divmod(float(t), 3600.0)
        minutes, seconds = divmod(rest, 60.0)
        lines.append(f"2023-11-16 {10 + int(hours):02d}:{int(minutes):02d}:{seconds:010.7f},"
                     f"{p},{o}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_cmd.add_arguments(parser)
    return parser.parse_args(list(words))


def test_plan_json_has_the_plan_and_both_attainments(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _azure_csv(tmp_path / "t.csv", _bursty_trace(5.0, duration_s=300.0))
    code = plan_cmd.run(_args(
        "--model", SHAPE.model, "--gpu", SHAPE.gpu, "--trace", str(path), "--rate", "20",
        "--slo-ttft-ms", "500", "--slo-tpot-ms", "30", "--tp", "1", "--json"))
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert document["rate_per_s"] == pytest.approx(20.0)
    assert document["arrival_model"] == "trace"
    for pool in ("prefill", "decode"):
        assert document[pool]["tp"] == 1 and document[pool]["instances"] >= 1
        assert document[pool]["gpus"] == document[pool]["instances"]
    assert document["num_gpus"] == document["prefill"]["gpus"] + document["decode"]["gpus"]
    assert 0.0 <= document["predicted_attainment"] <= 1.0
    assert document["replayed_attainment"] >= 0.9 and document["is_met"] is True
    last = document["replays"][-1]
    assert (last["num_prefill"], last["num_decode"]) == (
        document["prefill"]["instances"], document["decode"]["instances"])
    assert last["replayed_attainment"] == document["replayed_attainment"]


def test_plan_prints_prediction_beside_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _azure_csv(tmp_path / "t.csv", _bursty_trace(5.0, duration_s=300.0))
    out = tmp_path / "out"
    assert plan_cmd.run(_args(
        "--model", SHAPE.model, "--gpu", SHAPE.gpu, "--trace", str(path), "--rate", "20",
        "--slo-ttft-ms", "500", "--slo-tpot-ms", "30", "--tp", "1", "--out", str(out))) == 0
    text = capsys.readouterr().out
    assert "predicted" in text and "replayed" in text and "offered plan" in text
    pytest.importorskip("matplotlib")
    assert (out / "plan_replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_governor_plans_and_replays_its_observed_window() -> None:
    from pdserve.common.types import FencingToken, Ticket, TicketState
    from pdserve.governor.live_plan import observed_trace, plan_observed_window, plan_record

    source = _bursty_trace(10.0, duration_s=240.0)
    start_s = 1000.0

    def ticket(i: int, attempt: int, delay_s: float) -> Ticket:
        at_s = start_s + 1.0 + float(source.arrival_s[i]) + delay_s
        return Ticket(FencingToken(f"t{i}-{attempt}", 1), "d", "d0", "p0", 10,
                      TicketState.DONE, False, at_s + 5.0, at_s, at_s, request_id=f"r{i}",
                      num_prompt_tokens=int(source.prompt_tokens[i]))

    tickets = [ticket(i, 1, 0.0) for i in range(source.num_requests)]
    tickets += [ticket(i, 2, 0.3) for i in range(0, source.num_requests, 10)]  # retries
    tickets.append(dataclasses.replace(tickets[0], deployment="other"))
    end_s = start_s + 1.0 + float(source.arrival_s[-1])
    trace = observed_trace(tickets, "d", start_s, end_s, 99.5)
    assert trace is not None and trace.num_requests == source.num_requests
    assert np.allclose(trace.arrival_s, source.arrival_s)
    assert np.array_equal(trace.prompt_tokens, source.prompt_tokens)
    assert set(trace.output_tokens.tolist()) == {100}
    assert observed_trace(tickets[:10], "d", start_s, end_s, 100.0) is None
    window = plan_observed_window(tickets, "d", start_s, end_s, mean_output_tokens=100.0,
                                  slo=SLO, shapes=[SHAPE])
    assert window is not None and window.checked.is_met
    checked = window.checked
    assert checked.steps[-1].replayed_attainment >= SLO.attainment_target

    # Instances running 10x their wall clock (sim workers) see the same demand in their own
    # time when it comes 10x faster against 10x tighter bounds: the same plan.
    fast = [dataclasses.replace(t, created_s=start_s + (t.created_s - start_s) / 10.0)
            for t in tickets]
    fast_slo = Slo(SLO.ttft_s / 10.0, SLO.tpot_s / 10.0, SLO.percentile)
    fast_window = plan_observed_window(fast, "d", start_s, start_s + (end_s - start_s) / 10.0,
                                       mean_output_tokens=100.0, slo=fast_slo, shapes=[SHAPE],
                                       speedup=10.0)
    assert fast_window is not None
    assert np.allclose(fast_window.trace.arrival_s, source.arrival_s)
    assert (fast_window.slo.ttft_s, fast_window.slo.tpot_s) == pytest.approx(
        (SLO.ttft_s, SLO.tpot_s))
    fast_config, config = fast_window.checked.plan.config, checked.plan.config
    assert (fast_config.num_prefill, fast_config.num_decode) == (config.num_prefill,
                                                                 config.num_decode)

    # What the governor keeps of it: counts, both attainments, the window and the SLO in wall
    # time, valid JSON (the durable store refuses NaN and infinities).
    record = plan_record("d", fast_window, start_s, end_s, at_s=end_s)
    assert (record.num_prefill_instances, record.num_decode_instances) == (
        checked.plan.config.num_prefill, checked.plan.config.num_decode)
    assert record.outputs["replayed_attainment"] == fast_window.checked.replayed_attainment
    assert record.outputs["source"] == "observed_window"
    assert record.inputs["num_requests"] == source.num_requests
    assert record.inputs["slo_ttft_ms"] == pytest.approx(SLO.ttft_s / 10.0 * 1000.0)
    assert record.inputs["arrival_rate_per_s"] == pytest.approx(source.mean_rate_per_s * 10.0)
    assert record.outputs["rate_per_s"] == pytest.approx(record.inputs["arrival_rate_per_s"])
    assert record.outputs["slo"]["ttft_ms"] == pytest.approx(SLO.ttft_s / 10.0 * 1000.0)
    json.dumps(record.outputs, allow_nan=False)
