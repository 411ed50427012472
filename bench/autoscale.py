"""Autoscaling over a simulated day: SLO attainment and GPU-hours of four ways to size the pools.

Demand: a 24-hour envelope with a 10:1 peak-to-trough ratio (as the 2024 Azure code trace shows)
plus two bursts at seeded random times that raise the rate by 60% over 10 minutes and hold it for
30 minutes from their start (then fall back over 10 minutes) (``pdserve.sim.traces.DayShape``);
arrivals are a non-homogeneous Poisson process, request sizes are drawn from the Azure 2023
conversation trace (``<repo>/../shared/data/traces/azure_llm_2023_conv.csv``; without it a
synthetic log-normal with the trace's means, and the output says so). A new instance takes
10 minutes from launch to serving. The pools are simulated by ``pdserve.sim`` (the same
discrete-event simulator and policy objects as ``pdserve simulate``); every request's TTFT and
TPOT are checked against the SLOs over the whole day.

Policies (all start the day with the instances the demand at midnight needs):

- ``ours``: ``pdserve.capacity.autoscaler.Autoscaler`` as the live governor runs it.
- ``reactive``: per pool, add 25% (at least one) when the pool's utilisation is above 80%, remove
  one when it is below 40%; no new step while instances are starting (the usual cool-down).
  Same 10-minute cold start. Decode utilisation is normalised to the KV held at the batch limit
  (``UtilizationThreshold``), else it would never see the TPOT-bound pool as busy.
- ``static``: the instances the day's peak (bursts included) needs, all day.
- ``oracle``: perfect foresight and instant starts: every interval, the instances the exact rate
  of the next interval needs, ready at once. It sizes with the same capacity arithmetic and
  target utilisations as ``ours`` (``autoscaler.size_pools``), so the GPU-hour ratio is the price
  of not knowing the future and of cold starts, not of a different sizing model.

    python bench/autoscale.py [--peak-rate-per-s 40] [--seed 1] [--jobs 2] [--out bench/out]

Prints a table, writes ``autoscale.png`` (demand and instances per policy over the day) and, as
the last line, a JSON object: for each of ``ours``, ``reactive``, ``static``, ``oracle`` its
``attainment`` and ``gpu_hours``.
"""

from __future__ import annotations

import argparse
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
    SizingConfig,
    SizingDemand,
    decode_batch_limit,
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
    load_azure_csv,
    synthetic_trace,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"
POLICIES = ("ours", "reactive", "static", "oracle")


@dataclass(frozen=True, slots=True)
class Setup:
    """Everything a run needs; rebuilt identically in each worker process from the seed."""

    trace_path: str
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
    if path.is_file():
        return load_azure_csv(path), f"Azure 2023 conversation trace ({path.name})"
    note = (f"{path} not found: synthetic sizes (log-normal, mean prompt 1,155 / output 211 "
            f"tokens, the conversation trace's means)")
    print(note, file=sys.stderr)
    return synthetic_trace(20_000, 1.0, seed=7, prompt=LengthSpec(1155, 0.8, 1, 14_000),
                           output=LengthSpec(211, 0.9, 1, 1000)), "synthetic (" + note + ")"


def build(setup: Setup) -> tuple[DayDemand, Trace, str]:
    sizes, source = load_sizes(Path(setup.trace_path))
    shape = DayShape(peak_rate_per_s=setup.peak_rate_per_s, peak_to_trough=10.0, num_bursts=2,
                     burst_rise=0.6, burst_ramp_s=600.0, burst_duration_s=1800.0,
                     duration_s=setup.duration_s)
    demand = DayDemand.with_random_bursts(shape, seed=setup.seed)
    return demand, demand.sample(sizes, seed=setup.seed), source


def profile_for(setup: Setup, cluster: ClusterSpec) -> InstanceProfile:
    return InstanceProfile.from_catalog(
        setup.model, setup.gpu, prefill_tp_size=setup.tp_size, decode_tp_size=setup.tp_size,
        block_size_tokens=cluster.block_size_tokens, max_batch_size=cluster.max_batch_size,
        gpu_memory_utilization=cluster.gpu_memory_utilization)


class UtilizationThreshold:
    """The reactive baseline: per pool, +25% (at least 1) above ``high`` utilisation, -1 below
    ``low``, nothing while any instance of the pool is still starting (cool-down).

    Utilisation is the share of what an instance can use: prefill, its busy fraction; decode,
    the KV blocks in use over the blocks in use when the batch is at its limit
    (``decode_full_kv_fraction``: for a large model on H100 the TPOT SLO caps the batch long
    before the KV cache fills, so the raw KV fraction would never reach 80%).
    """

    def __init__(self, decode_full_kv_fraction: float, high: float = 0.8, low: float = 0.4,
                 step_fraction: float = 0.25) -> None:
        self.decode_full_kv_fraction = decode_full_kv_fraction
        self.high, self.low, self.step_fraction = high, low, step_fraction

    def _pool(self, pool: PoolObservation, utilization: float) -> tuple[int, str]:
        current = pool.num_ready + pool.num_starting
        if pool.num_starting:
            return current, "cool-down"
        if utilization > self.high:
            return current + max(1, math.ceil(self.step_fraction * current)), "up"
        if utilization < self.low and current > 1:
            return current - 1, "down"
        return current, "hold"

    def decide(self, observation: ScalingObservation) -> ScalingDecision:
        prefill, why_p = self._pool(observation.prefill, observation.prefill.utilization)
        decode, why_d = self._pool(observation.decode,
                                   observation.decode.utilization / self.decode_full_kv_fraction)
        return ScalingDecision(prefill, decode, f"prefill {why_p}; decode {why_d}")


