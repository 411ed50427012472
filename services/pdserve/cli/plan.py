"""``pdserve plan``: prefill and decode instance counts for a demand and an SLO.

Prints the cheapest configuration the planner finds (``pdserve.capacity.planner``), its
predicted TTFT/TPOT at the SLO percentile, the local-prefill threshold and its goodput per GPU;
then the goodput per GPU of every prefill:decode split of the same GPU budget, drawn as a PNG
when ``--out`` is given.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.cli.capacity_cmd import parse_int_list, table
from pdserve.common.errors import InvalidArgumentError
from pdserve.common.plotting import pyplot

DEFAULT_TP_SIZES = "1,2,4,8"


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
                        help="write the sweep plot (plan_sweep.png) to this directory")


def trace_prefix_hit_rate(trace: Any) -> float:
    """Fraction of prompt tokens an unbounded prefix cache would hold, from a trace's prefix
    block ids (Mooncake): a request's leading blocks whose ids an earlier request carried."""
    if not trace.has_prefix_hashes:
        return 0.0
    seen: set[int] = set()
    hit_tokens = 0
    total = int(trace.prompt_tokens.sum())
    for index in range(trace.num_requests):
        row = int(trace.hash_row[index])
        if row < 0:
            continue
        ids = trace.hash_ids[trace.hash_offsets[row]:trace.hash_offsets[row + 1]].tolist()
        prompt = int(trace.prompt_tokens[index])
        leading = 0
        for block_id in ids:
            if block_id not in seen:
                break
            leading += 1
        seen.update(ids)
        hit_tokens += min(leading * trace.hash_block_tokens, prompt - 1)
    return hit_tokens / total if total else 0.0


def demand_from_args(args: argparse.Namespace) -> Any:
    from pdserve.capacity.plan_inputs import Demand

    if args.trace:
        from pdserve.sim.traces import load_trace

        trace = load_trace(args.trace)
        if trace.num_requests == 0:
            raise InvalidArgumentError(f"trace {args.trace} has no requests", field="trace")
        rate = args.rate if args.rate is not None else trace.mean_rate_per_s
        hit = (args.prefix_hit_rate if args.prefix_hit_rate is not None
               else trace_prefix_hit_rate(trace))
        return Demand(rate, tuple(trace.prompt_tokens.tolist()),
                      tuple(trace.output_tokens.tolist()), prefix_hit_rate=hit)
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
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def run(args: argparse.Namespace) -> int:
    from pdserve.capacity import planner as pl
    from pdserve.capacity.plan_inputs import Slo

    slo = Slo(args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0, args.percentile)
    demand = demand_from_args(args)
    if demand.rate_per_s <= 0:
        raise InvalidArgumentError(f"--rate must be > 0, got {demand.rate_per_s}", field="rate")
    prefill_shapes = _shapes(args, args.prefill_tp)
    decode_shapes = _shapes(args, args.decode_tp)
    result = pl.plan(demand, slo, prefill_shapes, decode_shapes, max_gpus=args.max_gpus)
    config, prediction = result.config, result.prediction
    print(f"{config.prefill.model} on {config.prefill.gpu}: {demand.rate_per_s:g} req/s, mean "
          f"prompt {demand.mean_prompt_tokens:,.0f} / output {demand.mean_output_tokens:,.0f} "
          f"tokens, prefix hits {demand.prefix_hit_rate:.0%}; SLO TTFT <= {args.slo_ttft_ms:g} "
          f"ms and TPOT <= {args.slo_tpot_ms:g} ms for {args.percentile:g}% of requests")
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
    print()
    print(table(["prediction", "value"], [
        [f"TTFT {p}", ttft], [f"TPOT {p}", tpot],
        ["SLO attainment", f"{prediction.attainment:.1%}"],
        ["prefill utilisation", f"{prediction.prefill_utilization:.0%}"],
        ["decode batch / instance", batch], ["local-prefill threshold", local],
        ["P:D GPU ratio", f"{config.pd_ratio:.3f}"], ["goodput", goodput]], is_numeric=False))
    points = pl.sweep_pd(demand, slo, config.prefill, config.decode, config.num_gpus)
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
        path = Path(args.out) / "plan_sweep.png"
        title = (f"{config.prefill.model} on {config.prefill.gpu}, {demand.rate_per_s:g} req/s, "
                 f"{config.num_gpus} GPUs")
        if plot_sweep(points, {"plan": config.pd_ratio}, path, title):
            print(f"wrote {path}")
        else:
            print("matplotlib is not installed: no plot (pip install 'pdserve[plots]')")
    return 0
