"""``pdserve simulate``: replay a trace through a simulated cluster running the live policies.

Prints TTFT/TPOT percentiles, SLO attainment with the count of misses per reason and GPU-hours;
writes ``summary.json`` and ``timeline.png`` (demand, instances, attainment over time) to
``--out``. Progress goes to stderr on long runs. ``--autoscale`` runs the governor's autoscaler
(``pdserve.sim.autoscale``) inside the simulation, new instances serving after
``--cold-start-s``, and reports its scale-ups and GPU-hours.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.sim.result import SimResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", required=True, help="trace file (Azure 2023 CSV or Mooncake JSONL)"
    )
    parser.add_argument("--format", choices=("azure", "mooncake"), default=None,
                        help="trace format (default: by suffix, .jsonl = mooncake)")
    parser.add_argument("--model", default="llama-3.1-70b", help="catalog model")
    parser.add_argument("--gpu", default="h100-sxm-80gb", help="catalog GPU")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel GPUs per instance")
    parser.add_argument("--prefill-tp", type=int, default=None,
                        help="tensor-parallel GPUs per prefill instance (default: --tp)")
    parser.add_argument("--num-prefill", type=int, default=None, help="prefill instances")
    parser.add_argument("--num-decode", type=int, default=None, help="decode instances")
    parser.add_argument("--num-instances", type=int, default=16,
                        help="without --num-prefill/--num-decode: split this many by a balance "
                             "of the trace's prefill and decode work")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply arrival times (0.5 = twice the rate, same requests)")
    parser.add_argument("--rate", type=float, default=None,
                        help="compress or stretch the trace's own timestamps to this mean rate, "
                             "req/s (its bursts keep their shape; as pdserve plan --rate does)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="multiply the arrival rate (thinning below 1, jittered copies "
                             "above: smooths the trace's bursts away; --rate keeps them)")
    parser.add_argument("--jitter-s", type=float, default=60.0,
                        help="time jitter of replayed copies for --rate-scale > 1")
    parser.add_argument("--seed", type=int, default=0, help="seed for rate scaling")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="replay only the first this many seconds (after scaling)")
    parser.add_argument("--max-requests", type=int, default=0, help="read at most this many rows")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--fail-at", action="append", default=[], metavar="T:INSTANCE",
                        help="fail instance (p0, d3, ...) at simulated second T; repeatable")
    parser.add_argument("--local-prefill-threshold", type=int, default=None,
                        help="uncached prompt tokens at or below which decode prefills itself")
    parser.add_argument("--max-batch-size", type=int, default=256, help="decode batch slots")
    parser.add_argument("--prefill-batch-tokens", type=int, default=8192,
                        help="token budget of one prefill batch")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--max-queued", type=int, default=4096,
                        help="router admission queue bound; beyond it requests are rejected")
    parser.add_argument("--autoscale", action="store_true",
                        help="run the live autoscaler (the governor's policy) every "
                             "--scaling-interval-s; the pools above are the starting ones")
    parser.add_argument("--cold-start-s", type=float, default=600.0,
                        help="with --autoscale: seconds from launching an instance to serving")
    parser.add_argument("--scaling-interval-s", type=float, default=60.0,
                        help="with --autoscale: seconds between scaling decisions")
    parser.add_argument(
        "--out", default="sim-out", help="directory for summary.json and timeline.png"
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write timeline.png")


class _Progress:
    """Prints to stderr at most every ``every_s`` wall seconds, and only after the first."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.started = time.perf_counter()
        self.last = self.started
        self.every_s = every_s

    def __call__(self, num_arrived: int, num_requests: int, sim_s: float) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s:
            return
        self.last = now
        print(f"  simulated {num_arrived:,}/{num_requests:,} requests "
              f"({num_arrived / max(1, num_requests):.0%}), {sim_s:,.0f} simulated s, "
              f"{now - self.started:,.0f} s wall", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pdserve.router.policy import RoutingConfig
    from pdserve.sim import ClusterSpec, Failure, SimConfig, SloSpec, simulate
    from pdserve.sim.autoscale import autoscaler_for
    from pdserve.sim.engine_model import balance_pools, instance_model
    from pdserve.sim.plots import PlotUnavailableError, plot_timeline
    from pdserve.sim.report import format_summary, summarize
    from pdserve.sim.traces import load_trace, rate_scale, time_scale

    trace = load_trace(args.trace, args.format or "", max_requests=args.max_requests)
    if args.time_scale != 1.0:
        trace = time_scale(trace, args.time_scale)
    if args.rate is not None:
        from pdserve.sim.plan_check import at_rate

        trace = at_rate(trace, args.rate)
    if args.rate_scale != 1.0:
        trace = rate_scale(trace, args.rate_scale, seed=args.seed, jitter_s=args.jitter_s)
    if args.duration_s is not None:
        trace = trace.window(0.0, args.duration_s)
    if trace.num_requests == 0:
        print("pdserve simulate: the trace has no requests", file=sys.stderr)
        return 2
    instance = instance_model(args.model, args.gpu, args.tp, block_size_tokens=args.block_size)
    num_prefill, num_decode = args.num_prefill, args.num_decode
    split_note = ""
    if num_prefill is None or num_decode is None:
        split = balance_pools(trace.prompt_tokens, trace.output_tokens, instance,
                              args.num_instances, max_batch_size=args.max_batch_size)
        num_prefill = split.num_prefill if num_prefill is None else num_prefill
        num_decode = split.num_decode if num_decode is None else num_decode
        split_note = (f" (split of {args.num_instances} by prefill vs decode work; "
                      f"~{split.rate_per_s / 0.7:,.1f} req/s saturates the busier pool)")
    routing = RoutingConfig() if args.local_prefill_threshold is None else RoutingConfig(
        local_prefill_threshold_tokens=args.local_prefill_threshold)
    config = SimConfig(
        ClusterSpec(num_prefill, num_decode, model=args.model, gpu=args.gpu, tp_size=args.tp,
                    block_size_tokens=args.block_size, max_batch_size=args.max_batch_size,
                    prefill_batch_tokens=args.prefill_batch_tokens,
                    prefill_tp_size=args.prefill_tp or 0),
        routing=routing, slo=SloSpec(args.slo_ttft_ms, args.slo_tpot_ms),
        max_queued_requests=args.max_queued,
        failures=tuple(Failure.parse(text) for text in args.fail_at),
        cold_start_s=args.cold_start_s, scaling_interval_s=args.scaling_interval_s,
    )
    policy = autoscaler_for(config.cluster, args.slo_tpot_ms / 1000) if args.autoscale else None
    prefill_tp = config.cluster.prefill_tp
    tp_note = (f"TP{args.tp}" if prefill_tp == args.tp
               else f"prefill TP{prefill_tp}, decode TP{args.tp}")
    print(f"cluster: {num_prefill} prefill + {num_decode} decode x {args.model} {tp_note} on "
          f"{args.gpu} = {num_prefill * prefill_tp + num_decode * args.tp} GPUs{split_note}")
    print(f"trace: {Path(args.trace).name}: {trace.num_requests:,} requests over "
          f"{trace.duration_s:,.0f} s ({trace.mean_rate_per_s:,.2f} req/s; time x"
          f"{args.time_scale:g}, rate x{args.rate_scale:g}); mean prompt "
          f"{trace.prompt_tokens.mean():,.0f}, output {trace.output_tokens.mean():,.0f} tokens")
    sys.stdout.flush()
    result = simulate(trace, config, policy, instance=instance, progress=_Progress())
    summary = summarize(result)
    print()
    print(format_summary(summary))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = summary.as_dict()
    document.update(trace=str(args.trace), num_prefill=num_prefill, num_decode=num_decode,
                    ticket_transitions={f"{a}->{b}": n
                                        for (a, b), n in result.ticket_transitions.items()},
                    utilisation=result.extra)
    if args.autoscale:
        document["autoscale"] = _autoscale_report(result, num_prefill, num_decode)
    (out / "summary.json").write_text(json.dumps(document, indent=2) + "\n")
    written = [out / "summary.json"]
    if not args.no_plot:
        try:
            written.append(plot_timeline(result, out / "timeline.png",
                                         title=f"{Path(args.trace).name}: {num_prefill}P + "
                                               f"{num_decode}D x {args.model} TP{args.tp}"))
        except PlotUnavailableError as exc:
            print(f"no plot: {exc.message}", file=sys.stderr)
    print()
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _autoscale_report(result: SimResult, num_prefill: int, num_decode: int) -> dict[str, object]:
    """Prints what the autoscaler did and returns it for summary.json: its scale-ups, peak
    pools, and GPU-hours against the starting pools held for the whole run."""
    from pdserve.sim.autoscale import scale_ups

    ups = scale_ups(result)
    peak_prefill = max([num_prefill, *(r.num_prefill for r in result.scaling)])
    peak_decode = max([num_decode, *(r.num_decode for r in result.scaling)])
    cluster = result.config.cluster
    static_gpu_hours = ((num_prefill * cluster.prefill_tp + num_decode * cluster.tp_size)
                        * result.end_s / 3600)
    first = f"first at {ups[0].time_s:,.0f} s" if ups else "none"
    print(f"\nautoscaler (live policy, cold start {result.config.cold_start_s:g} s, every "
          f"{result.config.scaling_interval_s:g} s): {len(result.scaling)} decisions, "
          f"{len(ups)} scale-ups ({first}); peak {peak_prefill}P + {peak_decode}D; "
          f"GPU-hours {result.gpu_hours:,.2f} (the starting pools held throughout: "
          f"{static_gpu_hours:,.2f})")
    return {
        "cold_start_s": result.config.cold_start_s,
        "scaling_interval_s": result.config.scaling_interval_s,
        "num_decisions": len(result.scaling),
        "scale_ups": [{"time_s": u.time_s, "num_prefill": u.num_prefill,
                       "num_decode": u.num_decode} for u in ups],
        "peak_prefill": peak_prefill,
        "peak_decode": peak_decode,
        "gpu_hours": result.gpu_hours,
        "gpu_hours_starting_pools": static_gpu_hours,
        "mean_prompt_tokens": float(result.prompt_tokens.mean()),
        "mean_output_tokens": float(result.output_tokens.mean()),
    }
