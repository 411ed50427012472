"""``pdserve simulate`` end to end on a small trace, and the report it prints."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.cli import simulate as simulate_cmd
from pdserve.common.errors import InvalidArgumentError
from pdserve.sim import ClusterSpec, Failure, SimConfig, SloSpec, simulate
from pdserve.sim.engine_model import instance_model
from pdserve.sim.report import format_summary, summarize, time_series
from pdserve.sim.traces import LengthSpec, synthetic_trace


def _azure_csv(path: Path, num: int = 400, rate: float = 4.0) -> Path:
    trace = synthetic_trace(num, rate, seed=3, prompt=LengthSpec(900, 1.0, 1, 8000),
                            output=LengthSpec(120, 1.0, 1, 800))
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, p, o in zip(trace.arrival_s, trace.prompt_tokens, trace.output_tokens, strict=True):
        minutes, seconds = divmod(float(t), 60.0)
        lines.append(f"2023-11-16 10:{int(minutes):02d}:{seconds:010.7f},{p},{o}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate_cmd.add_arguments(parser)
    return parser.parse_args(list(words))


def test_simulate_prints_percentiles_attainment_and_writes_summary_and_plot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _azure_csv(tmp_path / "t.csv")
    out = tmp_path / "out"
    code = simulate_cmd.run(_args(
        "--trace", str(trace), "--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "1",
        "--num-prefill", "1", "--num-decode", "1", "--rate-scale", "2", "--slo-ttft-ms", "500",
        "--slo-tpot-ms", "30", "--fail-at", "40:d0", "--out", str(out)))
    assert code == 0
    text = capsys.readouterr().out
    assert "TTFT ms" in text and "TPOT ms" in text and "GPU-hours" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_prefill"] == 1 and summary["num_decode"] == 1
    assert 700 < summary["num_requests"] < 900  # rate x2 of 400 requests
    assert summary["num_requests"] == (summary["num_completed"] + summary["num_rejected"]
                                       + summary["num_failed"])
    assert summary["num_failed"] > 0  # d0, the only decode instance, failed at 40 s
    assert summary["misses"]["failed"] == summary["num_failed"]
    assert sum(summary["misses"].values()) == round(
        summary["num_requests"] * (1 - summary["attainment"]))
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    pytest.importorskip("matplotlib")
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_simulate_splits_instances_when_counts_are_not_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _azure_csv(tmp_path / "t.csv", num=100)
    assert simulate_cmd.run(_args("--trace", str(trace), "--num-instances", "6", "--no-plot",
                                  "--out", str(tmp_path / "o"))) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["num_prefill"] + summary["num_decode"] == 6
    assert not (tmp_path / "o" / "timeline.png").exists()
    assert "split of 6" in capsys.readouterr().out


def test_simulate_names_the_bad_line_and_the_bad_failure(tmp_path: Path) -> None:
    trace = _azure_csv(tmp_path / "t.csv", num=10)
    lines = trace.read_text().splitlines()
    lines[5] = "2023-11-16 10:00:01.0000000,many,3"
    trace.write_text("\n".join(lines) + "\n")
    with pytest.raises(InvalidArgumentError, match="line 6"):
        simulate_cmd.run(_args("--trace", str(trace), "--out", str(tmp_path / "o")))
    good = _azure_csv(tmp_path / "g.csv", num=10)
    with pytest.raises(InvalidArgumentError, match="fail"):
        simulate_cmd.run(_args("--trace", str(good), "--fail-at", "d0", "--out",
                               str(tmp_path / "o")))


def test_summary_counts_and_time_series_agree_with_the_result() -> None:
    instance = instance_model("llama-3.1-8b", "h100", 1)
    trace = synthetic_trace(2000, 25.0, seed=4, prompt=LengthSpec(2000, 1.0, 1, 20_000),
                            output=LengthSpec(100, 1.0, 1, 1000))
    result = simulate(trace, SimConfig(ClusterSpec(1, 1, model="llama-3.1-8b", gpu="h100",
                                                   tp_size=1),
                                       slo=SloSpec(ttft_ms=300, tpot_ms=20),
                                       failures=(Failure(30.0, "p0"),)), instance=instance)
    summary = summarize(result)
    assert summary.num_requests == 2000
    misses = result.miss_reasons()
    assert sum(summary.misses.values()) == np.count_nonzero(misses)
    assert summary.attainment == pytest.approx(result.attainment())
    assert summary.misses["queueing"] > 0  # one prefill instance for the whole load after 30 s
    text = format_summary(summary)
    assert f"{summary.misses['queueing']:,}" in text
    series = time_series(result, bin_s=10.0)
    assert series.arrival_rate_per_s.sum() * 10.0 == pytest.approx(2000)
    assert series.prefill_instances[0] == 1 and series.prefill_instances[-1] == 0
    weighted = np.nansum(series.attainment * series.arrival_rate_per_s * 10.0)
    assert weighted == pytest.approx(result.met_slo().sum())
