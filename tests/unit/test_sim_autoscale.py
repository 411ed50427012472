"""``pdserve simulate --autoscale``: the governor's autoscaler inside the simulation, with cold
starts, sizes the pools ahead of a ramp and reports GPU-hours."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.capacity.sizing import SizingConfig
from pdserve.cli import simulate as simulate_cmd
from pdserve.sim import ClusterSpec
from pdserve.sim.autoscale import pool_capacity_per_s

MODEL, GPU, TP = "llama-3.1-70b", "h100-sxm-80gb", 4
COLD_START_S = 300.0
FLAT_S, RAMP_S, HOLD_S = 900.0, 1800.0, 300.0
LOW, HIGH = 3.0, 15.0  # req/s
PROMPT, OUTPUT = 900, 120


def rate_at(t: np.ndarray) -> np.ndarray:
    """Flat at ``LOW``, then a linear ramp to ``HIGH`` over ``RAMP_S``, then flat."""
    return LOW + (HIGH - LOW) * np.clip((t - FLAT_S) / RAMP_S, 0.0, 1.0)


def time_rate_reaches(rate: float) -> float:
    return FLAT_S + (rate - LOW) / (HIGH - LOW) * RAMP_S


def ramp_csv(path: Path) -> Path:
    """An Azure-format trace of the ramp: Poisson arrivals thinned to ``rate_at``."""
    rng = np.random.default_rng(11)
    end_s = FLAT_S + RAMP_S + HOLD_S
    times = np.cumsum(rng.exponential(1.0 / HIGH, int(HIGH * end_s * 1.2)))
    times = times[times < end_s]
    times = times[rng.random(len(times)) < rate_at(times) / HIGH]
    prompts = np.clip(rng.lognormal(np.log(PROMPT), 0.5, len(times)), 16, 8000).astype(int)
    outputs = np.clip(rng.lognormal(np.log(OUTPUT), 0.5, len(times)), 2, 800).astype(int)
    start = datetime.datetime(2023, 11, 16, 10, 0, 0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, p, o in zip(times, prompts, outputs, strict=True):
        stamp = start + datetime.timedelta(seconds=float(t))
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S.%f}0,{p},{o}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate_cmd.add_arguments(parser)
    return parser.parse_args(list(words))


def test_simulate_autoscale_scales_up_ahead_of_a_ramp_by_at_least_the_cold_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = ramp_csv(tmp_path / "ramp.csv")
    out = tmp_path / "out"
    assert simulate_cmd.run(_args(
        "--trace", str(trace), "--model", MODEL, "--gpu", GPU, "--tp", str(TP),
        "--num-prefill", "1", "--num-decode", "1", "--slo-tpot-ms", "100", "--autoscale",
        "--cold-start-s", str(COLD_START_S), "--no-plot", "--out", str(out))) == 0
    assert "scale-ups" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    report = summary["autoscale"]
    assert report["cold_start_s"] == COLD_START_S
    first = report["scale_ups"][0]
    # The starting pools' capacity (where they saturate) by the autoscaler's own sizing
    # arithmetic, at the trace's mean lengths.
    saturated = SizingConfig(tpot_slo_s=0.1, prefill_target_utilization=1.0,
                             decode_target_utilization=1.0)
    capacity = pool_capacity_per_s(ClusterSpec(1, 1, model=MODEL, gpu=GPU, tp_size=TP),
                                   saturated, 1, 1, report["mean_prompt_tokens"],
                                   report["mean_output_tokens"])
    assert LOW < capacity < HIGH  # the ramp outgrows the starting pools
    assert first["time_s"] <= time_rate_reaches(capacity) - COLD_START_S
    assert first["time_s"] >= FLAT_S  # not before the ramp: the flat part fits
    assert report["peak_prefill"] + report["peak_decode"] > 2
    # GPU-hours are the instances' time (starting ones included), more than the starting pools.
    assert report["gpu_hours"] == pytest.approx(summary["gpu_hours"])
    assert report["gpu_hours"] > report["gpu_hours_starting_pools"]
