"""Goodput per GPU: the planner's disaggregated configuration vs the best colocated one, the
planner's P:D ratio vs a brute-force sweep, and the planner's predictions vs the simulator.

Demand: prompt/output pairs of the Azure LLM 2023 conversation trace (Splitwise, ISCA'24) with
Poisson arrivals at ``--rate`` req/s (the trace's own 5.5 req/s would need one instance per pool);
model Llama-3.1-70B on H100-SXM-80GB from the catalog, calibrated roofline.

SLOs (at 90% attainment, DistServe's goodput definition), a tight pair and a looser one:
- TPOT <= 40 ms: the "interactive" bound MLPerf Inference v5.0 sets for Llama-2-70B (25 tokens/s
  per user), tight for a 70B model on H100 (an unloaded TP4 step is ~29 ms here);
- TTFT <= 1 s: DistServe's chatbot SLOs give TTFT several times the prefill of a typical
  prompt (OPT-66B: 2.5 s) and far more slack than TPOT; 1 s is ~4x the prefill of a p90 prompt
  (2.7k tokens) at TP4, between MLPerf's interactive (0.45 s) and server (2 s) bounds;
- looser: TTFT <= 2 s (MLPerf's server bound) and TPOT <= 100 ms (10 tokens/s per user, a
  reading-speed stream).

Steps:
1. planner (analytic) per TP size with both pools at that TP, cheapest wins (the P:D sweep is of
   its shape); the mixed-TP plan (each pool its own TP) is simulated too;
2. planner's predicted p90 TTFT/TPOT and attainment vs the simulator on the same demand;
3. sweep of the P:D splits of the plan's GPUs, goodput of each by the simulator (bisection on
   the rate) where the analytic model puts it within ``SIM_SWEEP_FRACTION`` of the best split
   (the others cannot be best; analytic only), plot in bench/out/goodput_sweep.png;
4. best colocated configuration on the same GPU count, simulated: instances that prefill their
   own prompts in chunks inside their decode steps (``pdserve.sim`` with
   ``chunked_prefill_tokens``, the same engine model as the disaggregated pools), searched over
   TP x token budget (256-8,192) x batch cap. Branch and bound, best analytic guess first: a
   configuration is bisected only if it meets the SLO at the best goodput per GPU found so far
   (short runs, ``duration / 5``, at least 180 s); the winner is measured again at the full
   duration;
5. steps 1, 4 and the disaggregated goodput for the looser SLO pair;
6. sensitivity to the TPOT bound (analytic, both sides).

Analytic model if ``pdserve.sim`` is missing.

    python bench/goodput.py [--trace PATH] [--rate 30] [--duration-s 900] [--quick]

Last line: JSON with goodput_per_gpu_disagg (simulator-measured when available),
goodput_per_gpu_colocated (simulated, ``colocated_evaluated_by``), pd_ratio_planner,
pd_ratio_best and supporting figures (``goodput_per_gpu_disagg_mixed_tp``: the mixed-TP plan,
simulated); ``*_loose`` keys for the looser pair.
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
SLO_LOOSE = Slo(ttft_s=2.0, tpot_s=0.100, percentile=90.0)
TP_SIZES = (2, 4, 8)
TOKEN_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
BATCH_CAPS = (64, 128, 256)
WARMUP_S = 60.0
SIM_SWEEP_FRACTION = 0.6
"""P:D splits whose analytic goodput is below this fraction of the best split's are not
simulated."""


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
    """Attainment of a configuration (disaggregated or colocated) at a rate, measured by the
    simulator on Poisson arrivals with the demand's length pairs (requests arriving in the first
    ``WARMUP_S`` not counted). Runs are deterministic (seed 1), so attainments are memoised."""

    def __init__(self, prompts: np.ndarray, outputs: np.ndarray, duration_s: float) -> None:
        from pdserve.sim import ClusterSpec, SimConfig, SloSpec, simulate
        from pdserve.sim.config import colocated_cluster
        from pdserve.sim.traces import Trace, synthetic_trace

        self._classes = (ClusterSpec, SimConfig, SloSpec, simulate, colocated_cluster)
        self._sizes = Trace(np.zeros(len(prompts)), prompts, outputs)
        self._synthetic = synthetic_trace
        self.duration_s = duration_s
        self.num_runs = 0
        self.wall_s = 0.0
        self._memo: dict[tuple[object, float, float, Slo], float] = {}

    def run(self, config: DisaggConfig | co.ColocatedConfig, rate: float, slo: Slo = SLO,
            duration_s: float | None = None, seed: int = 1):
        from pdserve.router.policy import RoutingConfig

        cluster_cls, config_cls, slo_cls, simulate, colocated_cluster = self._classes
        duration_s = duration_s or self.duration_s
        trace = self._synthetic(int(rate * duration_s), rate, seed=seed, sizes=self._sizes)
        if isinstance(config, co.ColocatedConfig):
            shape = config.shape
            cluster = colocated_cluster(config.num_instances, config.token_budget, model=MODEL,
                                        gpu=GPU, tp_size=shape.tp_size,
                                        max_batch_size=shape.max_batch_size)
            routing = RoutingConfig()
        else:
            cluster = cluster_cls(config.num_prefill, config.num_decode, model=MODEL, gpu=GPU,
                                  tp_size=config.decode.tp_size,
                                  prefill_tp_size=config.prefill.tp_size, prefill_batch_tokens=1)
            routing = RoutingConfig(
                local_prefill_threshold_tokens=config.local_prefill_threshold_tokens)
        sim_config = config_cls(cluster=cluster, routing=routing,
                                slo=slo_cls(ttft_ms=slo.ttft_s * 1000, tpot_ms=slo.tpot_s * 1000))
        started = time.perf_counter()
        result = simulate(trace, sim_config)
        self.wall_s += time.perf_counter() - started
        self.num_runs += 1
        return result

    def attainment(self, config: DisaggConfig | co.ColocatedConfig, rate: float,
                   slo: Slo = SLO, duration_s: float | None = None) -> float:
        key = (config, round(rate, 6), duration_s or self.duration_s, slo)
        if key not in self._memo:
            result = self.run(config, rate, slo, duration_s)
            counted = result.arrival_s >= WARMUP_S
            self._memo[key] = float(result.met_slo()[counted].mean())
        return self._memo[key]


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


@dataclasses.dataclass(frozen=True, slots=True)
class ColocatedSearch:
    """The colocated search's outcome: the best configuration (goodput at the full duration),
    every configuration with its analytic goodput and its screened one (None: pruned, it
    missed the SLO at the best goodput per GPU found before it), and how it was evaluated."""

    best: pl.GoodputPoint[co.ColocatedConfig]
    rows: tuple[tuple[co.ColocatedConfig, float, float | None], ...]
    evaluated_by: str


def colocated_configs(shapes: dict[int, InstanceShape], num_gpus: int
                      ) -> list[co.ColocatedConfig]:
    """TP x batch cap x token budget on (at most) ``num_gpus`` GPUs."""
    configs = []
    for tp, shape in shapes.items():
        if num_gpus // tp < 1:
            continue
        for cap in BATCH_CAPS:
            capped = dataclasses.replace(shape, max_batch_size=cap)
            configs.extend(co.ColocatedConfig(capped, num_gpus // tp, budget)
                           for budget in TOKEN_BUDGETS)
    return configs


def search_colocated(evaluator: SimEvaluator | None, demand: Demand, slo: Slo,
                     shapes: dict[int, InstanceShape], num_gpus: int) -> ColocatedSearch:
    """Best colocated configuration on ``num_gpus`` GPUs by the simulator (branch and bound,
    see the module docstring), or by the analytic model without one."""
    configs = colocated_configs(shapes, num_gpus)
    analytic = {c: co.goodput_rate_per_s(c, demand, slo) for c in configs}
    order = sorted(configs, key=lambda c: -analytic[c] / c.num_gpus)
    if evaluator is None:
        best = order[0]
        rows = tuple((c, analytic[c], analytic[c]) for c in order)
        return ColocatedSearch(pl.GoodputPoint(best, analytic[best]), rows, "analytic model")
    target = slo.attainment_target
    screen_s = max(3 * WARMUP_S, evaluator.duration_s / 5)
    best_per_gpu = 0.0
    screened: dict[co.ColocatedConfig, float | None] = {}
    for config in order:
        def attainment_at(rate: float, c: co.ColocatedConfig = config) -> float:
            return evaluator.attainment(c, rate, slo, screen_s)

        floor = best_per_gpu * config.num_gpus
        if floor > 0 and attainment_at(floor) < target:
            screened[config] = None
            continue
        rate = max_rate_near(attainment_at, max(floor * 1.1, analytic[config], 0.5), target,
                             tolerance=0.03)
        screened[config] = rate
        best_per_gpu = max(best_per_gpu, rate / config.num_gpus)
    winner = max((c for c in order if screened[c] is not None),
                 key=lambda c: (screened[c] or 0.0) / c.num_gpus)
    rate = max_rate_near(lambda r: evaluator.attainment(winner, r, slo),
                         screened[winner] or 0.5, target)
    rows = tuple((c, analytic[c], screened[c]) for c in order)
    return ColocatedSearch(pl.GoodputPoint(winner, rate), rows, "simulator")


def colocated_label(config: co.ColocatedConfig) -> str:
    return (f"TP{config.shape.tp_size} x{config.num_instances}, budget {config.token_budget}, "
            f"batch <= {config.shape.max_batch_size}")


def print_colocated(search: ColocatedSearch, num_gpus: int, slo: Slo) -> None:
    num_simulated = sum(1 for _, _, rate in search.rows if rate is not None)
    print(f"\ncolocated, chunked prefill, {num_gpus} GPUs, SLO TTFT {slo.ttft_s * 1000:.0f} ms / "
          f"TPOT {slo.tpot_s * 1000:.0f} ms: {len(search.rows)} configurations, "
          f"{num_simulated} bisected by the {search.evaluated_by}, the rest pruned; best 6 by "
          "the screening runs")
    ranked = sorted(search.rows, key=lambda r: -(r[2] if r[2] is not None else -1.0)
                    / r[0].num_gpus)
    print(table(["TP", "instances", "token budget", "batch cap", "analytic goodput/GPU",
                 f"{search.evaluated_by} goodput/GPU (screen)"], [
        [str(c.shape.tp_size), str(c.num_instances), str(c.token_budget),
         str(c.shape.max_batch_size), f"{a / c.num_gpus:.3f}",
         f"{r / c.num_gpus:.3f}" if r is not None else "pruned"] for c, a, r in ranked[:6]]))
    print(f"best: {colocated_label(search.best.config)}: "
          f"{search.best.goodput_per_gpu:.3f} req/s per GPU at the full duration")


def cheapest_plan(demand: Demand, slo: Slo, shapes: dict[int, InstanceShape]
                  ) -> tuple[int, dict[int, pl.Plan]]:
    """The planner per TP size with both pools at that TP; the TP of the cheapest plan and
    every plan."""
    plans = {tp: pl.plan(demand, slo, (s,), (s,)) for tp, s in shapes.items()}
    tp_plan = min(plans, key=lambda tp: (plans[tp].config.num_gpus, -plans[tp].goodput_per_gpu))
    return tp_plan, plans


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
          f"{SLO.percentile:g}% of requests; looser pair TTFT <= {SLO_LOOSE.ttft_s * 1000:.0f} "
          f"ms and TPOT <= {SLO_LOOSE.tpot_s * 1000:.0f} ms")

    # 1. Plans.
    shapes = {tp: InstanceShape(MODEL, GPU, tp) for tp in TP_SIZES}
    tp_plan, plans = cheapest_plan(demand, SLO, shapes)
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
    num_gpus = plan.config.num_gpus

    # 2. Planner vs simulator, 3. sweep.
    try:
        evaluator: SimEvaluator | None = SimEvaluator(prompts, outputs, args.duration_s)
    except ImportError:
        evaluator = None
        print("\nNOTE: pdserve.sim is not importable: the sweep uses the analytic model")
    check_rows = []
    disagg_sim = mixed_sim = None
    if evaluator is not None:
        rate_sim = max_rate_near(lambda r: evaluator.attainment(plan.config, r),
                                 plan.goodput_rate_per_s, SLO.attainment_target)
        disagg_sim = rate_sim / num_gpus
        mixed_sim = max_rate_near(lambda r: evaluator.attainment(mixed.config, r),
                                  mixed.goodput_rate_per_s,
                                  SLO.attainment_target) / mixed.config.num_gpus
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

    analytic_points = pl.sweep_pd(demand, SLO, shapes[tp_plan], shapes[tp_plan], num_gpus)
    best_analytic = max(p.goodput_per_gpu for p in analytic_points)
    sweep_points = []
    for point in analytic_points:
        if evaluator is None or point.goodput_per_gpu < SIM_SWEEP_FRACTION * best_analytic:
            sweep_points.append(point)
            continue
        rate = max_rate_near(lambda r, c=point.config: evaluator.attainment(c, r),
                             max(point.goodput_rate_per_s, 0.5), SLO.attainment_target)
        sweep_points.append(pl.GoodputPoint(point.config, rate))
    simulated = [p is not a for p, a in zip(sweep_points, analytic_points, strict=True)]
    best = max((p for p, is_sim in zip(sweep_points, simulated, strict=True)
                if is_sim or evaluator is None), key=lambda p: p.goodput_per_gpu)
    evaluated_by = "simulator" if evaluator is not None else "analytic model"
    print(f"\nP:D sweep of {num_gpus} GPUs (TP{tp_plan}), goodput by the {evaluated_by} where "
          f"the analytic goodput is within {SIM_SWEEP_FRACTION:.0%} of the best split's")
    print(table(["P", "D", "P:D GPUs", "analytic goodput/GPU", f"{evaluated_by} goodput/GPU", ""], [
        [str(s.config.num_prefill), str(s.config.num_decode), f"{s.config.pd_ratio:.3f}",
         f"{a.goodput_per_gpu:.3f}", f"{s.goodput_per_gpu:.3f}" if is_sim else "-",
         ("plan " if s.config.num_prefill == plan.config.num_prefill else "")
         + ("best" if s is best else "")] for a, s, is_sim in zip(
             analytic_points, sweep_points, simulated, strict=True)]))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    plot_path = OUT_DIR / "goodput_sweep.png"
    drawn = plot_sweep(sweep_points, {"planner": plan.config.pd_ratio,
                                      "best": best.config.pd_ratio}, plot_path,
                       f"{MODEL} on {GPU}, {num_gpus} GPUs (TP{tp_plan}), goodput by the "
                       f"{evaluated_by}")

    # 4. Colocated on the same number of GPUs, simulated.
    best_co_analytic, _ = co.best_colocated(demand, SLO, tuple(shapes.values()), num_gpus,
                                            TOKEN_BUDGETS)
    search = search_colocated(evaluator, demand, SLO, shapes, num_gpus)
    print_colocated(search, num_gpus, SLO)

    # 5. The looser pair.
    tp_loose, plans_loose = cheapest_plan(demand, SLO_LOOSE, shapes)
    plan_loose = plans_loose[tp_loose]
    gpus_loose = plan_loose.config.num_gpus
    disagg_loose = plan_loose.goodput_per_gpu
    if evaluator is not None:
        disagg_loose = max_rate_near(
            lambda r: evaluator.attainment(plan_loose.config, r, SLO_LOOSE),
            plan_loose.goodput_rate_per_s, SLO_LOOSE.attainment_target) / gpus_loose
    search_loose = search_colocated(evaluator, demand, SLO_LOOSE, shapes, gpus_loose)
    print(f"\nlooser SLO: planner TP{tp_loose}/TP{tp_loose} P{plan_loose.config.num_prefill} "
          f"D{plan_loose.config.num_decode} ({gpus_loose} GPUs), analytic "
          f"{plan_loose.goodput_per_gpu:.3f}, {evaluated_by} {disagg_loose:.3f} req/s per GPU")
    print_colocated(search_loose, gpus_loose, SLO_LOOSE)

    disagg = disagg_sim if disagg_sim is not None else plan.goodput_per_gpu
    colocated = search.best.goodput_per_gpu
    colocated_loose = search_loose.best.goodput_per_gpu
    ratio_error = abs(plan.config.pd_ratio - best.config.pd_ratio) / best.config.pd_ratio
    print("\nsummary")
    print(table(["SLO", "", "goodput/GPU (req/s)", "vs colocated"], [
        ["tight", f"disaggregated, planner (TP{tp_plan}), {evaluated_by}", f"{disagg:.3f}",
         f"{disagg / colocated:.2f}x"],
        ["tight", f"disaggregated, planner (TP{tp_plan}), analytic",
         f"{plan.goodput_per_gpu:.3f}", f"{plan.goodput_per_gpu / colocated:.2f}x"],
        ["tight", f"disaggregated, planner ({mixed_label}), analytic",
         f"{mixed.goodput_per_gpu:.3f}", f"{mixed.goodput_per_gpu / colocated:.2f}x"],
        *([["tight", f"disaggregated, planner ({mixed_label}), simulator", f"{mixed_sim:.3f}",
            f"{mixed_sim / colocated:.2f}x"]] if mixed_sim is not None else []),
        ["tight", f"colocated {colocated_label(search.best.config)}, {search.evaluated_by}",
         f"{colocated:.3f}", "1.00x"],
        ["tight", f"colocated TP{best_co_analytic.config.shape.tp_size} budget "
                  f"{best_co_analytic.config.token_budget}, analytic",
         f"{best_co_analytic.goodput_per_gpu:.3f}",
         f"{best_co_analytic.goodput_per_gpu / colocated:.2f}x"],
        ["loose", f"disaggregated, planner (TP{tp_loose}), {evaluated_by}",
         f"{disagg_loose:.3f}", f"{disagg_loose / colocated_loose:.2f}x"],
        ["loose", f"colocated {colocated_label(search_loose.best.config)}, "
                  f"{search_loose.evaluated_by}", f"{colocated_loose:.3f}", "1.00x"]]))
    verdict = "meets" if disagg / colocated >= 2.0 else "does NOT meet"
    print(f"disaggregated vs best colocated at the tight pair: {disagg / colocated:.2f}x, "
          f"{verdict} the 2x goal")
    print(f"P:D GPU ratio: planner {plan.config.pd_ratio:.3f}, best by sweep "
          f"{best.config.pd_ratio:.3f} ({ratio_error:.1%} apart)")
    print("\nsensitivity (analytic, mixed-TP planner vs best colocated on the same GPUs): "
          "goodput/GPU by TPOT bound, TTFT 1 s")
    sensitivity = []
    for tpot_ms in (35, 40, 50, 70, 100):
        slo = dataclasses.replace(SLO, tpot_s=tpot_ms / 1000)
        other = pl.plan(demand, slo, tuple(shapes.values()), tuple(shapes.values()))
        other_co, _ = co.best_colocated(demand, slo, tuple(shapes.values()),
                                        other.config.num_gpus, TOKEN_BUDGETS)
        sensitivity.append([f"{tpot_ms}", f"{other.goodput_per_gpu:.3f}",
                            f"{other_co.goodput_per_gpu:.3f}",
                            f"{other.goodput_per_gpu / other_co.goodput_per_gpu:.2f}x"])
    print(table(["TPOT ms", "disaggregated", "colocated", "ratio"], sensitivity))
    wall = time.perf_counter() - started
    sim_note = (f", {evaluator.num_runs} simulator runs in {evaluator.wall_s:.0f} s"
                if evaluator is not None else "")
    print(f"plot: {plot_path if drawn else 'matplotlib missing, none'}; wall {wall:.0f} s"
          f"{sim_note}")
    best_co = search.best.config
    summary = {
        "goodput_per_gpu_disagg": round(disagg, 4),
        "goodput_per_gpu_colocated": round(colocated, 4),
        "pd_ratio_planner": round(plan.config.pd_ratio, 4),
        "pd_ratio_best": round(best.config.pd_ratio, 4),
        "goodput_ratio": round(disagg / colocated, 3),
        "goodput_per_gpu_disagg_analytic": round(plan.goodput_per_gpu, 4),
        "goodput_per_gpu_disagg_mixed_tp_analytic": round(mixed.goodput_per_gpu, 4),
        "goodput_per_gpu_disagg_mixed_tp": round(
            mixed_sim if mixed_sim is not None else mixed.goodput_per_gpu, 4),
        "goodput_ratio_mixed_tp": round(
            (mixed_sim if mixed_sim is not None else mixed.goodput_per_gpu) / colocated, 3),
        "mixed_tp_plan": mixed_label,
        "evaluated_by": evaluated_by,
        "colocated_evaluated_by": search.evaluated_by,
        "goodput_per_gpu_colocated_analytic": round(best_co_analytic.goodput_per_gpu, 4),
        "colocated_tp": best_co.shape.tp_size,
        "colocated_token_budget": best_co.token_budget,
        "colocated_max_batch_size": best_co.shape.max_batch_size,
        "slo_ttft_ms": SLO.ttft_s * 1000,
        "slo_tpot_ms": SLO.tpot_s * 1000,
        "goodput_per_gpu_disagg_loose": round(disagg_loose, 4),
        "goodput_per_gpu_colocated_loose": round(colocated_loose, 4),
        "goodput_ratio_loose": round(disagg_loose / colocated_loose, 3),
        "slo_loose_ttft_ms": SLO_LOOSE.ttft_s * 1000,
        "slo_loose_tpot_ms": SLO_LOOSE.tpot_s * 1000,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
