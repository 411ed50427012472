"""pdserve's request path against the systems users would pick instead, in one run.

Systems (each on loopback, instant engines, 8 output tokens, ~200-token prompts, local prefill
off so every pdserve request is disaggregated, tracing off):

- ``direct``: a trivial fake OpenAI backend (``bench/_peers_backend.py``) called directly;
- ``vllm_router``: vllm-router in PD mode over two fake backends (if installed);
- ``dynamo``: NVIDIA Dynamo's frontend with a prefill and a decode mocker, in a loopback-only
  network namespace (if installed; needs ``ip netns``, i.e. root);
- ``pdserve_redis``: every pdserve service its own process on a private Redis and PostgreSQL
  (the real deployment shape), sim workers at ``--speedup 1e9``;
- ``pdserve_memory``: ``pdserve up`` with its in-memory state;
- ``floor``: pdserve's topology with nothing but its transport work (``bench/_path_floor.py``:
  router, coordinator, prefill and decode worker as four Python processes on a private Redis,
  per request the gRPC calls pdserve makes (open, decode stream, prefill, batched reports), a
  Redis read and two Lua scripts (pdserve runs three), the same KV bytes in per-layer frames with
  a CRC on each side, and none of pdserve's guarantees): about the least CPU per request that
  trimming pdserve's own code could reach in this shape.

One closed-loop OpenAI HTTP load generator (aiohttp, in this process) runs against each, in
interleaved rounds: concurrency 1 and 16, streaming and not, keep-alive and a new connection per
request. Reported per system and shape: p50/p99 latency (ms) and req/s; per system: CPU ms per
request of the system's own processes (router, services, workers, Redis and PostgreSQL; not the
load generator, not the fake backends), from /proc.

    python bench/peers.py [--seconds 3] [--rounds 2] [--install]

``--install`` first installs vllm-router and Dynamo into ``bench/.peers/`` (a venv of its own;
see the project's research notes on running the peers); without it, peers that are not
installed there are skipped (their JSON values are null). The sim engine's KV is scaled as the
bench prints. Last line: one JSON object with ``pdserve_redis_c1_p50_ms``, ``dynamo_c1_p50_ms``,
``pdserve_redis_c16_rps``, ``dynamo_c16_rps``, ``vllm_router_c16_rps``,
``pdserve_cpu_ms_per_request``, ``floor_cpu_ms_per_request``, ``pdserve_redis_cpu_over_floor``
(and more); c1 p50 and c16 req/s are of the streaming,
keep-alive shape, and ``<system>_c1_p50_ms_best_shape`` is each system's lowest c1 p50 over the
four shapes (Dynamo's streaming keep-alive shape stalls ~40 ms a request here, which would
flatter any comparison made on that shape alone).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _peers_procs import (  # noqa: E402 - after the path set-up
    PEERS_DIR,
    Started,
    install_peers,
    start_direct,
    start_dynamo,
    start_floor,
    start_pdserve_memory,
    start_pdserve_redis,
    start_vllm_router,
)

PROMPT = [32 + (7 * i) % 200 for i in range(200)]
"""200 prompt tokens, as ids so every system counts the same (within pdserve's built-in byte
tokenizer's vocabulary, and any real model's)."""
MAX_TOKENS = 8
SHAPES = [(c, stream, keep) for c in (1, 16) for stream in (True, False) for keep in (True, False)]
"""(concurrency, is_streaming, is_keep_alive)."""


def log(message: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime (clock ticks) of the processes, summed; gone processes count 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def descendants(roots: list[int]) -> list[int]:
    """The processes and every descendant of them, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


@dataclass(slots=True)
class Cell:
    latencies_s: list[float] = field(default_factory=list)
    num_done: int = 0
    elapsed_s: float = 0.0
    num_errors: int = 0


async def _one(session: aiohttp.ClientSession, url: str, model: str, is_stream: bool) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": is_stream}
    if is_stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(url, json=body, headers={"x-pdserve-prefill-mode": "remote"}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        if is_stream:
            async for _ in r.content:
                pass
        else:
            await r.read()


async def run_cell(started: Started, concurrency: int, is_stream: bool, is_keep_alive: bool,
                   seconds: float) -> Cell:
    """A closed loop: ``concurrency`` clients, each sending its next request when the last ends
    (in the system's network namespace, as a child process, when it has one)."""
    if started.netns:
        argv = ["ip", "netns", "exec", started.netns, sys.executable, __file__, "--cell",
                json.dumps([started.base_url, started.model, concurrency, is_stream,
                            is_keep_alive, seconds])]
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        out, _ = await process.communicate()
        data = json.loads(out.decode().strip().splitlines()[-1])
        return Cell(data["latencies_s"], data["num_done"], data["elapsed_s"], data["num_errors"])
    return await _closed_loop(started.base_url, started.model, concurrency, is_stream,
                              is_keep_alive, seconds)


async def _closed_loop(base_url: str, model: str, concurrency: int, is_stream: bool,
                       is_keep_alive: bool, seconds: float) -> Cell:
    cell = Cell()
    url = base_url + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=0, force_close=not is_keep_alive)
    stop_at = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=connector) as session:
        async def client() -> None:
            while time.perf_counter() < stop_at:
                begun = time.perf_counter()
                try:
                    await _one(session, url, model, is_stream)
                except Exception:  # noqa: BLE001 - counted, the loop goes on
                    cell.num_errors += 1
                    await asyncio.sleep(0.01)
                    continue
                cell.latencies_s.append(time.perf_counter() - begun)
                cell.num_done += 1

        begun = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        cell.elapsed_s = time.perf_counter() - begun
    return cell


