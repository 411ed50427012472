"""Autoscaling over a simulated day: SLO attainment and GPU-hours of four ways to size the pools.

Demand: a day shape (``DAY_SHAPES``, ``pdserve.sim.traces.DayShape``): a 24-hour envelope plus
bursts at seeded random times; arrivals are a non-homogeneous Poisson process, request sizes are
drawn from a trace (any the simulator reads: Azure CSV or Mooncake JSONL). Two sets, so that the
defaults are judged out of sample (``--set``):

- ``tune``: the Azure 2023 code trace and the Mooncake synthetic trace, day shape ``tune``
  (10:1 peak-to-trough, two +60% bursts ramping over 10 minutes, held 30): what the autoscaler's
  defaults were tuned on;
- ``report`` (default): the Azure 2023 conversation trace and the Mooncake conversation trace,
  day shape ``report`` (4:1, evening peak, three +80% bursts ramping over 5 minutes, held 20):
  neither the traces nor the shape were looked at while tuning.

Traces come from ``<repo>/../shared/data/traces``; a missing one is replaced by a synthetic
log-normal with the conversation trace's means, and the output says so. A new instance takes
10 minutes from launch to serving. The run is the day's first ``--duration-s`` (default the whole
day, 86,400: 2.2 million requests per trace, about 5.5 minutes on two cores; ``--duration-s 7200``
runs its first two hours, its first burst included, in under a minute). The pools are
simulated by ``pdserve.sim`` (the same discrete-event simulator and policy objects as
``pdserve simulate``); every request's TTFT and TPOT are checked against the SLOs over the run.

Policies (all start the day with the instances the demand at midnight needs):

- ``ours``: ``pdserve.capacity.autoscaler.Autoscaler`` as the live governor runs it.
- ``reactive``: what a Kubernetes HorizontalPodAutoscaler on utilisation does (``HpaLike``):
  per pool, desired = ceil(ready x utilisation / 0.8), nothing within 10% of the target, up at
  once, down to the highest desired count of the last 5 minutes (its scale-down stabilisation
  window); no other delay. Same 10-minute cold start. Decode utilisation is normalised to the KV
  held at the batch limit, else it would never see the TPOT-bound pool as busy.
- ``static``: the instances the day's peak (bursts included) needs, all day.
- ``oracle``: perfect foresight and instant starts: every interval, the instances the exact rate
  of the next interval needs, ready at once. It sizes with the same capacity arithmetic and
  target utilisations as ``ours`` (``autoscaler.size_pools``), so the GPU-hour ratio is the price
  of not knowing the future and of cold starts, not of a different sizing model.

    python bench/autoscale.py [--set report|tune] [--trace PATH --day-shape NAME]
                              [--peak-rate-per-s 40] [--seed 1] [--jobs 2] [--out bench/out]

Prints a table per trace, writes ``autoscale-<trace>-<shape>.png`` (demand and instances per
policy over the day) and, as the last line, a JSON object keyed ``<trace>@<shape>``: for each of
``ours``, ``reactive``, ``static``, ``oracle`` its ``attainment`` and ``gpu_hours``, and
``ours_over_oracle_gpu_hours`` and ``feasible_attainment`` (the share of requests that meet both
SLOs alone on an idle instance: no policy attains more); plus ``aim_met`` (ours >= 99% at <= 1.25x
the oracle's GPU-hours on every row).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.capacity.autoscaler import Autoscaler
from pdserve.capacity.controls import AutoscalerConfig
from pdserve.capacity.scaling import PoolObservation, ScalingDecision, ScalingObservation
from pdserve.capacity.sizing import (
    InstanceProfile,
    LengthMoments,
    SizingConfig,
    decode_batch_limit,
    decode_kv_blocks_held,
    instances_for,
    size_pools,
)
from pdserve.common.plotting import pyplot
from pdserve.sim import ClusterSpec, SimConfig, SloSpec, simulate
from pdserve.sim.result import MissReason
from pdserve.sim.traces import (
    DayDemand,
    DayShape,
    LengthSpec,
    Trace,
    load_trace,
    synthetic_trace,
)

ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = ROOT.parent / "shared" / "data" / "traces"
POLICIES = ("ours", "reactive", "static", "oracle")
DAY_SHAPES = {
    "tune": DayShape(1.0, peak_to_trough=10.0, peak_hour=14.0, num_bursts=2, burst_rise=0.6,
                     burst_ramp_s=600.0, burst_duration_s=1800.0),
    "report": DayShape(1.0, peak_to_trough=4.0, peak_hour=20.0, num_bursts=3, burst_rise=0.8,
                       burst_ramp_s=300.0, burst_duration_s=1200.0),
}
"""Day shapes; the peak rate and the duration are set per run. ``tune``: the 2024 Azure code
trace's 10:1 day with two +60% bursts; ``report``: a flatter day with sharper, larger bursts."""
SETS = {
    "tune": (("azure_llm_2023_code.csv", "mooncake_fast25_synthetic_trace.jsonl"), "tune"),
    "report": (("azure_llm_2023_conv.csv", "mooncake_fast25_conversation_trace.jsonl"),
               "report"),
}
"""Traces (in ``TRACES_DIR``) and the day shape of each set."""