class PerfectForesight:
    """The oracle: sizes each interval for the highest exact rate of the coming interval, with
    the sizing arithmetic ``ours`` uses and the trace's mean lengths (run with instant starts)."""

    def __init__(self, demand: DayDemand, profile: InstanceProfile, sizing: SizingConfig,
                 mean_prompt_tokens: float, mean_output_tokens: float) -> None:
        self.demand, self.profile, self.sizing = demand, profile, sizing
        self.prompt, self.output = mean_prompt_tokens, mean_output_tokens

    def needs(self, start_s: float, end_s: float) -> tuple[int, int]:
        """Instances for the highest rate in ``[start_s, end_s]`` (sampled every 10 s)."""
        times = np.append(np.arange(start_s, end_s, 10.0), end_s)
        rate = float(np.max(self.demand.rate_per_s(times)))
        sizing = size_pools(self.profile, self.sizing,
                            SizingDemand(rate, self.prompt, self.output))
        return max(1, instances_for(sizing.num_prefill)), max(1, instances_for(sizing.num_decode))

    def decide(self, observation: ScalingObservation) -> ScalingDecision:
        num_prefill, num_decode = self.needs(observation.now_s,
                                             observation.now_s + observation.interval_s)
        return ScalingDecision(num_prefill, num_decode, "perfect foresight")


def decode_full_kv_fraction(profile: InstanceProfile, sizing: SizingConfig, prompt: float,
                            output: float) -> float:
    """KV fraction a decode instance holds with its batch at the limit (reservations of
    prompt + output, as the simulated router makes them)."""
    batch, _ = decode_batch_limit(profile, sizing, prompt, output)
    blocks = math.ceil((prompt + output) / profile.block_size_tokens)
    return min(1.0, batch * blocks / profile.decode_num_blocks)


def run_policy(name: str, setup: Setup) -> dict[str, Any]:
    """One day under one policy; returns plain values (this runs in a worker process)."""
    started = time.perf_counter()
    demand, trace, _ = build(setup)
    cluster = ClusterSpec(1, 1, model=setup.model, gpu=setup.gpu, tp_size=setup.tp_size)
    profile = profile_for(setup, cluster)
    sizing = SizingConfig(tpot_slo_s=setup.tpot_ms / 1000.0)
    prompt, output = float(trace.prompt_tokens.mean()), float(trace.output_tokens.mean())
    oracle = PerfectForesight(demand, profile, sizing, prompt, output)
    start = oracle.needs(0.0, setup.interval_s)
    policy: Any
    cold_start_s = setup.cold_start_s
    if name == "ours":
        policy = Autoscaler(profile, AutoscalerConfig(sizing=sizing))
    elif name == "reactive":
        policy = UtilizationThreshold(decode_full_kv_fraction(profile, sizing, prompt, output))
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
         tp_size: int) -> None:
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
    top.set_title("Demand over the day (two bursts of +60%)")
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--peak-rate-per-s", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", default="llama-3.1-70b")
    parser.add_argument("--gpu", default="h100-sxm-80gb")
    parser.add_argument("--tp-size", type=int, default=4)
    parser.add_argument("--cold-start-s", type=float, default=600.0)
    parser.add_argument("--interval-s", type=float, default=30.0)
    parser.add_argument("--duration-s", type=float, default=86_400.0)
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-ms", type=float, default=100.0)
    parser.add_argument("--jobs", type=int, default=2, help="policies simulated at once")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()

    setup = Setup(str(args.trace), args.peak_rate_per_s, args.seed, args.model, args.gpu,
                  args.tp_size, args.cold_start_s, args.interval_s, args.duration_s,
                  args.ttft_ms, args.tpot_ms)
    names = [name for name in args.policies.split(",") if name]
    demand, trace, source = build(setup)
    print(f"demand: {trace.num_requests:,} requests over {args.duration_s / 3600:g} h, peak "
          f"{args.peak_rate_per_s:g} req/s, 10:1 peak-to-trough, bursts at "
          f"{', '.join(f'{s / 3600:.2f} h' for s in demand.burst_starts_s)}; sizes: {source}")
    print(f"cluster: {args.model} TP{args.tp_size} on {args.gpu}; cold start "
          f"{args.cold_start_s:g} s; decisions every {args.interval_s:g} s; SLO TTFT "
          f"{args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms (both, per request)")
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {name: pool.submit(run_policy, name, setup) for name in names}
        for name in names:
            runs[name] = futures[name].result()
            print(f"  {name}: simulated in {runs[name]['sim_wall_s']:.0f} s", file=sys.stderr)
    oracle_gpu_h = runs["oracle"]["gpu_hours"] if "oracle" in runs else float("nan")
    print()
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
    png = args.out / "autoscale.png"
    plot(png, demand, trace, runs, args.tp_size)
    print(f"\nplot: {png}; wall {time.perf_counter() - started:.0f} s")
    if "ours" in runs and "oracle" in runs:
        ours = runs["ours"]
        print(f"aim: ours >= 99% attainment ({ours['attainment']:.2%}) at <= 1.25x the oracle's "
              f"GPU-hours ({ours['gpu_hours'] / oracle_gpu_h:.2f}x)")
    print(json.dumps({name: {"attainment": round(run["attainment"], 5),
                             "gpu_hours": round(run["gpu_hours"], 1)}
                      for name, run in runs.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
