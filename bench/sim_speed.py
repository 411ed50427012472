"""Simulator speed at 1,000 GPUs: simulated requests per second of wall-clock time.

125 Llama-3.1-70B TP8 instances on H100, split between prefill and decode by a quick balance of
mean prefill work against decode capacity per request (``balance_pools``), with the Azure 2023
conversation trace rate-scaled so both pools are about 70% loaded (by mean work; the table
shows the measured prefill busy fraction and decode batch-slot use). The baseline is a loop that
only reads the same requests the way the simulator's arrival loop does, so the ratio shows what
simulating costs over touching each request. The last line is one JSON object.

    python bench/sim_speed.py [--trace PATH] [--duration-s 600] [--repeat 2] [--mooncake PATH]

Then the Mooncake conversation trace (``<repo>/../shared/data/traces/
mooncake_fast25_conversation_trace.jsonl``: long prompts, prefix hashes) at its own timestamps
on a 6 prefill + 3 decode cluster of the same instances, with each prefill instance's prefix
cache on: ``sim_requests_per_s_mooncake``. When NVIDIA Dynamo is installed in the bench's peers
venv (``python bench/peers.py --install``), its offline ``dynamo.replay`` (Rust; the mocker
engines' defaults) replays the same trace on 6 prefill + 3 decode workers in the same run,
once with round-robin routing and once with its KV-aware router (the one comparable with
pdserve's prefix-aware routing), best of ``--repeat`` each, timed by Dynamo's own
``wall_time_ms`` (runtime construction and execution, as pdserve's time is the simulation
alone): ``dynamo_replay_requests_per_s_mooncake`` is the faster mode's (null when Dynamo is
absent) and ``mooncake_vs_dynamo`` ours over it.

Without the trace (``<repo>/../shared/data/traces/azure_llm_2023_conv.csv``) a synthetic
Poisson trace with the conversation trace's mean lengths is used, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.sim import ClusterSpec, SimConfig, SloSpec, simulate
from pdserve.sim.engine_model import InstanceModel, balance_pools, instance_model
from pdserve.sim.traces import LengthSpec, Trace, load_trace, rate_scale, synthetic_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_procs import PEERS_DIR, PEERS_VENV  # noqa: E402  (a sibling module of the bench)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"
MOONCAKE_TRACE = (ROOT.parent / "shared" / "data" / "traces"
                  / "mooncake_fast25_conversation_trace.jsonl")
MOONCAKE_SHAPE = (6, 3)
"""Prefill and decode instances of the Mooncake replay."""
MOONCAKE_PREFIX_CACHE_BLOCKS = 65_536
"""Prefix-cache LRU per prefill instance, in engine blocks (1M tokens at 16 per block)."""
NUM_INSTANCES = 125
TP_SIZE = 8
MODEL = "llama-3.1-70b"
GPU = "h100-sxm-80gb"


def baseline_loop(trace: Trace, chunk: int = 1 << 14) -> float:
    """Wall seconds to read every request as the simulator's arrival loop does."""
    started = time.perf_counter()
    total = 0.0
    for start in range(0, trace.num_requests, chunk):
        arrivals = trace.arrival_s[start:start + chunk].tolist()
        prompts = trace.prompt_tokens[start:start + chunk].tolist()
        outputs = trace.output_tokens[start:start + chunk].tolist()
        for j, arrival in enumerate(arrivals):
            total += arrival + prompts[j] + outputs[j]
    elapsed = time.perf_counter() - started
    assert total > 0
    return elapsed


def config_for(num_prefill: int, num_decode: int) -> SimConfig:
    return SimConfig(ClusterSpec(num_prefill, num_decode, model=MODEL, gpu=GPU, tp_size=TP_SIZE),
                     slo=SloSpec(ttft_ms=2000, tpot_ms=100))


def decode_offered_load(trace: Trace, instance: InstanceModel, config: SimConfig) -> float:
    """Decode tokens the trace asks for per second over what the decode pool makes at full
    batches (``max_batch_size`` sequences at the mean context)."""
    batch = config.cluster.max_batch_size
    mean_context = float(np.mean(trace.prompt_tokens + trace.output_tokens / 2))
    max_tokens_per_s = batch / instance.decode_step_s(batch, int(batch * mean_context))
    offered = float(np.sum(trace.output_tokens - 1)) / max(trace.duration_s, 1e-9)
    return offered / (config.cluster.num_decode * max_tokens_per_s)


def load_source(path: Path) -> tuple[Trace, str]:
    if path.is_file():
        return load_trace(path, "azure"), str(path.name)
    note = f"trace {path} not found: synthetic Poisson trace (mean prompt 1,155, output 211)"
    print(note, file=sys.stderr)
    return synthetic_trace(20_000, 5.5, seed=7, prompt=LengthSpec(1155, 0.8, 1, 14_000),
                           output=LengthSpec(211, 0.8, 1, 1000)), "synthetic (" + note + ")"