@dataclass(frozen=True, slots=True)
class Setup:
    """Everything a run needs; rebuilt identically in each worker process from the seed."""

    trace_path: str
    day_shape: str
    peak_rate_per_s: float
    seed: int
    model: str
    gpu: str
    tp_size: int
    cold_start_s: float
    interval_s: float
    duration_s: float
    ttft_ms: float
    tpot_ms: float


def load_sizes(path: Path) -> tuple[Trace, str]:
    """Request sizes (and nothing else: arrivals come from the day shape) of any trace the
    simulator reads; a synthetic log-normal when the file is missing."""
    if path.is_file():
        return load_trace(path), path.name
    note = (f"{path.name} not found: synthetic sizes (log-normal, mean prompt 1,155 / output 211 "
            f"tokens, the Azure conversation trace's means)")
    print(note, file=sys.stderr)
    return synthetic_trace(20_000, 1.0, seed=7, prompt=LengthSpec(1155, 0.8, 1, 14_000),
                           output=LengthSpec(211, 0.9, 1, 1000)), "synthetic (" + note + ")"


def build(setup: Setup) -> tuple[DayDemand, Trace, str]:
    sizes, source = load_sizes(Path(setup.trace_path))
    shape = dataclasses.replace(DAY_SHAPES[setup.day_shape],
                                peak_rate_per_s=setup.peak_rate_per_s,
                                duration_s=setup.duration_s)
    demand = DayDemand.with_random_bursts(shape, seed=setup.seed)
    return demand, demand.sample(sizes, seed=setup.seed), source


def profile_for(setup: Setup, cluster: ClusterSpec) -> InstanceProfile:
    return InstanceProfile.from_catalog(
        setup.model, setup.gpu, prefill_tp_size=setup.tp_size, decode_tp_size=setup.tp_size,
        block_size_tokens=cluster.block_size_tokens, max_batch_size=cluster.max_batch_size,
        gpu_memory_utilization=cluster.gpu_memory_utilization)


class HpaLike:
    """The reactive baseline: a Kubernetes HorizontalPodAutoscaler on utilisation, per pool.

    desired = ceil(num_ready x utilisation / target) (instances still starting count as idle,
    as the HPA counts unready pods at 0% when it scales up); no change while the ratio is within
    ``tolerance`` of 1; up at once; down only to the highest desired count of the last
    ``down_window_s`` (the HPA's scale-down stabilisation window, 300 s by default), and never
    while instances are starting (a reversal the HPA also refuses). No other delay.

    Utilisation is the share of what an instance can use: prefill, its busy fraction; decode,
    the KV blocks in use over the blocks in use when the batch is at its limit
    (``decode_full_kv_fraction``: for a large model on H100 the TPOT SLO caps the batch long
    before the KV cache fills, so the raw KV fraction would never reach the target).
    """

    def __init__(self, decode_full_kv_fraction: float, target: float = 0.8,
                 tolerance: float = 0.1, down_window_s: float = 300.0) -> None:
        self.decode_full_kv_fraction = decode_full_kv_fraction
        self.target, self.tolerance, self.down_window_s = target, tolerance, down_window_s
        self._desired: dict[str, collections.deque[tuple[float, int]]] = {
            "prefill": collections.deque(), "decode": collections.deque()}

    def _pool(self, role: str, pool: PoolObservation, utilization: float,
              now_s: float) -> tuple[int, str]:
        current = pool.num_ready + pool.num_starting
        ratio = utilization / self.target
        if pool.num_ready == 0 or abs(ratio - 1.0) <= self.tolerance:
            desired = current
        else:
            desired = max(1, math.ceil(pool.num_ready * ratio))
        history = self._desired[role]
        history.append((now_s, desired))
        while history[0][0] < now_s - self.down_window_s:
            history.popleft()
        if desired > current:
            return desired, "up"
        if pool.num_starting:
            return current, "hold (starting)"
        stabilized = max(d for _, d in history)
        return (stabilized, "down") if stabilized < current else (current, "hold")

    def decide(self, observation: ScalingObservation) -> ScalingDecision:
        now_s = observation.now_s
        prefill, why_p = self._pool("prefill", observation.prefill,
                                    observation.prefill.utilization, now_s)
        decode, why_d = self._pool(
            "decode", observation.decode,
            observation.decode.utilization / self.decode_full_kv_fraction, now_s)
        return ScalingDecision(prefill, decode, f"prefill {why_p}; decode {why_d}")


