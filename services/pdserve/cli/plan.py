"""``pdserve plan``: prefill and decode instance counts for a demand and an SLO.

Prints the cheapest configuration the planner finds (``pdserve.capacity.planner``), its
predicted TTFT/TPOT at the SLO percentile, the local-prefill threshold and its goodput per GPU;
then the goodput per GPU of every prefill:decode split of the same GPU budget, drawn as a PNG
when ``--out`` is given.

With ``--trace`` the planner sizes for the trace's own arrival process (its bursts, not only
its mean rate; ``--rate`` compresses or stretches its timestamps to that mean rate), then
replays the candidate through the simulator on the trace and grows it until the replay meets
the percentile (``pdserve.sim.plan_check``); the arrival model's prediction and the replayed
attainment are printed side by side, and the plot shows both for every candidate replayed.
``--json`` prints the plan as one JSON object instead of tables.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.cli.capacity_cmd import parse_int_list, table
from pdserve.common.errors import InvalidArgumentError
from pdserve.common.plotting import pyplot, save_figure

DEFAULT_TP_SIZES = "1,2,4,8"
REPLAY_BUDGET_S = 40.0
"""Seconds of replays after which ``--trace`` offers the last candidate (the command stays
within a minute)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="catalog model name, alias or hub id")
    parser.add_argument("--gpu", required=True, help="catalog GPU name or alias")
    parser.add_argument("--rate", type=float, default=None,
                        help="arrival rate, requests/s (default with --trace: the trace's rate)")
    lengths = parser.add_mutually_exclusive_group(required=True)
    lengths.add_argument("--prompt-mean", type=float, default=None,
                         help="mean prompt tokens (lengths taken as exponential)")
    lengths.add_argument("--trace", default=None, metavar="PATH",
                         help="prompt/output lengths (and prefix hits) from a trace: Azure CSV "
                              "or Mooncake JSONL")
    parser.add_argument("--output-mean", type=float, default=None,
                        help="mean output tokens (with --prompt-mean)")
    parser.add_argument("--prefix-hit-rate", type=float, default=None,
                        help="fraction of prompt tokens found in the prefix cache (default 0, "
                             "or measured from a Mooncake trace's block hashes)")
    parser.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT bound, ms")
    parser.add_argument("--slo-tpot-ms", type=float, required=True,
                        help="TPOT bound (mean time per output token after the first), ms")
    parser.add_argument("--percentile", type=float, default=90.0,
                        help="share of requests (%%) that must meet both bounds")
    parser.add_argument("--tp", default=None, metavar="N[,N...]",
                        help=f"TP sizes to consider for both pools (default {DEFAULT_TP_SIZES}, "
                             "those that fit)")
    parser.add_argument("--prefill-tp", default=None, metavar="N[,N...]",
                        help="TP sizes for the prefill pool (overrides --tp)")
    parser.add_argument("--decode-tp", default=None, metavar="N[,N...]",
                        help="TP sizes for the decode pool (overrides --tp)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size, tokens")
    parser.add_argument("--utilization", type=float, default=0.9,
                        help="GPU memory fraction the engine may use")
    parser.add_argument("--max-gpus", type=int, default=4096, help="largest plan considered")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write the sweep plot (plan_sweep.png; with --trace also "
                             "plan_replay.png) to this directory")
    parser.add_argument("--json", action="store_true",
                        help="print the plan as one JSON object (instances and TP per pool, "
                             "predicted and replayed attainment)")
    parser.add_argument("--no-replay", action="store_true",
                        help="with --trace: offer the arrival model's plan without replaying it")
    parser.add_argument("--max-replays", type=int, default=12,
                        help="with --trace: most candidates replayed before giving up")


def trace_at_rate(args: argparse.Namespace) -> Any:
    """The ``--trace`` at ``--rate`` (its timestamps compressed or stretched), or as is."""
    from pdserve.sim.plan_check import at_rate
    from pdserve.sim.traces import load_trace

    trace = load_trace(args.trace)
    if trace.num_requests < 2 or trace.mean_rate_per_s <= 0:
        raise InvalidArgumentError(
            f"trace {args.trace} needs at least two requests at different times", field="trace")
    if args.rate is not None:
        if not args.rate > 0:
            raise InvalidArgumentError(f"--rate must be > 0, got {args.rate}", field="rate")
        trace = at_rate(trace, args.rate)
    return trace


def demand_from_args(args: argparse.Namespace, trace: Any = None) -> Any:
    """The planner's demand: from ``trace`` (already at the rate) with its arrival pattern, or
    from the means (Poisson arrivals)."""
    from pdserve.capacity.plan_inputs import Demand

    if trace is not None:
        from pdserve.sim.plan_check import demand_from_trace

        return demand_from_trace(trace, prefix_hit_rate=args.prefix_hit_rate)
    if args.rate is None or args.output_mean is None:
        raise InvalidArgumentError("--prompt-mean needs --output-mean and --rate",
                                   field="output_mean")
    return Demand.from_means(args.rate, args.prompt_mean, args.output_mean,
                             prefix_hit_rate=args.prefix_hit_rate or 0.0)


