"""``pdserve capacity``: KV-cache capacity of one model on one GPU type, per TP size, as a table.

For each TP size: KV bytes per token on each GPU, weights and KV pool per GPU, blocks and tokens
per instance, and how many requests fit at once for each length in ``--lengths`` (every request
that long) and for the length mix of ``--trace`` (prompt + output of each row).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pdserve.common.errors import InvalidArgumentError

GIB = 1 << 30


def parse_int_list(text: str, name: str) -> tuple[int, ...]:
    """``"2,4,8"`` -> ``(2, 4, 8)``; raises ``InvalidArgumentError`` naming ``name``."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise InvalidArgumentError(f"{name}: {part!r} is not an integer", field=name) from None
        if value < 1:
            raise InvalidArgumentError(f"{name}: {value} must be >= 1", field=name)
        values.append(value)
    if not values:
        raise InvalidArgumentError(f"{name}: no value given", field=name)
    return tuple(values)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *,
          is_numeric: bool = True) -> str:
    """Plain-text table: left-aligned first column; the others right-aligned (numbers) or,
    with ``is_numeric`` False, left-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 or not is_numeric else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths),
                      *(line(r) for r in rows)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="catalog model name, alias or hub id")
    parser.add_argument("--gpu", required=True, help="catalog GPU name or alias")
    parser.add_argument("--tp", action="append", required=True, metavar="N[,N...]",
                        help="tensor-parallel size(s); repeat or comma-separate for several rows")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--utilization", type=float, default=0.9,
                        help="fraction of GPU memory the engine may use (vLLM's "
                             "gpu_memory_utilization)")
    lengths = parser.add_mutually_exclusive_group()
    lengths.add_argument("--lengths", default="1000,8192", metavar="N[,N...]",
                         help="request lengths (prompt + output tokens) to report concurrency for")
    lengths.add_argument("--trace", default=None, metavar="PATH",
                         help="report concurrency for this trace's length mix (Azure CSV or "
                              "Mooncake JSONL)")


def run(args: argparse.Namespace) -> int:
    from pdserve.perf.catalog import get_gpu, get_model
    from pdserve.perf.kv_budget import CapacityConfig, capacity_report

    model = get_model(args.model)
    gpu = get_gpu(args.gpu)
    tp_sizes = tuple(dict.fromkeys(v for text in args.tp for v in parse_int_list(text, "tp")))
    mix: list[int] | None = None
    lengths: tuple[int, ...] = ()
    if args.trace:
        from pdserve.sim.traces import load_trace

        trace = load_trace(args.trace)
        if trace.num_requests == 0:
            raise InvalidArgumentError(f"trace {args.trace} has no requests", field="trace")
        mix = [int(p + o) for p, o in zip(trace.prompt_tokens, trace.output_tokens, strict=True)]
    else:
        lengths = parse_int_list(args.lengths, "lengths")
    reports = [capacity_report(model, gpu, CapacityConfig(
        tp_size=tp, block_size_tokens=args.block_size, gpu_memory_utilization=args.utilization))
        for tp in tp_sizes]
    headers = ["tp", "kv_bytes/token/gpu", "weights_gib/gpu", "kv_pool_gib/gpu", "blocks",
               "tokens", f"conc@{reports[0].max_model_len}"]
    headers += [f"conc@{n}" for n in lengths]
    if mix is not None:
        headers.append("conc@trace_mix")
    rows = []
    for report in reports:
        row = [str(report.tp_size), f"{report.kv_bytes_per_token:,}",
               f"{report.weights_bytes_per_gpu / GIB:.2f}", f"{report.kv_pool_bytes / GIB:.2f}",
               f"{report.num_blocks:,}", f"{report.num_tokens:,}",
               f"{report.max_concurrency:.2f}"]
        row += [f"{report.num_requests_for_lengths([n]):,}" for n in lengths]
        if mix is not None:
            row.append(f"{report.num_requests_for_lengths(mix):,}")
        rows.append(row)
    print(f"{model.name} on {gpu.name}, block {args.block_size} tokens, utilisation "
          f"{args.utilization:g}; bytes and GiB per GPU, blocks/tokens/concurrency per instance")
    if mix is not None:
        print(f"trace {args.trace}: {len(mix):,} requests, mean prompt + output "
              f"{sum(mix) / len(mix):,.0f} tokens")
    print(table(headers, rows))
    return 0