class PerfectForesight:
    """The oracle: sizes each interval for the highest exact rate of the coming interval, with
    the sizing arithmetic ``ours`` uses and the trace's length moments (run with instant
    starts)."""

    def __init__(self, demand: DayDemand, profile: InstanceProfile, sizing: SizingConfig,
                 moments: LengthMoments) -> None:
        self.demand, self.profile, self.sizing = demand, profile, sizing
        self.moments = moments

    def needs(self, start_s: float, end_s: float) -> tuple[int, int]:
        """Instances for the highest rate in ``[start_s, end_s]`` (sampled every 10 s)."""
        times = np.append(np.arange(start_s, end_s, 10.0), end_s)
        rate = float(np.max(self.demand.rate_per_s(times)))
        sizing = size_pools(self.profile, self.sizing, self.moments.demand(rate))
        return max(1, instances_for(sizing.num_prefill)), max(1, instances_for(sizing.num_decode))

    def decide(self, observation: ScalingObservation) -> ScalingDecision:
        num_prefill, num_decode = self.needs(observation.now_s,
                                             observation.now_s + observation.interval_s)
        return ScalingDecision(num_prefill, num_decode, "perfect foresight")


def decode_full_kv_fraction(profile: InstanceProfile, sizing: SizingConfig,
                            moments: LengthMoments) -> float:
    """KV fraction a decode instance holds with its batch at the limit (reservations of
    prompt + output from routing to the last token, as the simulated router makes them)."""
    batch, _ = decode_batch_limit(profile, sizing, moments.prompt, moments.output, moments)
    held = decode_kv_blocks_held(profile, sizing, batch, moments)
    return min(1.0, held / profile.decode_num_blocks)


def run_policy(name: str, setup: Setup) -> dict[str, Any]:
    """One day under one policy; returns plain values (this runs in a worker process)."""
    started = time.perf_counter()
    demand, trace, _ = build(setup)
    cluster = ClusterSpec(1, 1, model=setup.model, gpu=setup.gpu, tp_size=setup.tp_size)
    profile = profile_for(setup, cluster)
    sizing = SizingConfig(tpot_slo_s=setup.tpot_ms / 1000.0)
    moments = LengthMoments.measured(trace.prompt_tokens, trace.output_tokens)
    oracle = PerfectForesight(demand, profile, sizing, moments)
    start = oracle.needs(0.0, setup.interval_s)
    policy: Any
    cold_start_s = setup.cold_start_s
    if name == "ours":
        policy = Autoscaler(profile, AutoscalerConfig(sizing=sizing))
    elif name == "reactive":
        policy = HpaLike(decode_full_kv_fraction(profile, sizing, moments))
    elif name == "static":
        policy = None
        start = oracle.needs(0.0, setup.duration_s)
    else:
        policy, cold_start_s = oracle, 0.0
    config = SimConfig(
        ClusterSpec(start[0], start[1], model=setup.model, gpu=setup.gpu, tp_size=setup.tp_size),
        slo=SloSpec(ttft_ms=setup.ttft_ms, tpot_ms=setup.tpot_ms), cold_start_s=cold_start_s,
        scaling_interval_s=setup.interval_s, sample_interval_s=60.0, deployment=name)
    result = simulate(trace, config, policy)
    reasons = result.miss_reasons()
    timeline = result.timeline
    return {
        "name": name,
        "attainment": result.attainment(),
        "gpu_hours": result.gpu_hours,
        "num_requests": result.num_requests,
        "ttft_p99_s": float(np.percentile(result.ttft_s, 99)),
        "tpot_p99_s": float(np.percentile(result.tpot_s, 99)),
        "misses": {reason.name.lower(): int(np.count_nonzero(reasons == reason))
                   for reason in MissReason if reason is not MissReason.NONE},
        "time_s": timeline["time_s"].tolist(),
        "prefill": (timeline["prefill_ready"] + timeline["prefill_starting"]).tolist(),
        "decode": (timeline["decode_ready"] + timeline["decode_starting"]).tolist(),
        "wall_s": time.perf_counter() - started,
        "sim_wall_s": result.wall_s,
    }