def replay_mooncake(path: Path, instance: InstanceModel, repeat: int) -> int | None:
    """Simulated requests per wall second of the Mooncake trace at its own timestamps on the
    6P+3D cluster (best of ``repeat``); None when the trace is missing."""
    if not path.is_file():
        print(f"\nmooncake: {path.name} not found: skipped", file=sys.stderr)
        return None
    trace = load_trace(path, "mooncake")
    num_prefill, num_decode = MOONCAKE_SHAPE
    config = SimConfig(ClusterSpec(num_prefill, num_decode, model=MODEL, gpu=GPU,
                                   tp_size=TP_SIZE,
                                   prefix_cache_blocks=MOONCAKE_PREFIX_CACHE_BLOCKS),
                       slo=SloSpec(ttft_ms=2000, tpot_ms=100))
    best = min((simulate(trace, config, instance=instance) for _ in range(repeat)),
               key=lambda result: result.wall_s)
    rps = trace.num_requests / best.wall_s
    cached = float(np.sum(best.cached_tokens)) / float(np.sum(trace.prompt_tokens))
    print(f"\nmooncake: {path.name}, {trace.num_requests:,} requests over "
          f"{trace.duration_s:,.0f} s at its own timestamps (mean prompt "
          f"{float(np.mean(trace.prompt_tokens)):,.0f} tokens, prefix hashes "
          f"{'yes' if trace.has_prefix_hashes else 'no'}) on {num_prefill}P+{num_decode}D "
          f"{MODEL} TP{TP_SIZE}, prefix cache {MOONCAKE_PREFIX_CACHE_BLOCKS:,} blocks per "
          f"prefill instance")
    print(f"  pdserve: simulated in {best.wall_s:.2f} s wall: {rps:,.0f} requests/s, "
          f"{best.num_events / trace.num_requests:.1f} events per request, prompt tokens "
          f"from prefix caches {cached:.1%}, SLO attainment {best.attainment():.1%}")
    return round(rps)


DYNAMO_REPLAY = """
import json, sys
from dynamo.replay import run_trace_replay
path, mode, num_prefill, num_decode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
report = run_trace_replay(
    path, trace_format="mooncake", router_mode=mode,
    num_prefill_workers=num_prefill, num_decode_workers=num_decode,
    prefill_engine_args={"engine": {"worker_type": "prefill"}},
    decode_engine_args={"engine": {"worker_type": "decode"}})
print(json.dumps({key: report.summary.get(key) for key in (
    "completed_requests", "wall_time_ms", "prefix_cache_reused_ratio", "p90_ttft_ms")}))
"""
"""Run by the peers venv's Python: one offline ``dynamo.replay`` of a Mooncake trace."""
DYNAMO_ROUTER_MODES = ("round_robin", "kv_router")


