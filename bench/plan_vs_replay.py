"""Plans checked out of sample: made from a trace's first half, replayed on its second half.

For each trace in the data folder (Azure LLM 2023 code and conversation, Mooncake FAST'25
conversation and synthetic), at two load levels and two SLO pairs (one tight, one loose):

1. the trace is cut in two halves by time; each half's timestamps are compressed to the load's
   mean rate (the trace's own bursts, never jittered copies);
2. ``pdserve.sim.plan_check.check_plan`` plans from the first half (its lengths, prefix hits
   and arrival process: ``pdserve.capacity.arrival_process``) and grows the plan until its replay
   on the first half meets the target;
3. the plan is replayed on the second half, which it has never seen, at the same mean rate
   (the rate is the planner's input, an operator's forecast; what is out of sample is the
   arrival pattern, the lengths and the prefixes). For reference it is also replayed on the
   second half compressed by the first half's factor, i.e. at the second half's own load
   relative to the first (``own rate`` columns: a load the plan was not asked for).

Per row: instances and GPUs, the arrival model's prediction (made from the first half), the
replay on the first half and on the held-out second half, and (to tell the model's error from
the shift between the halves) the same model fitted on the held-out half for the same plan,
and how the held-out half's mean prompt and output lengths compare with the first half's.
Aims: held-out replay >= target on every row; |prediction - held-out replay| <= 5 points on
every row (both at the planned rate).

Model Llama-3.1-70B on H100-SXM-80GB, TP 2/4/8 (the same for both pools: the simulator runs one
instance type), 90% attainment. Loads: 2x and 5x each trace's own mean rate. SLOs: Azure
(prompts ~1-2k tokens) TTFT 1 s / TPOT 50 ms and 3 s / 100 ms; Mooncake (prompts ~12-15k
tokens, 10x longer, so prefill alone takes seconds at p90) 4 s / 60 ms and 10 s / 100 ms.

    python bench/plan_vs_replay.py [--traces-dir DIR] [--quick] [--max-replays 8]

Without the data folder it runs on a seeded synthetic bursty trace instead (and says so).
Writes bench/out/plan_vs_replay.png (matplotlib optional). Last line: one JSON object with
``rows``, ``min_replayed_attainment``, ``target``, ``max_abs_error_points`` and per-row figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACES_DIR = ROOT.parent / "shared" / "data" / "traces"
OUT_DIR = ROOT / "bench" / "out"
MODEL, GPU = "llama-3.1-70b", "h100-sxm-80gb"
TP_SIZES = (2, 4, 8)
PERCENTILE = 90.0
LOAD_FACTORS = (2.0, 5.0)
TRACES = (
    ("azure_llm_2023_code.csv", "azure"),
    ("azure_llm_2023_conv.csv", "azure"),
    ("mooncake_fast25_conversation_trace.jsonl", "mooncake"),
    ("mooncake_fast25_synthetic_trace.jsonl", "mooncake"),
)
SLO_PAIRS_S = {"azure": ((1.0, 0.050), (3.0, 0.100)),
               "mooncake": ((4.0, 0.060), (10.0, 0.100))}
"""(TTFT, TPOT) bounds in seconds per trace family: tight, then loose."""
AIM_ERROR_POINTS = 5.0


def synthetic_bursty_trace(seed: int = 0) -> Any:
    """A seeded trace with bursts: Poisson at 4 req/s with 40 bursts of 20 s at 3x, lengths
    log-normal like a chat trace. Stands in when the data folder is absent."""
    from pdserve.sim.traces import LengthSpec, Trace

    rng = np.random.default_rng(seed)
    duration_s = 3600.0
    grid = np.arange(0.0, duration_s, 1.0)
    rate = np.full(grid.size, 4.0)
    for start in rng.uniform(0.0, duration_s - 20.0, 40).astype(int):
        rate[start:start + 20] = 12.0
    counts = rng.poisson(rate)
    arrival_s = np.sort(np.repeat(grid, counts) + rng.random(int(counts.sum())))
    prompts = LengthSpec(1100, 0.9, 4, 14000).sample(rng, arrival_s.size)
    outputs = LengthSpec(210, 0.8, 1, 1000).sample(rng, arrival_s.size)
    return Trace(arrival_s - arrival_s[0], prompts, outputs, name="synthetic-bursty")


def shapes() -> tuple[Any, ...]:
    from pdserve.capacity.plan_inputs import InstanceShape

    return tuple(InstanceShape(MODEL, GPU, tp) for tp in TP_SIZES)


def run_row(trace: Any, family: str, factor: float, slo_pair: tuple[float, float],
            max_replays: int) -> dict[str, Any]:
    from pdserve.capacity.plan_inputs import Slo
    from pdserve.capacity.planner import ArrivalModel
    from pdserve.sim.plan_check import (
        at_rate,
        check_plan,
        demand_from_trace,
        replay_config,
        replayed_prefix_hit_rate,
    )
    from pdserve.sim.traces import time_scale

    rate = factor * trace.mean_rate_per_s
    middle_s = float(trace.arrival_s[-1]) / 2.0
    first_native = trace.window(0.0, middle_s)
    second_native = trace.window(middle_s, float(trace.arrival_s[-1]) + 1.0)
    first = at_rate(first_native, rate)
    # The held-out half at the planned rate (the aims), and compressed by the same factor as
    # the first half (its own load, which may differ from the first half's).
    second = at_rate(second_native, rate)
    second_own = time_scale(second_native, first_native.mean_rate_per_s / rate)
    slo = Slo(slo_pair[0], slo_pair[1], PERCENTILE)
    started = time.perf_counter()
    checked = check_plan(demand_from_trace(first), slo, shapes(), shapes(), first,
                         max_replays=max_replays)
    plan_s = time.perf_counter() - started
    config = checked.plan.config
    held_out_result = replay_config(config, second, slo)
    held_out = held_out_result.attainment()
    held_out_own = replay_config(config, second_own, slo).attainment()
    predicted = checked.predicted_attainment
    # The same model fitted on the held-out half itself (its arrivals, lengths and the prefix
    # hits its replay reached): what is left of the error is the model's, not the shift
    # between the halves.
    fitted = ArrivalModel.of(demand_from_trace(
        second, prefix_hit_rate=replayed_prefix_hit_rate(held_out_result)
        if second.has_prefix_hashes else None), slo).attainment(config)
    return {
        "trace": trace.name or family, "load_factor": factor, "rate_per_s": round(rate, 3),
        "ttft_ms": slo_pair[0] * 1000.0, "tpot_ms": slo_pair[1] * 1000.0,
        "tp": config.decode.tp_size, "num_prefill": config.num_prefill,
        "num_decode": config.num_decode, "num_gpus": config.num_gpus,
        "predicted_attainment": predicted,
        "replayed_attainment_first_half": checked.replayed_attainment,
        "replayed_attainment": held_out,
        "abs_error_points": abs(predicted - held_out) * 100.0,
        "predicted_on_held_out_half": fitted,
        "abs_model_error_points": abs(fitted - held_out) * 100.0,
        "second_half_own_rate_per_s": round(second_own.mean_rate_per_s, 3),
        "replayed_attainment_own_rate": held_out_own,
        # What changed between the halves per request (1.0: nothing): a held-out half whose
        # prompts are longer needs more prefill than any model of the first half can know of.
        "held_out_over_first_prompt_tokens": round(
            float(second.prompt_tokens.mean() / first.prompt_tokens.mean()), 3),
        "held_out_over_first_output_tokens": round(
            float(second.output_tokens.mean() / first.output_tokens.mean()), 3),
        "num_replays": len(checked.steps), "plan_s": round(plan_s, 2),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        from pdserve.common.plotting import pyplot, save_figure
    except ImportError:
        return False
    plt = pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(6.5, 5.5))
    names = sorted({r["trace"] for r in rows})
    for name, marker in zip(names, "osD^v<>", strict=False):
        part = [r for r in rows if r["trace"] == name]
        axis.scatter([100 * r["predicted_attainment"] for r in part],
                     [100 * r["replayed_attainment"] for r in part], marker=marker, label=name)
    low = min(50.0, *(100 * min(r["predicted_attainment"], r["replayed_attainment"])
                      for r in rows))
    line = np.array([low, 100.0])
    axis.plot(line, line, color="gray", linewidth=1)
    axis.fill_between(line, line - AIM_ERROR_POINTS, line + AIM_ERROR_POINTS, color="gray",
                      alpha=0.15, label=f"within {AIM_ERROR_POINTS:g} points")
    axis.axhline(PERCENTILE, color="tab:red", linestyle=":", label="target")
    axis.set_xlabel("arrival model's prediction (first half), %")
    axis.set_ylabel("replayed on the held-out second half, %")
    axis.set_title("plans made from a trace's first half, replayed on its second", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7)
    save_figure(figure, path)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces-dir", type=Path, default=DEFAULT_TRACES_DIR,
                        help="folder holding the four traces")
    parser.add_argument("--quick", action="store_true",
                        help="first 1,200 s of each trace, one load level (smoke run)")
    parser.add_argument("--max-replays", type=int, default=8,
                        help="most candidates replayed per plan")
    args = parser.parse_args()

    from pdserve.cli.capacity_cmd import table
    from pdserve.sim.traces import load_trace

    traces = []
    for file_name, family in TRACES:
        path = args.traces_dir / file_name
        if path.exists():
            traces.append((load_trace(path), family))
        else:
            print(f"NOTE: {path} not found; skipped")
    if not traces:
        print("NOTE: no trace found; a seeded synthetic bursty trace instead")
        traces.append((synthetic_bursty_trace(), "azure"))
    factors = LOAD_FACTORS[:1] if args.quick else LOAD_FACTORS
    rows = []
    started = time.perf_counter()
    for trace, family in traces:
        if args.quick:
            trace = trace.window(0.0, 1200.0)
        for factor in factors:
            for slo_pair in SLO_PAIRS_S[family]:
                row = run_row(trace, family, factor, slo_pair, args.max_replays)
                rows.append(row)
                print(f"  {row['trace']} x{factor:g} TTFT {row['ttft_ms']:g} ms: "
                      f"{row['num_prefill']}P+{row['num_decode']}D TP{row['tp']}, "
                      f"{row['plan_s']:.1f} s", file=sys.stderr, flush=True)
    print(table(["trace", "req/s", "TTFT/TPOT ms", "P+D x TP", "GPUs", "predicted",
                 "replay 1st", "held-out", "error pts", "model on held-out", "own req/s",
                 "held-out own", "prompt/out held-out:1st", "replays"], [
        [r["trace"], f"{r['rate_per_s']:.1f}", f"{r['ttft_ms']:g}/{r['tpot_ms']:g}",
         f"{r['num_prefill']}+{r['num_decode']} x{r['tp']}", str(r["num_gpus"]),
         f"{r['predicted_attainment']:.1%}", f"{r['replayed_attainment_first_half']:.1%}",
         f"{r['replayed_attainment']:.1%}", f"{r['abs_error_points']:.1f}",
         f"{r['predicted_on_held_out_half']:.1%}", f"{r['second_half_own_rate_per_s']:.1f}",
         f"{r['replayed_attainment_own_rate']:.1%}",
         f"{r['held_out_over_first_prompt_tokens']:.2f}/"
         f"{r['held_out_over_first_output_tokens']:.2f}",
         str(r["num_replays"])] for r in rows]))
    target = PERCENTILE / 100.0
    min_replayed = min(r["replayed_attainment"] for r in rows)
    max_error = max(r["abs_error_points"] for r in rows)
    num_met = sum(r["replayed_attainment"] >= target for r in rows)
    num_close = sum(r["abs_error_points"] <= AIM_ERROR_POINTS for r in rows)
    max_model_error = max(r["abs_model_error_points"] for r in rows)
    print(f"\nheld-out replay >= {target:.0%}: {num_met}/{len(rows)} rows; |prediction - "
          f"held-out| <= {AIM_ERROR_POINTS:g} points: {num_close}/{len(rows)} rows; the model "
          f"fitted on the held-out half is within {max_model_error:.1f} points of its replay; "
          f"{time.perf_counter() - started:.0f} s")
    path = OUT_DIR / "plan_vs_replay.png"
    if plot(rows, path):
        print(f"wrote {path}")
    else:
        print("matplotlib is not installed: no plot")
    print(json.dumps({
        "rows": len(rows), "target": target, "min_replayed_attainment": min_replayed,
        "max_abs_error_points": max_error, "num_rows_meeting_target": num_met,
        "max_abs_model_error_points": max_model_error,
        "num_rows_within_error_aim": num_close, "aim_error_points": AIM_ERROR_POINTS,
        "wall_s": round(time.perf_counter() - started, 1), "per_row": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
