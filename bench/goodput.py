"""Goodput per GPU: the planner's disaggregated configuration vs the best colocated one, the
planner's P:D ratio vs a brute-force sweep, and the planner's predictions vs the simulator.

Demand: prompt/output pairs of the Azure LLM 2023 conversation trace (Splitwise, ISCA'24) with
Poisson arrivals at ``--rate`` req/s (the trace's own 5.5 req/s would need one instance per pool);
model Llama-3.1-70B on H100-SXM-80GB from the catalog, calibrated roofline.

SLOs (both at 90% attainment, DistServe's goodput definition):
- TPOT <= 40 ms: the "interactive" bound MLPerf Inference v5.0 sets for Llama-2-70B (25 tokens/s
  per user), tight for a 70B model on H100 (an unloaded TP4 step is ~29 ms here);
- TTFT <= 1 s: DistServe's chatbot SLOs give TTFT several times the prefill of a typical
  prompt (OPT-66B: 2.5 s) and far more slack than TPOT; 1 s is ~4x the prefill of a p90 prompt
  (2.7k tokens) at TP4, between MLPerf's interactive (0.45 s) and server (2 s) bounds.

Steps:
1. planner (analytic) per TP size with both pools at that TP (the simulator runs one TP for both
   pools), cheapest wins; the mixed-TP plan is shown for reference;
2. best colocated configuration (chunked prefill, ``pdserve.capacity.colocated``) on the same
   GPU count: TP x token budget, analytic (the simulator models disaggregated pools only);
3. planner's predicted p90 TTFT/TPOT and attainment vs the simulator on the same demand;
4. sweep of every P:D split of the plan's GPUs, goodput of each by the simulator (bisection on
   the rate; analytic model if ``pdserve.sim`` is missing), plot in bench/out/goodput_sweep.png.

    python bench/goodput.py [--trace PATH] [--rate 30] [--duration-s 900] [--quick]

Last line: JSON with goodput_per_gpu_disagg (simulator-measured when available),
goodput_per_gpu_colocated, pd_ratio_planner, pd_ratio_best and supporting figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.capacity import colocated as co
from pdserve.capacity import planner as pl
from pdserve.capacity.disaggregated import predict
from pdserve.capacity.plan_inputs import Demand, DisaggConfig, InstanceShape, Slo
from pdserve.cli.capacity_cmd import table
from pdserve.cli.plan import plot_sweep

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"
OUT_DIR = ROOT / "bench" / "out"
MODEL, GPU = "llama-3.1-70b", "h100-sxm-80gb"
SLO = Slo(ttft_s=1.0, tpot_s=0.040, percentile=90.0)
TP_SIZES = (2, 4, 8)
WARMUP_S = 60.0


def load_lengths(path: Path) -> tuple[np.ndarray, np.ndarray, str]:
    try:
        from pdserve.sim.traces import load_trace
    except ImportError:
        load_trace = None
    if path.exists() and load_trace is not None:
        trace = load_trace(path)
        return trace.prompt_tokens, trace.output_tokens, f"{path.name} ({trace.num_requests} rows)"
    rng = np.random.default_rng(0)
    prompts = np.clip(rng.lognormal(np.log(1155) - 0.25, 0.7, 20_000), 4, 14_000).round()
    outputs = np.clip(rng.lognormal(np.log(211) - 0.3, 0.77, 20_000), 1, 1000).round()
    print(f"NOTE: {path} not found; synthetic log-normal lengths with the Azure conversation "
          "trace's means instead (prompt 1,155, output 211)")
    return prompts.astype(np.int64), outputs.astype(np.int64), "synthetic"


class SimEvaluator:
    """Attainment of a configuration at a rate, measured by the simulator on Poisson arrivals
    with the demand's length pairs (requests arriving in the first ``WARMUP_S`` not counted)."""

    def __init__(self, prompts: np.ndarray, outputs: np.ndarray, duration_s: float) -> None:
        from pdserve.sim import ClusterSpec, SimConfig, SloSpec, simulate
        from pdserve.sim.traces import Trace, synthetic_trace

        self._classes = (ClusterSpec, SimConfig, SloSpec, simulate)
        self._sizes = Trace(np.zeros(len(prompts)), prompts, outputs)
        self._synthetic = synthetic_trace
        self.duration_s = duration_s
        self.num_runs = 0
        self.wall_s = 0.0

    def run(self, config: DisaggConfig, rate: float, seed: int = 1):
        from pdserve.router.policy import RoutingConfig

        cluster_cls, config_cls, slo_cls, simulate = self._classes
        assert config.prefill.tp_size == config.decode.tp_size
        trace = self._synthetic(int(rate * self.duration_s), rate, seed=seed, sizes=self._sizes)
        sim_config = config_cls(
            cluster=cluster_cls(config.num_prefill, config.num_decode, model=MODEL, gpu=GPU,
                                tp_size=config.decode.tp_size, prefill_batch_tokens=1),
            routing=RoutingConfig(
                local_prefill_threshold_tokens=config.local_prefill_threshold_tokens),
            slo=slo_cls(ttft_ms=SLO.ttft_s * 1000, tpot_ms=SLO.tpot_s * 1000))
        started = time.perf_counter()
        result = simulate(trace, sim_config)
        self.wall_s += time.perf_counter() - started
        self.num_runs += 1
        return result

    def attainment(self, config: DisaggConfig, rate: float) -> float:
        result = self.run(config, rate)
        counted = result.arrival_s >= WARMUP_S
        return float(result.met_slo()[counted].mean())


