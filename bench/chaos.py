"""Chaos: the whole stack as real processes under steady open-loop load, with faults injected
one after another, and an independent reckoning of what every request got and what every KV
block is doing afterwards.

The stack (all started here, on a private Redis and a private PostgreSQL, each on a free port
in a temporary folder; never the shared ones): 2 routers, 2 KV-transfer coordinators, 2 pool
managers per role, 2 governors (active/standby on a Redis lease; recommend-only, so the
harness's supervisor keeps owning the workers), 2 prefill and 2 decode sim workers (real-time
simulated H100s running Llama-3.1-8B, KV over TCP); one prefill worker's clock runs an hour
ahead and one decode worker's an hour behind.

Faults, one at a time in a seeded random order, each waited out until every router sees every
worker READY again (see ``_chaos_faults``): kill -9 of a prefill worker caught prefilling, one
caught sending KV, a decode worker caught decoding (its streams fail over to the other decode
worker mid-stream), a coordinator, a prefill and a decode pool manager, a router (its clients
resume their streams on the other replica by request id), the active governor; a Redis restart
(every key lost); a transfer stalled mid-flight (SIGSTOP of the skewed prefill worker for three
ticket leases); a prefill worker's prefill loop held while its heartbeats go on (its queued
leases lapse and the requests are retried); a rolling restart of every process, one at a time
(SIGTERM, replaced in its slot). Killed processes are restarted after a delay, as a supervisor
would. In the background PostgreSQL is down for a
minute. Rounds repeat until enough requests were accepted. Then each pool is halved under the
same load through SetTargetSize (the governor's path), the load stops, and the stack settles:
``pdserve audit`` reconciles the coordinator's ledgers with the workers' own block tables and
the handoff checksums of both sides; every block still in use once idle counts as leaked; late
writes are the decode workers' own counters (GetStatus), polled through the run so that killed
workers count too. Last, goodput at 1x and 3x capacity (``bench/overload.measure_goodput``, on
a ``pdserve up`` stack of its own with the sim GPUs as the bottleneck).

    python bench/chaos.py [--quick] [--seed 1] [--rate 6] [--min-accepted 1000] [--faults a,b]
                          [--state redis|redis-cluster]

``--state redis-cluster`` runs the same list on a private Redis Cluster (3 masters + 3
replicas): ``redis_restart`` is then kill -9 of a master (its replica takes over, the node
rejoins as a replica) and ``redis_failover`` (a graceful CLUSTER FAILOVER) joins the list.

Progress goes to stderr. Last line: JSON with redis_mode, accepted, completed, failed_clean, hung,
truncated, duplicated_tokens, resumed_by_client, leaked_blocks, late_writes_accepted,
redis_recovery_s, failed_during_scale_down,
goodput_1x, goodput_3x (and more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path

from _chaos_faults import (
    CLUSTER_FAULTS,
    STATES,
    ChaosPlan,
    ChaosResult,
    FaultRecord,
    faults_for,
    has_problems,
    run_chaos,
    save_logs,
)
from _chaos_load import is_refused, overlapping
from _chaos_stack import ChaosConfig, ChaosStack, log


def measure_goodput_pair(sweep_s: float, duration_s: float) -> dict[str, float]:
    """Capacity, then goodput at 1x and 3x of it, through bench/overload on its own stack."""
    import overload

    workload = overload.WORKLOAD
    with overload.running_stack(workload, is_shedding_enabled=True) as stack:
        overload.warm_up(stack.address, workload)
        capacity, _ = overload.measure_capacity(stack.address, workload, sweep_s)
        log(f"goodput: capacity {capacity:.2f} rps")
        results = {}
        for multiplier in (1.0, 3.0):
            results[multiplier] = overload.measure_goodput(
                multiplier, capacity_rps=capacity, duration_s=duration_s,
                address=stack.address, workload=workload)
            log(f"goodput at {multiplier:g}x: {results[multiplier]['goodput_rps']:.2f} rps")
    return {"capacity_rps": capacity, "goodput_1x": results[1.0]["goodput_rps"],
            "goodput_3x": results[3.0]["goodput_rps"],
            "shed_fraction_3x": results[3.0]["shed_fraction"],
            "goodput_leaked_blocks": results[1.0]["leaked_blocks"] + results[3.0]["leaked_blocks"],
            "goodput_hung": results[1.0]["num_hung"] + results[3.0]["num_hung"]}


# -- report -------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(widths[i]) for i, c in enumerate(r)).rstrip()
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}f}"


def fault_table(result: ChaosResult) -> str:
    rows = []
    records: list[FaultRecord] = sorted(result.faults, key=lambda f: f.injected_s or 1e18)
    if result.scale_down is not None:
        records.append(result.scale_down)
    for record in records:
        end = record.recovered_s or record.injected_s
        window = overlapping(result.outcomes, record.injected_s, end) if record.injected_s else []
        failed = [o for o in window if o.kind == "failed" and o.code != "RESOURCE_EXHAUSTED"]
        cut = [o for o in result.expected_failures if o in failed]
        rows.append([
            record.name,
            _fmt(record.injected_s - result.started_s) if record.injected_s else "-",
            record.victim or "-",
            _fmt(record.recovery_s),
            str(len(window)), f"{len(failed)} ({len(cut)} cut)",
            " ".join(f"{k}={v}" for k, v in record.details.items()) or "-",
            record.error or "",
        ])
    return _table(["fault", "at s", "victim", "recovered after s", "requests in window",
                   "failed (cut after 1st token)", "details", "not injected / problem"], rows)


def summary_rows(result: ChaosResult, figures: dict[str, float]) -> list[list[str]]:
    c = result.counts
    audit = result.audit
    return [
        ["requests sent", str(c.sent), ""],
        ["refused at admission (RESOURCE_EXHAUSTED, not accepted)", str(c.refused), ""],
        ["accepted", str(c.accepted), ">= 1000 (full run)"],
        ["completed with every token", str(c.completed), ""],
        ["  of which resumed by the client on another router replica", str(c.resumed), ""],
        ["failed cleanly (gRPC status)", str(c.failed_clean), ""],
        [
            "  of which cut after the first token by a decode/router kill",
            str(len(result.expected_failures)),
            "0 (failover, client resume)",
        ],
        [
            "  of which anything else (should have been retried)",
            str(len(result.unexpected_failures)),
            "0",
        ],
        ["hung (no end within 60 s)", str(c.hung), "0"],
        ["truncated (clean end, fewer tokens)", str(c.truncated), "0"],
        ["duplicated (more tokens than asked, over failovers and resumes)", str(c.duplicated),
         "0"],
        ["client errors (neither tokens nor a status)", str(c.client_errors), "0"],
        ["leaked blocks after settling", str(result.leaked_blocks), "0"],
        ["audit: ledgers vs workers' tables", "OK" if audit and audit.is_ok else "MISMATCH", "OK"],
        [
            "tickets left open (or DONE and holding) once idle",
            str(len(result.orphaned_tickets)),
            "0",
        ],
        [
            "KV checksums, sent vs accepted: handoffs compared / mismatched",
            f"{result.num_checksums_compared} / {len(result.checksum_mismatches)}",
            "- / 0",
        ],
        ["late writes accepted (fencing)", str(result.late_writes_accepted), "0"],
        ["KV frames refused by receivers", str(result.refused_frames), ""],
        [
            "Redis restart -> first successful request, s (worst of the restarts)",
            _fmt(figures["redis_recovery_s"], 2),
            "",
        ],
        [
            "Redis restart -> all workers READY in store and routers' views, s",
            _fmt(figures["redis_all_ready_s"], 2),
            "",
        ],
        [
            "governor takeover after kill -9 of the active one, s (worst)",
            _fmt(figures["governor_takeover_s"], 2),
            "",
        ],
        [
            "durable records lost across the Postgres outage",
            str(figures["durable_records_lost"]),
            "0",
        ],
        [
            "failed requests during scale-down (halving each pool)",
            str(result.failed_during_scale_down),
            "0",
        ],
        ["capacity (overload stack), requests/s", _fmt(figures.get("capacity_rps"), 2), ""],
        ["goodput at 1x capacity, requests/s", _fmt(figures.get("goodput_1x"), 2), ""],
        ["goodput at 3x capacity, requests/s", _fmt(figures.get("goodput_3x"), 2), ""],
    ]


def _worst(result: ChaosResult, name: str, key: str) -> float:
    """The largest ``details[key]`` over the faults named ``name`` (nan if none has it)."""
    values = [float(f.details[key]) for f in result.faults
              if f.name == name and isinstance(f.details.get(key), (int, float))]
    return max(values) if values else float("nan")


def failure_codes(result: ChaosResult) -> str:
    codes: dict[str, int] = {}
    for outcome in [*result.expected_failures, *result.unexpected_failures]:
        key = f"{outcome.code} ({'after' if outcome.num_tokens else 'before'} the first token)"
        codes[key] = codes.get(key, 0) + 1
    return ", ".join(f"{code}: {num}" for code, num in sorted(codes.items())) or "none"


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one round of every fault at a lower rate, Postgres down 15 s, "
                        "short goodput runs")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=None, help="requests/s (open loop)")
    parser.add_argument("--min-accepted", type=int, default=None)
    parser.add_argument("--postgres-down-s", type=float, default=None)
    parser.add_argument("--num-prefill", type=int, default=2)
    parser.add_argument("--num-decode", type=int, default=2)
    parser.add_argument("--faults", default="",
                        help="comma-separated subset of the fault list (default: all of "
                        f"{', '.join(CLUSTER_FAULTS)}; redis_failover on a cluster only)")
    parser.add_argument("--state", choices=STATES, default="redis",
                        help="hot state: one private Redis node, or a private Redis Cluster "
                        "(3 masters + 3 replicas; redis_restart then crashes a master)")
    parser.add_argument("--no-goodput", action="store_true", help="skip the goodput runs")
    parser.add_argument("--logs-dir", default="",
                        help="write every process's output here (always done, to a new temporary "
                        "folder, when a must-be-zero figure is not)")
    args = parser.parse_args()
    known = faults_for(args.state)
    faults = tuple(name for name in args.faults.split(",") if name) or known
    if unknown := sorted(set(faults) - set(known)):
        parser.error(f"--faults: unknown {', '.join(unknown)} on --state {args.state} "
                     f"(known: {', '.join(known)})")
    quick = args.quick
    plan = ChaosPlan(
        rate_rps=args.rate or (4.0 if quick else 6.0),
        faults=faults,
        min_rounds=1 if quick else 2,
        min_accepted=args.min_accepted if args.min_accepted is not None else
        (150 if quick else 1000),
        max_duration_s=120.0 if quick else 360.0,
        postgres_down_s=args.postgres_down_s if args.postgres_down_s is not None else
        (15.0 if quick else 60.0),
        scale_down_hold_s=3.0 if quick else 8.0,
        seed=args.seed,
    )
    config = ChaosConfig(num_prefill=args.num_prefill, num_decode=args.num_decode,
                         state=args.state)
    began = time.monotonic()
    log(f"plan {plan}")
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as work:
        stack = ChaosStack(config, Path(work))
        try:
            log("starting the stack (private Redis and PostgreSQL)")
            stack.start()
            log(f"stack up after {time.monotonic() - began:.0f}s: {len(stack.processes)} "
                f"processes")
            result = asyncio.run(run_chaos(stack, plan))
        finally:
            log("stopping the stack")
            stack.close()
    chaos_s = time.monotonic() - began
    logs_dir = save_logs(stack, args.logs_dir) if args.logs_dir or has_problems(result) else None

    figures: dict[str, float] = {
        "redis_recovery_s": _worst(result, "redis_restart", "first_success_s"),
        "redis_all_ready_s": _worst(result, "redis_restart", "all_ready_s"),
        "governor_takeover_s": _worst(result, "kill_governor", "takeover_s"),
        "durable_records_lost": int(_worst(result, "postgres_down", "records_lost"))
        if result.fault("postgres_down") else -1,
    }
    if not args.no_goodput:
        log("goodput at 1x and 3x (bench/overload)")
        figures.update(measure_goodput_pair(sweep_s=4.0 if quick else 6.0,
                                            duration_s=8.0 if quick else 20.0))
    c = result.counts
    not_injected = sorted({f.name for f in result.faults if f.error and not f.injected_s})
    print(f"pdserve chaos ({'quick' if quick else 'full'} run, seed {plan.seed}, hot state "
          f"{config.state}): "
          f"{config.num_routers} routers, {config.num_replicas} coordinators, "
          f"{config.num_replicas} pool managers per role, {config.num_governors} governors, "
          f"{config.num_prefill} prefill + {config.num_decode} decode sim workers (one of each "
          f"with its clock {config.clock_skew_s:.0f} s off); open-loop Poisson load at "
          f"{plan.rate_rps:g} requests/s, prompts {plan.prompt_tokens[0]}-"
          f"{plan.prompt_tokens[1]} tokens, {plan.max_tokens} output tokens; "
          f"{len(result.faults)} faults over {result.ended_s - result.started_s:.0f} s of load")
    print()
    print(fault_table(result))
    print()
    print(_table(["figure", "value", "required"], summary_rows(result, figures)))
    print(f"\nfailures by status: {failure_codes(result)}")
    if result.unexpected_failures:
        print("\nunexpected failures (first 10):")
        for outcome in result.unexpected_failures[:10]:
            print(f"  {outcome.request_id} {outcome.code} after {outcome.num_tokens} tokens, "
                  f"{outcome.num_tries} tries, at {outcome.started_s - result.started_s:.1f}s:"
                  f" {outcome.detail[:120]}")
    refused = [o for o in result.outcomes if is_refused(o)]
    if refused:
        print(f"\nrefused at admission ({len(refused)}; first 10):")
        for outcome in refused[:10]:
            print(f"  {outcome.request_id} at {outcome.started_s - result.started_s:.1f}s: "
                  f"{outcome.detail[:120]}")
    if result.audit is not None and not result.audit.is_ok:
        from pdserve.cli.audit import format_report
        print("\naudit:\n" + format_report(result.audit))
    if result.orphaned_tickets:
        print("\norphaned tickets: " + "; ".join(result.orphaned_tickets[:10]))
    if result.idle_ledger_problems:
        print("\nledgers not free once idle: " + "; ".join(result.idle_ledger_problems))
    if not_injected:
        print(f"\nfaults not injected: {', '.join(not_injected)}")
    if logs_dir is not None:
        print(f"\nprocess logs: {logs_dir}")
    print(f"\nchaos part {chaos_s:.0f} s, all {time.monotonic() - began:.0f} s")

    def num(value: float, digits: int = 3) -> float | None:
        return None if value is None or math.isnan(value) else round(value, digits)

    print(json.dumps({
        "redis_mode": config.state,
        "accepted": c.accepted,
        "completed": c.completed,
        "failed_clean": c.failed_clean,
        "hung": c.hung,
        "truncated": c.truncated,
        "duplicated_tokens": c.duplicated,
        "leaked_blocks": result.leaked_blocks,
        "late_writes_accepted": result.late_writes_accepted,
        "redis_recovery_s": num(figures["redis_recovery_s"]),
        "failed_during_scale_down": result.failed_during_scale_down,
        "goodput_1x": num(figures.get("goodput_1x", float("nan"))),
        "goodput_3x": num(figures.get("goodput_3x", float("nan"))),
        "redis_all_workers_ready_s": num(figures["redis_all_ready_s"]),
        "failed_unexpected": len(result.unexpected_failures),
        "failed_cut_after_first_token": len(result.expected_failures),
        "resumed_by_client": c.resumed,
        "refused_at_admission": c.refused,
        "client_errors": c.client_errors,
        "audit_ok": bool(result.audit and result.audit.is_ok),
        "checksums_compared": result.num_checksums_compared,
        "checksum_mismatches": len(result.checksum_mismatches),
        "orphaned_tickets": len(result.orphaned_tickets),
        "governor_takeover_s": num(figures["governor_takeover_s"]),
        "durable_records_lost": figures["durable_records_lost"],
        "capacity_rps": num(figures.get("capacity_rps", float("nan"))),
        "num_faults": len(result.faults),
        "faults_with_problems": sorted({f.name for f in result.faults if f.error}),
        "fault_kinds": sorted({f.name for f in result.faults if not f.error}),
        "seconds": round(time.monotonic() - began),
    }))


if __name__ == "__main__":
    main()