def replay_dynamo(path: Path, repeat: int) -> dict[str, int]:
    """Dynamo's simulated requests per second of wall time on the Mooncake trace and the same
    shape, by router mode (best of ``repeat``); empty when Dynamo or the trace is absent."""
    python = PEERS_VENV / "bin" / "python"
    if not path.is_file():
        return {}
    if not ((PEERS_DIR / "dynamo.installed").is_file() and python.is_file()):
        print("  dynamo.replay: not installed (python bench/peers.py --install): skipped")
        return {}
    rates: dict[str, int] = {}
    for mode in DYNAMO_ROUTER_MODES:
        best_ms = float("inf")
        for attempt in range(repeat):
            print(f"  dynamo.replay ({mode}, run {attempt + 1} of {repeat}) ...", flush=True)
            done = subprocess.run(
                [str(python), "-c", DYNAMO_REPLAY, str(path), mode, *map(str, MOONCAKE_SHAPE)],
                capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                print(f"  dynamo.replay ({mode}) failed: {done.stderr.strip()[-500:]}")
                break
            summary = json.loads(done.stdout.strip().splitlines()[-1])
            best_ms = min(best_ms, float(summary["wall_time_ms"]))
        else:
            num = int(summary["completed_requests"])
            rates[mode] = round(num / (best_ms / 1000.0))
            print(f"  dynamo.replay {mode}: {num:,} requests in {best_ms / 1000:.2f} s wall: "
                  f"{rates[mode]:,} requests/s, prompt tokens from prefix caches "
                  f"{float(summary['prefix_cache_reused_ratio']):.1%}, TTFT p90 "
                  f"{float(summary['p90_ttft_ms']):,.0f} ms (its mocker's own timing model)")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--duration-s", type=float, default=600.0,
                        help="simulated seconds of the rate-scaled trace to replay")
    parser.add_argument("--utilization", type=float, default=0.7)
    parser.add_argument("--repeat", type=int, default=2, help="runs; the best is reported")
    parser.add_argument("--mooncake", type=Path, default=MOONCAKE_TRACE,
                        help="Mooncake-format trace replayed on a 6P+3D cluster (skipped if "
                        "missing)")
    args = parser.parse_args()

    source, source_name = load_source(args.trace)
    instance = instance_model(MODEL, GPU, TP_SIZE)
    window = source.window(0.0, args.duration_s) if source.duration_s > args.duration_s else source
    split = balance_pools(window.prompt_tokens, window.output_tokens, instance, NUM_INSTANCES,
                          target_utilization=args.utilization)
    # The analytic split assumes one prompt per prefill batch; batching makes prefill cheaper.
    # A short pilot run measures prefill seconds per request, and the split is re-balanced.
    pilot_config = config_for(split.num_prefill, split.num_decode)
    pilot_trace = rate_scale(window, split.rate_per_s / window.mean_rate_per_s, seed=1).window(
        0.0, min(60.0, args.duration_s))
    pilot = simulate(pilot_trace, pilot_config, instance=instance)
    measured_prefill_s = pilot.extra["prefill_busy_s"] / pilot_trace.num_requests
    split = balance_pools(window.prompt_tokens, window.output_tokens, instance, NUM_INSTANCES,
                          target_utilization=args.utilization,
                          prefill_s_per_request=measured_prefill_s)
    factor = split.rate_per_s / window.mean_rate_per_s
    trace = rate_scale(window, factor, seed=1)
    config = config_for(split.num_prefill, split.num_decode)

    baseline_s = min(baseline_loop(trace) for _ in range(args.repeat))
    best = None
    for _ in range(args.repeat):
        result = simulate(trace, config, instance=instance)
        if best is None or result.wall_s < best.wall_s:
            best = result
    assert best is not None
    sim_rps = trace.num_requests / best.wall_s
    base_rps = trace.num_requests / baseline_s
    extra = best.extra

    print(f"cluster: {NUM_INSTANCES} x {MODEL} TP{TP_SIZE} on {GPU} = "
          f"{NUM_INSTANCES * TP_SIZE} GPUs: {split.num_prefill} prefill + "
          f"{split.num_decode} decode")
    print(f"trace: {source_name}, rate x{factor:.1f} -> {trace.mean_rate_per_s:.0f} req/s "
          f"(target {args.utilization:.0%} load: {split.rate_per_s:.0f} req/s)")
    print(f"load: prefill busy {extra['prefill_busy_fraction']:.0%} (measured), decode "
          f"{decode_offered_load(trace, instance, config):.0%} of full-batch token rate (offered;"
          f" mean "
          f"{extra['mean_running_per_decode']:.0f} running of {config.cluster.max_batch_size}), "
          f"KV {extra['decode_kv_used_fraction']:.0%}; SLO attainment {best.attainment():.1%} "
          f"(TTFT {config.slo.ttft_ms:.0f} ms, TPOT {config.slo.tpot_ms:.0f} ms)")
    print()
    cpu_s = best.extra["cpu_s"]
    header = (f"{'':<22}{'requests':>10}{'sim s':>9}{'wall s':>9}{'cpu s':>8}{'requests/s':>13}"
              f"{'req/cpu-s':>11}{'events':>11}")
    print(header)
    print("-" * len(header))
    print(f"{'simulator':<22}{trace.num_requests:>10,}{best.end_s:>9.0f}{best.wall_s:>9.2f}"
          f"{cpu_s:>8.2f}{sim_rps:>13,.0f}{trace.num_requests / cpu_s:>11,.0f}"
          f"{best.num_events:>11,}")
    print(f"{'baseline (read only)':<22}{trace.num_requests:>10,}{'':>9}{baseline_s:>9.2f}"
          f"{'':>8}{base_rps:>13,.0f}{'':>11}{'':>11}")
    print(f"overhead: simulating costs {base_rps / sim_rps:.0f}x reading the requests; "
          f"{best.num_events / trace.num_requests:.1f} events per request; "
          f"sim runs {best.end_s / best.wall_s:.0f}x faster than real time; the process had "
          f"{cpu_s / best.wall_s:.0%} of a core (other load on the machine slows the wall clock)")
    mooncake = replay_mooncake(args.mooncake, instance, args.repeat)
    dynamo = replay_dynamo(args.mooncake, args.repeat) if mooncake is not None else {}
    dynamo_best = max(dynamo.values()) if dynamo else None
    if mooncake is not None and dynamo_best:
        print(f"  pdserve over the faster dynamo.replay mode: {mooncake / dynamo_best:.2f}x")
    print(json.dumps({
        "sim_requests_per_s": round(sim_rps),
        "sim_requests_per_s_mooncake": mooncake,
        "dynamo_replay_requests_per_s_mooncake": dynamo_best,
        "dynamo_replay_requests_per_s_mooncake_by_router": dynamo or None,
        "mooncake_vs_dynamo": (round(mooncake / dynamo_best, 2)
                               if mooncake is not None and dynamo_best else None),
        "sim_requests_per_cpu_s": round(trace.num_requests / cpu_s),
        "baseline_requests_per_s": round(base_rps),
        "num_requests": trace.num_requests,
        "num_gpus": NUM_INSTANCES * TP_SIZE,
        "num_prefill": split.num_prefill,
        "num_decode": split.num_decode,
        "prefill_busy_fraction": round(extra["prefill_busy_fraction"], 3),
        "decode_offered_load": round(decode_offered_load(trace, instance, config), 3),
        "trace": source_name,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