def parse_shapes(text: str) -> list[tuple[int, bool, bool]]:
    """``--shapes``: names as the table prints them, dashes for spaces; empty = every shape."""
    if not text:
        return SHAPES
    by_name = {"-".join(_shape_name(*shape).split()): shape for shape in SHAPES}
    shapes = []
    for name in text.split(","):
        if name.strip() not in by_name:
            raise SystemExit(f"--shapes: unknown shape {name.strip()!r} "
                             f"(known: {', '.join(by_name)})")
        shapes.append(by_name[name.strip()])
    return shapes


def _shape_name(concurrency: int, is_stream: bool, is_keep_alive: bool) -> str:
    body = "stream" if is_stream else "whole"
    return f"c{concurrency} {body:<6} {'keep' if is_keep_alive else 'new'}"


Cells = dict[tuple[str, tuple[int, bool, bool]], Cell]


async def measure(systems: dict[str, Started], seconds: float, rounds: int,
                  shapes: list[tuple[int, bool, bool]] = SHAPES
                  ) -> tuple[Cells, dict[str, float], dict[str, dict[str, float]]]:
    """The cells, each system's CPU ms per request, and the same per named part of a system
    (``Started.parts``: each part's processes and their descendants)."""
    cells: Cells = {}
    cpu_s: dict[str, float] = dict.fromkeys(systems, 0.0)
    part_s: dict[str, dict[str, float]] = {
        name: dict.fromkeys(started.parts, 0.0) for name, started in systems.items()}
    num_requests: dict[str, int] = dict.fromkeys(systems, 0)
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
    for name, started in systems.items():  # warm-up: connections, code paths, JIT of peers
        await run_cell(started, 4, True, True, 1.0)
        log(f"warmed up {name}")
    for index in range(rounds):
        for shape in shapes:
            for name, started in systems.items():  # interleaved: drift hits every system alike
                pids = descendants(started.pids)
                part_pids = {part: descendants(roots) for part, roots in started.parts.items()}
                before = cpu_ticks(pids)
                part_before = {part: cpu_ticks(p) for part, p in part_pids.items()}
                cell = await run_cell(started, *shape, seconds)
                cpu_s[name] += (cpu_ticks(pids) - before) * tick_s
                for part, p in part_pids.items():
                    part_s[name][part] += (cpu_ticks(p) - part_before[part]) * tick_s
                num_requests[name] += cell.num_done
                total = cells.setdefault((name, shape), Cell())
                total.latencies_s += cell.latencies_s
                total.num_done += cell.num_done
                total.elapsed_s += cell.elapsed_s
                total.num_errors += cell.num_errors
        log(f"round {index + 1}/{rounds} done")
    def per_request_ms(seconds: float, name: str) -> float:
        return seconds * 1000 / num_requests[name] if num_requests[name] else float("nan")

    cpu_ms = {name: per_request_ms(cpu_s[name], name) for name in systems}
    part_ms = {name: {part: per_request_ms(s, name) for part, s in parts.items()}
               for name, parts in part_s.items() if parts}
    return cells, cpu_ms, part_ms