def _shapes(args: argparse.Namespace, text: str | None) -> tuple[Any, ...]:
    from pdserve.capacity.plan_inputs import InstanceShape

    explicit = text or args.tp
    sizes = parse_int_list(explicit or DEFAULT_TP_SIZES, "tp")
    shapes = []
    first_error: InvalidArgumentError | None = None
    for tp in sizes:
        shape = InstanceShape(args.model, args.gpu, tp, block_size_tokens=args.block_size,
                              gpu_memory_utilization=args.utilization)
        try:
            shape.check()
        except InvalidArgumentError as exc:
            if explicit:  # sizes the user named must all work
                raise
            first_error = first_error or exc
            continue
        shapes.append(shape)
    if not shapes:
        assert first_error is not None
        raise first_error
    return tuple(shapes)


def plot_sweep(points: Sequence[Any], marked: dict[str, float], path: Path, title: str) -> bool:
    """Goodput per GPU vs prefill:decode GPU ratio; ``marked`` labels vertical lines at given
    ratios. Returns False (and draws nothing) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(7, 4.2))
    ratios = [p.config.pd_ratio for p in points]
    axis.plot(ratios, [p.goodput_per_gpu for p in points], "o-", label="sweep")
    labels_at: dict[float, list[str]] = {}
    for label, ratio in marked.items():
        labels_at.setdefault(round(ratio, 9), []).append(label)
    for (ratio, labels), style in zip(labels_at.items(), ("--", ":", "-."), strict=False):
        axis.axvline(ratio, linestyle=style, color="gray")
        axis.text(ratio, axis.get_ylim()[1], " " + " = ".join(labels), rotation=90, va="top",
                  fontsize=8)
    axis.set_xscale("log")
    axis.set_xlabel("prefill GPUs : decode GPUs")
    axis.set_ylabel("goodput per GPU (req/s at SLO attainment)")
    axis.set_title(title, fontsize=10)
    axis.grid(True, alpha=0.3)
    save_figure(figure, path)
    return True


def plot_replay(checked: Any, path: Path, title: str) -> bool:
    """The arrival model's prediction and the replayed attainment of every candidate replayed,
    against its GPUs, with the target. Returns False (and draws nothing) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    gpus_per = (checked.plan.config.prefill.tp_size, checked.plan.config.decode.tp_size)
    gpus = [s.num_prefill * gpus_per[0] + s.num_decode * gpus_per[1] for s in checked.steps]
    figure, axis = plt.subplots(figsize=(7, 4.2))
    axis.plot(gpus, [100 * s.predicted_attainment for s in checked.steps], "o--",
              label="arrival model")
    axis.plot(gpus, [100 * s.replayed_attainment for s in checked.steps], "s-",
              label="replayed on the trace")
    axis.axhline(100 * checked.target, color="gray", linestyle=":", label="target")
    for step, x in zip(checked.steps, gpus, strict=True):
        axis.annotate(f"{step.num_prefill}P+{step.num_decode}D",
                      (x, 100 * step.replayed_attainment), fontsize=8,
                      textcoords="offset points", xytext=(4, -10))
    axis.set_xlabel("GPUs")
    axis.set_ylabel("SLO attainment %")
    axis.set_title(title, fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def run(args: argparse.Namespace) -> int:
    import json

    from pdserve.capacity import planner as pl
    from pdserve.capacity.plan_inputs import Slo

    slo = Slo(args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0, args.percentile)
    trace = trace_at_rate(args) if args.trace else None
    demand = demand_from_args(args, trace)
    if demand.rate_per_s <= 0:
        raise InvalidArgumentError(f"--rate must be > 0, got {demand.rate_per_s}", field="rate")
    prefill_shapes = _shapes(args, args.prefill_tp)
    decode_shapes = _shapes(args, args.decode_tp)
    checked = None
    if trace is not None and not args.no_replay:
        from pdserve.sim.plan_check import check_plan

        checked = check_plan(demand, slo, prefill_shapes, decode_shapes, trace,
                             max_gpus=args.max_gpus, max_replays=args.max_replays,
                             time_budget_s=REPLAY_BUDGET_S)
        result = checked.plan
    else:
        result = pl.plan(demand, slo, prefill_shapes, decode_shapes, max_gpus=args.max_gpus)
    if args.json:
        from pdserve.sim.plan_check import plan_document

        print(json.dumps(plan_document(result, demand, slo, checked)))
        return 0
    _print_plan(args, result, demand, checked)
    config = result.config
    if checked is not None:
        print()
        print(f"replayed on {Path(args.trace).name} at {demand.rate_per_s:g} req/s (its own "
              f"timestamps, compressed or stretched): the arrival model's prediction beside the "
              f"simulator's replay, for each candidate")
        print(table(["prefill", "decode", "gpus", "predicted", "replayed", "misses P/D"], [
            [str(s.num_prefill), str(s.num_decode),
             str(s.num_prefill * config.prefill.tp_size + s.num_decode * config.decode.tp_size),
             f"{s.predicted_attainment:.1%}", f"{s.replayed_attainment:.1%}",
             f"{s.num_prefill_misses}/{s.num_decode_misses}"] for s in checked.steps]))
        verdict = "meets" if checked.is_met else "does NOT meet"
        print(f"offered plan: predicted {checked.predicted_attainment:.1%}, replayed "
              f"{checked.replayed_attainment:.1%}: {verdict} the {args.percentile:g}% target")
    # A trace's arrival model evaluates dozens of windows per rate: 2% is plenty for a sweep.
    points = pl.sweep_pd(demand, slo, config.prefill, config.decode, config.num_gpus,
                         relative_tolerance=2e-3 if demand.arrivals is None else 0.02)
    best = max(points, key=lambda q: q.goodput_per_gpu)
    print()
    print(f"sweep: every prefill:decode split of {config.num_gpus} GPUs (TP "
          f"{config.prefill.tp_size}/{config.decode.tp_size}), analytic model")
    print(table(["prefill", "decode", "P:D gpus", "goodput req/s", "per gpu", ""], [
        [str(q.config.num_prefill), str(q.config.num_decode), f"{q.config.pd_ratio:.3f}",
         f"{q.goodput_rate_per_s:.2f}", f"{q.goodput_per_gpu:.3f}",
         ("plan " if q.config.num_prefill == config.num_prefill else "")
         + ("best" if q is best else "")] for q in points]))
    if args.out:
        title = (f"{config.prefill.model} on {config.prefill.gpu}, {demand.rate_per_s:g} req/s, "
                 f"{config.num_gpus} GPUs")
        paths = [(Path(args.out) / "plan_sweep.png",
                  lambda path: plot_sweep(points, {"plan": config.pd_ratio}, path, title))]
        if checked is not None:
            paths.append((Path(args.out) / "plan_replay.png",
                          lambda path: plot_replay(checked, path, title)))
        for path, draw in paths:
            if draw(path):
                print(f"wrote {path}")
            else:
                print("matplotlib is not installed: no plot (pip install 'pdserve[plots]')")
                break
    return 0


def _print_plan(args: argparse.Namespace, result: Any, demand: Any, checked: Any) -> None:
    config, prediction = result.config, result.prediction
    arrivals = ("Poisson arrivals" if demand.arrivals is None
                else "the trace's arrival process")
    print(f"{config.prefill.model} on {config.prefill.gpu}: {demand.rate_per_s:g} req/s "
          f"({arrivals}), mean prompt {demand.mean_prompt_tokens:,.0f} / output "
          f"{demand.mean_output_tokens:,.0f} tokens, prefix hits {demand.prefix_hit_rate:.0%}; "
          f"SLO TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms for "
          f"{args.percentile:g}% of requests")
    print(table(["pool", "tp", "instances", "gpus"], [
        ["prefill", str(config.prefill.tp_size), str(config.num_prefill),
         str(config.num_prefill_gpus)],
        ["decode", str(config.decode.tp_size), str(config.num_decode),
         str(config.num_decode_gpus)],
        ["total", "", "", str(config.num_gpus)]]))
    p = f"p{args.percentile:g}"
    ms = 1000.0
    ttft = (f"{prediction.ttft_s * ms:.0f} ms (mean {prediction.mean_ttft_s * ms:.0f}, prefill "
            f"queue {prediction.mean_queue_wait_s * ms:.0f}, KV wait "
            f"{prediction.mean_kv_wait_s * ms:.0f})")
    tpot = f"{prediction.tpot_s * ms:.1f} ms (mean {prediction.mean_tpot_s * ms:.1f})"
    batch = f"{prediction.decode_batch_size:.1f} (KV slots {prediction.num_kv_slots})"
    local = (f"{config.local_prefill_threshold_tokens} uncached tokens "
             f"({prediction.local_prefill_fraction:.0%} of requests)")
    goodput = (f"{result.goodput_rate_per_s:.2f} req/s = {result.goodput_per_gpu:.3f} req/s "
               "per GPU")
    attainment = f"{prediction.attainment:.1%}"
    if checked is not None:
        attainment += f" (replayed: {checked.replayed_attainment:.1%})"
    print()
    print(table(["prediction", "value"], [
        [f"TTFT {p}", ttft], [f"TPOT {p}", tpot],
        ["SLO attainment", attainment],
        ["prefill utilisation", f"{prediction.prefill_utilization:.0%}"],
        ["decode batch / instance", batch], ["local-prefill threshold", local],
        ["P:D GPU ratio", f"{config.pd_ratio:.3f}"], ["goodput", goodput]], is_numeric=False))