def plot(path: Path, demand: DayDemand, trace: Trace, runs: dict[str, dict[str, Any]],
         tp_size: int, trace_name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    edges = np.arange(0.0, demand.shape.duration_s + 60.0, 60.0)
    counts, _ = np.histogram(trace.arrival_s, bins=edges)
    hours = edges[:-1] / 3600.0
    top.plot(hours, counts / 60.0, lw=0.6, color="0.6", label="arrivals (per-minute mean)")
    top.plot(hours, demand.rate_per_s(edges[:-1]), lw=1.2, color="k", label="rate envelope")
    top.set_ylabel("requests / s")
    top.legend(loc="upper left")
    shape = demand.shape
    top.set_title(f"Demand: {trace_name}, {shape.peak_to_trough:g}:1 day, {shape.num_bursts} "
                  f"bursts of +{shape.burst_rise:.0%}")
    colors = {"ours": "tab:blue", "reactive": "tab:orange", "static": "tab:gray",
              "oracle": "tab:green"}
    for name, run in runs.items():
        t = np.asarray(run["time_s"]) / 3600.0
        gpus = (np.asarray(run["prefill"]) + np.asarray(run["decode"])) * tp_size
        bottom.step(t, gpus, where="post", lw=1.1, color=colors[name],
                    label=f"{name}: {run['attainment']:.2%} SLO, {run['gpu_hours']:,.0f} GPU-h")
    bottom.set_ylabel("GPUs (prefill + decode, incl. starting)")
    bottom.set_xlabel("hour of day")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def feasible_share(setup: Setup, trace: Trace) -> float:
    """Share of the requests that meet both SLOs alone on an idle instance: the prompt's
    prefill within the TTFT bound, a lone sequence's decode step at its mean context within
    the TPOT bound. No policy attains more; KV transfer and queueing come on top."""
    cluster = ClusterSpec(1, 1, model=setup.model, gpu=setup.gpu, tp_size=setup.tp_size)
    profile = profile_for(setup, cluster)
    prefill, decode = profile.prefill_perf, profile.decode_perf
    ttft_s, tpot_s = setup.ttft_ms / 1000.0, setup.tpot_ms / 1000.0
    ok = 0
    for prompt, output in zip(trace.prompt_tokens.tolist(), trace.output_tokens.tolist(),
                              strict=True):
        if (prefill.prefill_time_s([prompt]) <= ttft_s
                and decode.decode_step_time_s(1, prompt + output / 2.0) <= tpot_s):
            ok += 1
    return ok / max(1, trace.num_requests)


def run_row(setup: Setup, names: list[str], jobs: int, out: Path) -> dict[str, Any]:
    """Every policy on one trace and day shape: prints its table, writes its plot."""
    demand, trace, source = build(setup)
    trace_name = Path(setup.trace_path).stem
    print(f"\n== {trace_name} @ {setup.day_shape}: {trace.num_requests:,} requests over "
          f"{setup.duration_s / 3600:g} h, peak {setup.peak_rate_per_s:g} req/s, "
          f"{demand.shape.peak_to_trough:g}:1 peak-to-trough, bursts at "
          f"{', '.join(f'{s / 3600:.2f} h' for s in demand.burst_starts_s)}; sizes: {source}")
    runs: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {name: pool.submit(run_policy, name, setup) for name in names}
        for name in names:
            runs[name] = futures[name].result()
            print(f"  {name}: simulated in {runs[name]['sim_wall_s']:.0f} s", file=sys.stderr)
    oracle_gpu_h = runs["oracle"]["gpu_hours"] if "oracle" in runs else float("nan")
    feasible = feasible_share(setup, trace)
    print(f"feasible: {feasible:.2%} of the requests meet both SLOs alone on an idle instance "
          f"(no policy attains more)")
    header = (f"{'policy':<10}{'attainment':>11}{'GPU-hours':>11}{'x oracle':>10}"
              f"{'TTFT p99 s':>12}{'TPOT p99 ms':>13}  misses (queueing/transfer/compute/"
              f"rejected)")
    print(header)
    print("-" * len(header))
    for name, run in runs.items():
        misses = run["misses"]
        print(f"{name:<10}{run['attainment']:>11.2%}{run['gpu_hours']:>11,.0f}"
              f"{run['gpu_hours'] / oracle_gpu_h:>10.2f}{run['ttft_p99_s']:>12.2f}"
              f"{run['tpot_p99_s'] * 1000:>13.0f}  {misses['queueing']:,}/{misses['transfer']:,}/"
              f"{misses['compute']:,}/{misses['rejected']:,}")
    png = out / f"autoscale-{trace_name}-{setup.day_shape}.png"
    plot(png, demand, trace, runs, setup.tp_size, trace_name)
    print(f"plot: {png}")
    row: dict[str, Any] = {name: {"attainment": round(run["attainment"], 5),
                                  "gpu_hours": round(run["gpu_hours"], 1)}
                           for name, run in runs.items()}
    if "ours" in runs and "oracle" in runs:
        row["ours_over_oracle_gpu_hours"] = round(runs["ours"]["gpu_hours"] / oracle_gpu_h, 3)
    row["feasible_attainment"] = round(feasible, 5)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=sorted(SETS), default="report",
                        help="the traces and day shape to run (default: report)")
    parser.add_argument("--trace", type=Path, action="append", default=[],
                        help="a trace instead of the set's (repeatable)")
    parser.add_argument("--day-shape", choices=sorted(DAY_SHAPES), default="",
                        help="the day shape instead of the set's")
    parser.add_argument("--peak-rate-per-s", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", default="llama-3.1-70b")
    parser.add_argument("--gpu", default="h100-sxm-80gb")
    parser.add_argument("--tp-size", type=int, default=4)
    parser.add_argument("--cold-start-s", type=float, default=600.0)
    parser.add_argument("--interval-s", type=float, default=30.0)
    parser.add_argument("--duration-s", type=float, default=86_400.0,
                        help="simulate the day's first this many seconds (default: all of it)")
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-ms", type=float, default=100.0)
    parser.add_argument("--jobs", type=int, default=2, help="policies simulated at once")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()

    set_traces, set_shape = SETS[args.set]
    traces = args.trace or [TRACES_DIR / name for name in set_traces]
    shape = args.day_shape or set_shape
    names = [name for name in args.policies.split(",") if name]
    print(f"set {args.set}: cluster {args.model} TP{args.tp_size} on {args.gpu}; cold start "
          f"{args.cold_start_s:g} s; decisions every {args.interval_s:g} s; SLO TTFT "
          f"{args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms (both, per request)")
    started = time.perf_counter()
    rows: dict[str, Any] = {}
    for trace_path in traces:
        setup = Setup(str(trace_path), shape, args.peak_rate_per_s, args.seed, args.model,
                      args.gpu, args.tp_size, args.cold_start_s, args.interval_s,
                      args.duration_s, args.ttft_ms, args.tpot_ms)
        rows[f"{Path(trace_path).stem}@{shape}"] = run_row(setup, names, args.jobs, args.out)
    print(f"\nwall {time.perf_counter() - started:.0f} s")
    judged = [row for row in rows.values() if "ours_over_oracle_gpu_hours" in row]
    is_met = bool(judged) and all(row["ours"]["attainment"] >= 0.99
                                  and row["ours_over_oracle_gpu_hours"] <= 1.25 for row in judged)
    for key, row in rows.items():
        if "ours_over_oracle_gpu_hours" in row:
            print(f"aim ({key}): ours >= 99% attainment ({row['ours']['attainment']:.2%}; "
                  f"{row['feasible_attainment']:.2%} feasible) at <= 1.25x the oracle's "
                  f"GPU-hours ({row['ours_over_oracle_gpu_hours']:.2f}x)")
    print(json.dumps({**rows, "aim_met": is_met}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