def max_rate_near(attainment_at, guess: float, target: float, tolerance: float = 0.02) -> float:
    """``planner.max_rate`` started from a good guess: step by 10% to bracket, then bisect."""
    if guess <= 0:
        return 0.0
    low = high = None
    rate = guess
    for _ in range(12):
        if attainment_at(rate) >= target:
            low = rate
            if high is not None:
                break
            rate *= 1.1
        else:
            high = rate
            if low is not None:
                break
            rate /= 1.1
    if low is None:
        return 0.0
    if high is None:
        return low
    while high - low > tolerance * high:
        middle = 0.5 * (low + high)
        if attainment_at(middle) >= target:
            low = middle
        else:
            high = middle
    return low


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--rate", type=float, default=30.0, help="planning rate, req/s")
    parser.add_argument("--duration-s", type=float, default=900.0,
                        help="simulated seconds per simulator run")
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.duration_s = 180.0
    started = time.perf_counter()
    prompts, outputs, source = load_lengths(args.trace)
    demand = Demand(args.rate, tuple(int(x) for x in prompts),
                       tuple(int(x) for x in outputs))
    print(f"{MODEL} on {GPU}; lengths: {source}, mean prompt {demand.mean_prompt_tokens:,.0f} / "
          f"output {demand.mean_output_tokens:,.0f}; Poisson arrivals at {args.rate:g} req/s")
    print(f"SLO: TTFT <= {SLO.ttft_s * 1000:.0f} ms and TPOT <= {SLO.tpot_s * 1000:.0f} ms for "
          f"{SLO.percentile:g}% of requests")

    # 1. Plans.
    shapes = {tp: InstanceShape(MODEL, GPU, tp) for tp in TP_SIZES}
    plans = {tp: pl.plan(demand, SLO, (s,), (s,)) for tp, s in shapes.items()}
    tp_plan = min(plans, key=lambda tp: (plans[tp].config.num_gpus, -plans[tp].goodput_per_gpu))
    plan = plans[tp_plan]
    mixed = pl.plan(demand, SLO, tuple(shapes.values()), tuple(shapes.values()))
    rows = []
    mixed_label = f"TP{mixed.config.prefill.tp_size}/TP{mixed.config.decode.tp_size} (mixed)"
    for label, result in [*((f"TP{tp}/TP{tp}", p) for tp, p in plans.items()),
                          (mixed_label, mixed)]:
        c = result.config
        rows.append([label, str(c.num_prefill), str(c.num_decode), str(c.num_gpus),
                     f"{c.pd_ratio:.3f}", str(c.local_prefill_threshold_tokens),
                     f"{result.goodput_per_gpu:.3f}"])
    print("\nplanner (analytic), cheapest per TP; chosen for the simulator: "
          f"TP{tp_plan}/TP{tp_plan}")
    print(table(["prefill/decode TP", "P", "D", "GPUs", "P:D GPUs", "local thr",
                 "goodput/GPU"], rows))

    # 2. Colocated baseline on the same number of GPUs.
    num_gpus = plan.config.num_gpus
    best_co, tried = co.best_colocated(demand, SLO, tuple(shapes.values()), num_gpus)
    print(f"\ncolocated, chunked prefill (analytic), {num_gpus} GPUs: best 5 of {len(tried)}")
    print(table(["TP", "instances", "token budget", "goodput req/s", "goodput/GPU"], [
        [str(r.config.shape.tp_size), str(r.config.num_instances), str(r.config.token_budget),
         f"{r.goodput_rate_per_s:.2f}", f"{r.goodput_per_gpu:.3f}"] for r in tried[:5]]))

    # 3. Planner vs simulator, 4. sweep.
    try:
        evaluator: SimEvaluator | None = SimEvaluator(prompts, outputs, args.duration_s)
    except ImportError:
        evaluator = None
        print("\nNOTE: pdserve.sim is not importable: the sweep uses the analytic model")
    check_rows = []
    disagg_sim = None
    if evaluator is not None:
        rate_sim = max_rate_near(lambda r: evaluator.attainment(plan.config, r),
                                 plan.goodput_rate_per_s, SLO.attainment_target)
        disagg_sim = rate_sim / num_gpus
        for rate in (args.rate, plan.goodput_rate_per_s):
            predicted = predict(plan.config, demand.with_rate(rate), SLO)
            result = evaluator.run(plan.config, rate)
            counted = result.arrival_s >= WARMUP_S
            has_steps = counted & (result.output_tokens > 1)
            measured_ttft = float(np.percentile(result.ttft_s[counted], SLO.percentile))
            measured_tpot = float(np.percentile(result.tpot_s[has_steps], SLO.percentile))
            measured_att = float(result.met_slo()[counted].mean())
            for name, pred, meas, unit in (
                    ("TTFT p90", predicted.ttft_s * 1000, measured_ttft * 1000, "ms"),
                    ("TPOT p90", predicted.tpot_s * 1000, measured_tpot * 1000, "ms"),
                    ("attainment", predicted.attainment * 100, measured_att * 100, "%")):
                error = (pred - meas) / meas
                check_rows.append([f"{rate:.2f}", name, f"{pred:.1f} {unit}",
                                   f"{meas:.1f} {unit}", f"{error:+.1%}"])
        print(f"\nplanner vs simulator, P{plan.config.num_prefill} D{plan.config.num_decode} "
              f"TP{tp_plan} (simulated {args.duration_s:g} s per run, first {WARMUP_S:g} s not "
              "counted)")
        print(table(["rate req/s", "metric", "predicted", "simulated", "error"], check_rows))

    def attainment_at(config: DisaggConfig, rate: float) -> float:
        return evaluator.attainment(config, rate) if evaluator is not None else predict(
            config, demand.with_rate(rate), SLO).attainment

    analytic_points = pl.sweep_pd(demand, SLO, shapes[tp_plan], shapes[tp_plan], num_gpus)
    sweep_points = []
    for point in analytic_points:
        if evaluator is None:
            sweep_points.append(point)
            continue
        rate = max_rate_near(lambda r, c=point.config: attainment_at(c, r),
                             max(point.goodput_rate_per_s, 0.5), SLO.attainment_target)
        sweep_points.append(pl.GoodputPoint(point.config, rate))
    best = max(sweep_points, key=lambda p: p.goodput_per_gpu)
    evaluated_by = "simulator" if evaluator is not None else "analytic model"
    print(f"\nP:D sweep of {num_gpus} GPUs (TP{tp_plan}), goodput by the {evaluated_by}")
    print(table(["P", "D", "P:D GPUs", "analytic goodput/GPU", f"{evaluated_by} goodput/GPU", ""], [
        [str(s.config.num_prefill), str(s.config.num_decode), f"{s.config.pd_ratio:.3f}",
         f"{a.goodput_per_gpu:.3f}", f"{s.goodput_per_gpu:.3f}",
         ("plan " if s.config.num_prefill == plan.config.num_prefill else "")
         + ("best" if s is best else "")] for a, s in zip(analytic_points, sweep_points,
                                                          strict=True)]))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    plot_path = OUT_DIR / "goodput_sweep.png"
    drawn = plot_sweep(sweep_points, {"planner": plan.config.pd_ratio,
                                      "best": best.config.pd_ratio}, plot_path,
                       f"{MODEL} on {GPU}, {num_gpus} GPUs (TP{tp_plan}), goodput by the "
                       f"{evaluated_by}")

    disagg = disagg_sim if disagg_sim is not None else plan.goodput_per_gpu
    colocated = best_co.goodput_per_gpu
    ratio_error = abs(plan.config.pd_ratio - best.config.pd_ratio) / best.config.pd_ratio
    co_label = (f"colocated TP{best_co.config.shape.tp_size} budget "
                f"{best_co.config.token_budget}, analytic")
    print("\nsummary")
    print(table(["", "goodput/GPU (req/s)", "vs colocated"], [
        [f"disaggregated, planner (TP{tp_plan}), {evaluated_by}", f"{disagg:.3f}",
         f"{disagg / colocated:.2f}x"],
        [f"disaggregated, planner (TP{tp_plan}), analytic", f"{plan.goodput_per_gpu:.3f}",
         f"{plan.goodput_per_gpu / colocated:.2f}x"],
        ["disaggregated, planner (mixed TP), analytic", f"{mixed.goodput_per_gpu:.3f}",
         f"{mixed.goodput_per_gpu / colocated:.2f}x"],
        [co_label, f"{colocated:.3f}", "1.00x"]]))
    print(f"P:D GPU ratio: planner {plan.config.pd_ratio:.3f}, best by sweep "
          f"{best.config.pd_ratio:.3f} ({ratio_error:.1%} apart)")
    print("\nsensitivity (analytic, mixed-TP planner vs best colocated on the same GPUs): "
          "goodput/GPU by TPOT bound, TTFT 1 s")
    sensitivity = []
    for tpot_ms in (35, 40, 50, 70, 100):
        slo = dataclasses.replace(SLO, tpot_s=tpot_ms / 1000)
        other = pl.plan(demand, slo, tuple(shapes.values()), tuple(shapes.values()))
        other_co, _ = co.best_colocated(demand, slo, tuple(shapes.values()),
                                        other.config.num_gpus)
        sensitivity.append([f"{tpot_ms}", f"{other.goodput_per_gpu:.3f}",
                            f"{other_co.goodput_per_gpu:.3f}",
                            f"{other.goodput_per_gpu / other_co.goodput_per_gpu:.2f}x"])
    print(table(["TPOT ms", "disaggregated", "colocated", "ratio"], sensitivity))
    wall = time.perf_counter() - started
    sim_note = (f", {evaluator.num_runs} simulator runs in {evaluator.wall_s:.0f} s"
                if evaluator is not None else "")
    print(f"plot: {plot_path if drawn else 'matplotlib missing, none'}; wall {wall:.0f} s"
          f"{sim_note}")
    summary = {
        "goodput_per_gpu_disagg": round(disagg, 4),
        "goodput_per_gpu_colocated": round(colocated, 4),
        "pd_ratio_planner": round(plan.config.pd_ratio, 4),
        "pd_ratio_best": round(best.config.pd_ratio, 4),
        "goodput_ratio": round(disagg / colocated, 3),
        "goodput_per_gpu_disagg_analytic": round(plan.goodput_per_gpu, 4),
        "goodput_per_gpu_disagg_mixed_tp_analytic": round(mixed.goodput_per_gpu, 4),
        "evaluated_by": evaluated_by,
        "slo_ttft_ms": SLO.ttft_s * 1000,
        "slo_tpot_ms": SLO.tpot_s * 1000,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