def report(systems: list[str], cells: dict[tuple[str, tuple[int, bool, bool]], Cell],
           cpu_ms: dict[str, float], skipped: dict[str, str], kv_note: str,
           part_ms: dict[str, dict[str, float]] | None = None,
           shapes: list[tuple[int, bool, bool]] = SHAPES) -> dict[str, object]:
    print(f"{'system':<16} {'shape':<17} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'errors':>7}")
    for name in systems:
        for shape in shapes:
            cell = cells[(name, shape)]
            lat = np.asarray(cell.latencies_s) * 1000 if cell.latencies_s else np.asarray([np.nan])
            rate = cell.num_done / cell.elapsed_s if cell.elapsed_s else 0.0
            print(f"{name:<16} {_shape_name(*shape):<17} {np.percentile(lat, 50):8.2f} "
                  f"{np.percentile(lat, 99):8.2f} {rate:8.0f} {cell.num_errors:7d}")
    print()
    for name in systems:
        note = " (the fake backend itself: not counted)" if name == "direct" else ""
        print(f"{name:<16} CPU ms per request, own processes: {cpu_ms[name]:.2f}{note}")
    for name, parts in (part_ms or {}).items():
        print(f"{name:<16} CPU ms per request by process: " + ", ".join(
            f"{part} {ms:.2f}" for part, ms in sorted(parts.items(), key=lambda kv: -kv[1])))
    for name, why in skipped.items():
        print(f"{name:<16} not run: {why}")
    print(kv_note)

    def p50(name: str, shape: tuple[int, bool, bool] = (1, True, True)) -> float | None:
        cell = cells.get((name, shape))
        return round(float(np.percentile(cell.latencies_s, 50)) * 1000, 3) if cell and \
            cell.latencies_s else None

    def best_c1_p50(name: str) -> float | None:
        # A system can stall one shape on its own (Dynamo's frontend streams a keep-alive
        # connection's chunks ~40 ms apart here, Nagle against delayed ACKs): its best c1 shape
        # says what its path costs.
        values = [v for shape in ((1, s, k) for s in (True, False) for k in (True, False))
                  if (v := p50(name, shape)) is not None]
        return min(values) if values else None

    def rps(name: str) -> float | None:
        cell = cells.get((name, (16, True, True)))
        return round(cell.num_done / cell.elapsed_s, 1) if cell and cell.elapsed_s else None

    def cpu(name: str) -> float | None:
        return round(cpu_ms[name], 3) if name in cpu_ms else None

    result: dict[str, object] = {}
    for name in ("pdserve_redis", "pdserve_memory", "dynamo", "vllm_router", "direct", "floor"):
        result[f"{name}_c1_p50_ms"] = p50(name)
        result[f"{name}_c1_p50_ms_best_shape"] = best_c1_p50(name)
        result[f"{name}_c16_rps"] = rps(name)
        if name != "direct":
            result[f"{name}_cpu_ms_per_request"] = cpu(name)
    result["pdserve_cpu_ms_per_request"] = cpu("pdserve_redis")
    for name in ("pdserve_redis", "floor"):
        result[f"{name}_cpu_ms_by_process"] = {
            part: round(ms, 3) for part, ms in (part_ms or {}).get(name, {}).items()}
    ours, floor = cpu("pdserve_redis"), cpu("floor")
    result["pdserve_redis_cpu_over_floor"] = round(ours / floor, 2) if ours and floor else None
    return result


async def _main(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="pdserve-peers-"))
    work.chmod(0o755)  # the private PostgreSQL runs as its own user when this is root
    stack = contextlib.ExitStack()
    systems: dict[str, Started] = {}
    skipped: dict[str, str] = {}
    starters: list[tuple[str, Callable[[Path], Started]]] = [
        ("direct", start_direct),
        ("vllm_router", start_vllm_router),
        ("dynamo", start_dynamo),
        ("pdserve_redis", start_pdserve_redis),
        ("pdserve_memory", start_pdserve_memory),
        ("floor", start_floor),
    ]
    only = set(args.systems.split(",")) if args.systems else None
    try:
        for name, starter in starters:
            if only is not None and name not in only:
                continue
            log(f"starting {name}")
            try:
                started = starter(work / name)
            except FileNotFoundError as exc:
                skipped[name] = str(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a peer that does not start is reported
                skipped[name] = f"did not start: {exc}"
                log(f"{name} did not start: {exc}")
                continue
            stack.callback(started.stop)
            systems[name] = started
        shapes = parse_shapes(args.shapes)
        cells, cpu_ms, part_ms = await measure(systems, args.seconds, args.rounds, shapes)
        kv_note = next((s.note for s in systems.values() if s.note), "")
        return report(list(systems), cells, cpu_ms, skipped, kv_note, part_ms, shapes)
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per shape per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--install", action="store_true",
                        help=f"install vllm-router and Dynamo into {PEERS_DIR} first")
    parser.add_argument("--systems", default="",
                        help="comma-separated subset (direct,vllm_router,dynamo,pdserve_redis,"
                             "pdserve_memory,floor); default all")
    parser.add_argument("--shapes", default="",
                        help="comma-separated subset of the shapes, as the table names them "
                             "with dashes (e.g. c16-stream-keep,c1-whole-new); default all. CPU "
                             "per request is over the shapes run")
    parser.add_argument("--cell", default="", help=argparse.SUPPRESS)  # a namespaced loop
    args = parser.parse_args()
    if args.cell:
        cell = asyncio.run(_closed_loop(*json.loads(args.cell)))
        print(json.dumps({"latencies_s": cell.latencies_s, "num_done": cell.num_done,
                          "elapsed_s": cell.elapsed_s, "num_errors": cell.num_errors}))
        return
    if args.install:
        install_peers()
    result = asyncio.run(_main(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
