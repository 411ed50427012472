"""What the control plane adds to a request, against a direct call to one worker plus a raw
socket moving the same KV bytes.

The stack (``--state``): ``redis`` (default) is the real deployment shape — every service its
own process (router, KV-transfer coordinator, both pool managers, one prefill and one decode
``sim`` worker) on a private Redis and PostgreSQL, real gRPC between them, the KV over the tcp
transport; ``memory`` is ``pdserve up`` (one control-plane process, in-memory state, the same
workers). The sim workers run with a speed-up so large that simulated compute is ~0, and their
KV at the model's real size (``--kv-scale 1``: llama-3.1-8b's 128 KiB per token), so what
remains is the control plane and the data path. Each request is a 256-token prompt and 4 output
tokens.

- direct: the decode worker's own ``Decode`` RPC with local prefill (no router, no ticket);
- baseline: direct, then the request's KV bytes (as many as the disaggregated path moves: the
  decode worker's announced layout) over a raw loopback TCP socket (blocking ``sendall`` into
  a receiver that ``recv_into``s a preallocated buffer, one connection per concurrent client);
- local: through the router, prefill forced onto the decode worker (ticket, no transfer;
  its added latency is against direct);
- disagg: through the router, prefill forced onto the prefill worker (ticket, admit, prefill,
  the KV over tcp with its checksums, decode).

Concurrency 1 gives latency percentiles (added = router percentile - its baseline's percentile,
same run, modes interleaved); concurrency 16 gives requests/s. The headline figures are with tracing
off. The stack then runs twice more: with tracing at the default sampling (1% of requests,
spans exported over OTLP to a collector in this process) for c16 req/s of the disaggregated
path (``rps_c16_tracing_0p01_over_off``), and with every request traced for its c1 latency.

    python bench/overhead.py [--state redis|memory] [--requests 300] [--seconds 8]
                             [--kv-scale 1.0]

Last line: one JSON object with added_p50_ms_disagg_c1, added_p99_ms_disagg_c1,
added_p50_ms_local_c1, rps_disagg_c16, rps_baseline_c16, rps_c16_tracing_0p01_over_off,
kv_bytes_per_request, state (and more).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import (
    pool_pb2,
    pool_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pdserve.common.plotting import pyplot

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _peers_procs import start_pdserve_redis  # noqa: E402 - after the path set-up

MODEL = "llama-3.1-8b"
PROMPT = list(range(1, 257))
MAX_TOKENS = 4
CONCURRENCY = 16
MODES = ("direct", "baseline", "local", "disagg")
BASE_OF = {"direct": "direct", "baseline": "baseline", "local": "direct", "disagg": "baseline"}
"""What each mode's added latency is measured against: local moves no KV, so the bare call."""
MAX_NUM_BLOCKS = 1024
"""KV blocks per sim worker (at the real size, 2 MiB each over all layers: 2 GiB)."""


def log(message: str) -> None:
    print(f"[overhead {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class OtlpSink:
    """A minimal OTLP trace collector: accepts exports and counts spans."""

    def __init__(self) -> None:
        self.num_spans = 0
        self.server: grpc.aio.Server | None = None

    async def start(self) -> str:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            async def Export(self, request, context):  # noqa: N802 - gRPC method name
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        sink.num_spans += len(scope_spans.spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


class UpStack:
    """``pdserve up`` (in-memory state)."""

    def __init__(self, env: dict[str, str], kv_scale: float) -> None:
        self.env = dict(env, PDSERVE_KV_SCALE=str(kv_scale))
        self.process: subprocess.Popen[str] | None = None
        self.address = ""
        self.pool_address = ""

    def start(self) -> None:
        argv = [sys.executable, "-m", "pdserve", "up", "--grpc-port", "0", "--http-port", "-1",
                "--speedup", "1e9", "--num-prefill", "1", "--num-decode", "1",
                "--max-num-blocks", str(MAX_NUM_BLOCKS),
                "--log-level", "WARNING", "--local-prefill-threshold-tokens", "0"]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=self.env)
        assert self.process.stdout is not None
        deadline = time.monotonic() + 60
        for line in self.process.stdout:
            if line.startswith("grpc "):
                self.address = self.pool_address = line.split()[1]
            if line.startswith("ready"):
                return
            if time.monotonic() > deadline:
                break
        raise RuntimeError("pdserve up did not become ready")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()


class RedisStack:
    """Every service its own process on a private Redis and PostgreSQL."""

    def __init__(self, env: dict[str, str], kv_scale: float) -> None:
        self.extra_env = {k: v for k, v in env.items() if k.startswith("PDSERVE_")}
        self.kv_scale = kv_scale
        self.address = ""
        self.pool_address = ""
        self._folder = tempfile.TemporaryDirectory(prefix="pdserve-overhead-")
        os.chmod(self._folder.name, 0o755)  # PostgreSQL runs as its own user under it
        self._stop: Callable[[], None] | None = None

    def start(self) -> None:
        started = start_pdserve_redis(
            Path(self._folder.name) / "stack",
            worker_args=("--speedup", "1e9", "--kv-scale", str(self.kv_scale),
                         "--max-num-blocks", str(MAX_NUM_BLOCKS)),
            extra_env=self.extra_env)
        self._stop = started.stop
        self.address, self.pool_address = started.grpc_address, started.pool_address

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
        self._folder.cleanup()


class RawSink:
    """A loopback TCP receiver that reads whole payloads into one buffer and acknowledges each
    with one byte: the raw socket the baseline moves the KV bytes over."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = memoryview(bytearray(self.num_bytes))
        with conn:
            while True:
                got = 0
                while got < self.num_bytes:
                    n = conn.recv_into(buffer[got:])
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"\x01")

    def close(self) -> None:
        self._listener.close()


class RawSender:
    """One connection to a ``RawSink``; ``move`` sends one payload and waits for its ack."""

    def __init__(self, port: int, payload: bytes) -> None:
        self._payload = payload
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def move(self) -> None:
        self._sock.sendall(self._payload)
        if self._sock.recv(1) != b"\x01":
            raise RuntimeError("raw sink closed")

    def close(self) -> None:
        self._sock.close()


async def _decode_worker(channel: grpc.aio.Channel) -> pb.WorkerInfo:
    stub = pool_pb2_grpc.PoolServiceStub(channel)
    response = await stub.ListWorkers(pool_pb2.ListWorkersRequest(
        deployment=MODEL, role=pb.WORKER_ROLE_DECODE), timeout=10)
    return response.workers[0]


def kv_bytes_per_request(worker: pb.WorkerInfo) -> tuple[int, int]:
    """(blocks a request reserves, bytes of its prompt's KV) as the decode worker lays them out
    (the reservation holds the prompt and the next token; the KV moved is the prompt's)."""
    layout = worker.kv_layout
    num_prompt_blocks = -(-len(PROMPT) // layout.block_size_tokens)
    num_blocks = -(-(len(PROMPT) + 1) // layout.block_size_tokens)
    return num_blocks, num_prompt_blocks * layout.num_layers * layout.block_nbytes


def make_calls(
    router: router_pb2_grpc.RouterServiceStub, worker: worker_pb2_grpc.WorkerAgentServiceStub,
    num_blocks: int, raw: Callable[[], Awaitable[None]],
) -> dict[str, Callable[[], Awaitable[None]]]:
    async def via_router(mode: int) -> None:
        count = 0
        async for chunk in router.Generate(router_pb2.GenerateRequest(
            model=MODEL, prompt_token_ids=PROMPT, prefill_mode=mode,
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS)), timeout=60):
            count += len(chunk.token_ids)
        assert count == MAX_TOKENS, count

    async def direct() -> None:
        count = 0
        async for chunk in worker.Decode(worker_pb2.DecodeRequest(
            token=pb.FencingToken(ticket_id=str(uuid.uuid4()), attempt=1),
            prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS),
            is_local_prefill=True, num_blocks=num_blocks), timeout=60):
            count += len(chunk.token_ids)
        assert count == MAX_TOKENS, count

    async def baseline() -> None:
        await direct()
        await raw()

    return {
        "direct": direct,
        "baseline": baseline,
        "local": lambda: via_router(pb.PREFILL_MODE_LOCAL),
        "disagg": lambda: via_router(pb.PREFILL_MODE_REMOTE),
    }


async def latencies_c1(calls: dict[str, Callable[[], Awaitable[None]]], modes: list[str],
                       num_requests: int) -> dict[str, np.ndarray]:
    for mode in modes:  # warm-up: channels, connections, code paths
        for _ in range(30):
            await calls[mode]()
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for index in range(num_requests):
        for mode in modes:  # interleaved, so drift in machine load hits every mode alike
            started = time.perf_counter()
            await calls[mode]()
            samples[mode].append(time.perf_counter() - started)
        if index % 100 == 99:
            log(f"  c1: {index + 1}/{num_requests}")
    return {mode: np.asarray(values) * 1000 for mode, values in samples.items()}


async def rps(call: Callable[[], Awaitable[None]], concurrency: int, seconds: float) -> float:
    stop_at = time.perf_counter() + seconds
    done = 0

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await call()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


async def measure(stack: UpStack | RedisStack, args: argparse.Namespace, c1_modes: list[str],
                  c16_modes: list[str]) -> dict[str, object]:
    await asyncio.to_thread(stack.start)
    try:
        async with contextlib.AsyncExitStack() as exits:
            channel = await exits.enter_async_context(grpc.aio.insecure_channel(stack.address))
            pool_channel = await exits.enter_async_context(
                grpc.aio.insecure_channel(stack.pool_address))
            worker = await _decode_worker(pool_channel)
            worker_channel = await exits.enter_async_context(
                grpc.aio.insecure_channel(worker.address))
            num_blocks, num_bytes = kv_bytes_per_request(worker)
            sink = RawSink(num_bytes)
            exits.callback(sink.close)
            payload = os.urandom(num_bytes)
            senders: list[RawSender] = []
            free: asyncio.Queue[RawSender] = asyncio.Queue()
            for _ in range(CONCURRENCY):
                sender = RawSender(sink.port, payload)
                senders.append(sender)
                free.put_nowait(sender)
                exits.callback(sender.close)
            pool = concurrent.futures.ThreadPoolExecutor(CONCURRENCY)
            exits.callback(pool.shutdown)
            loop = asyncio.get_running_loop()

            async def raw() -> None:
                sender = await free.get()
                try:
                    await loop.run_in_executor(pool, sender.move)
                finally:
                    free.put_nowait(sender)

            calls = make_calls(router_pb2_grpc.RouterServiceStub(channel),
                               worker_pb2_grpc.WorkerAgentServiceStub(worker_channel),
                               num_blocks, raw)
            result: dict[str, object] = {"kv_bytes": num_bytes, "kv_blocks": num_blocks}
            if c1_modes:
                result["c1"] = await latencies_c1(calls, c1_modes, args.requests)
            result["c16"] = {}
            for mode in c16_modes:
                log(f"  c{CONCURRENCY}: {mode}")
                result["c16"][mode] = await rps(calls[mode], CONCURRENCY, args.seconds)  # type: ignore[index]
            return result
    finally:
        await asyncio.to_thread(stack.stop)


BENCH_ENV = {"PDSERVE_SLO_TTFT_MS": "60000"}
"""The router's TTFT SLO for this bench. Sixteen closed-loop clients each moving the model's real
KV (32 MiB a request) through one prefill worker queue ~1.8 s of prefill and transfer here, past
the default 2 s SLO's shedding budget: admission would shed them (RESOURCE_EXHAUSTED), as it
should in service. The load is bounded by the clients, so the bench lifts the SLO rather than
turning admission off: each request still pays for its prediction and its admission."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", choices=("redis", "memory"), default="redis",
                        help="every service its own process on Redis + PostgreSQL, or "
                             "`pdserve up` in memory")
    parser.add_argument(
        "--requests", type=int, default=300, help="requests per mode at concurrency 1"
    )
    parser.add_argument(
        "--seconds", type=float, default=8.0, help="duration of each concurrency-16 run"
    )
    parser.add_argument("--kv-scale", type=float, default=1.0,
                        help="sim KV bytes relative to the model's real size")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}

    def stack_for(extra: dict[str, str]) -> UpStack | RedisStack:
        kind = RedisStack if args.state == "redis" else UpStack
        return kind({**env, **BENCH_ENV, **extra}, args.kv_scale)

    log(f"[1/3] {args.state} state, tracing off: baseline, local, disagg")
    # c16 through the router first: the decode worker reports the direct calls' blocks in its
    # heartbeats, and the ledger adopts them until they age out (reconcile's grace, 30 s).
    off = asyncio.run(measure(stack_for({}), args, list(MODES), list(reversed(MODES))))

    async def traced(ratio: str, c1_modes: list[str],
                     c16_modes: list[str]) -> tuple[dict[str, object], int]:
        sink = OtlpSink()
        endpoint = await sink.start()
        try:
            result = await measure(stack_for({"PDSERVE_OTEL_ENDPOINT": endpoint,
                                              "PDSERVE_OTEL_SAMPLING_RATIO": ratio}),
                                   args, c1_modes, c16_modes)
        finally:
            await asyncio.sleep(2)  # let batch exporters flush
            await sink.stop()
        return result, sink.num_spans

    log("[2/3] tracing at the default sampling (1%): disagg at c16")
    sampled, num_sampled_spans = asyncio.run(traced("0.01", [], ["disagg"]))
    log("[3/3] tracing on (every request sampled): baseline, disagg at c1")
    on, num_spans = asyncio.run(traced("1.0", ["baseline", "disagg"], []))

    c1_off: dict[str, np.ndarray] = off["c1"]  # type: ignore[assignment]
    c1_on: dict[str, np.ndarray] = on["c1"]  # type: ignore[assignment]
    c16: dict[str, float] = off["c16"]  # type: ignore[assignment]

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q))

    rows = []
    for label, samples in (("tracing off", c1_off), ("tracing on", c1_on)):
        for mode in MODES:
            if mode not in samples:
                continue
            values = samples[mode]
            base = samples[BASE_OF[mode]]
            rows.append((label, mode, pct(values, 50), pct(values, 99),
                         pct(values, 50) - pct(base, 50), pct(values, 99) - pct(base, 99),
                         c16.get(mode) if label == "tracing off" else None))
    print(f"{'tracing':<12} {'mode':<9} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} "
          f"{'added p99':>10} {'req/s c16':>10}")
    for label, mode, p50, p99, a50, a99, rate in rows:
        rate_text = f"{rate:10.0f}" if rate is not None else f"{'':>10}"
        print(f"{label:<12} {mode:<9} {p50:8.2f} {p99:8.2f} {a50:10.2f} {a99:10.2f} {rate_text}")
    rps_sampled = sampled["c16"]["disagg"]  # type: ignore[index]
    print(f"{'tracing 1%':<12} {'disagg':<9} {'':>8} {'':>8} {'':>10} {'':>10} "
          f"{rps_sampled:10.0f}")
    num_bytes = int(off["kv_bytes"])  # type: ignore[call-overload]
    print(f"(state {args.state}; KV {num_bytes / 2**20:.1f} MiB per request "
          f"({off['kv_blocks']} blocks reserved, kv scale {args.kv_scale:g}), moved by the "
          f"baseline's raw socket too; c1: {args.requests} requests per mode, interleaved; c16: "
          f"{args.seconds:.0f} s per mode; spans exported: {num_sampled_spans} at 1%, "
          f"{num_spans} with every request traced)")
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for mode, values in c1_off.items():
            ax.plot(np.sort(values), np.linspace(0, 1, len(values)), label=f"{mode} (tracing off)")
        ax.plot(np.sort(c1_on["disagg"]), np.linspace(0, 1, len(c1_on["disagg"])),
                label="disagg (tracing on)", linestyle="--")
        ax.set_xscale("log")
        ax.set_xlabel("request latency, ms (concurrency 1)")
        ax.set_ylabel("fraction of requests")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "overhead.png", dpi=120)
        print(f"plot: {out / 'overhead.png'}")

    base, direct = c1_off["baseline"], c1_off["direct"]
    print(json.dumps({
        "added_p50_ms_disagg_c1": round(pct(c1_off["disagg"], 50) - pct(base, 50), 3),
        "added_p99_ms_disagg_c1": round(pct(c1_off["disagg"], 99) - pct(base, 99), 3),
        "added_p50_ms_local_c1": round(pct(c1_off["local"], 50) - pct(direct, 50), 3),
        "added_p99_ms_local_c1": round(pct(c1_off["local"], 99) - pct(direct, 99), 3),
        "baseline_p50_ms_c1": round(pct(base, 50), 3),
        "direct_p50_ms_c1": round(pct(direct, 50), 3),
        "rps_disagg_c16": round(c16["disagg"], 1),
        "rps_local_c16": round(c16["local"], 1),
        "rps_baseline_c16": round(c16["baseline"], 1),
        "added_p50_ms_disagg_c1_tracing_on": round(
            pct(c1_on["disagg"], 50) - pct(c1_on["baseline"], 50), 3),
        "rps_disagg_c16_tracing_0p01": round(rps_sampled, 1),
        "rps_c16_tracing_0p01_over_off": round(rps_sampled / c16["disagg"], 3),
        "kv_bytes_per_request": num_bytes,
        "state": args.state,
    }))


if __name__ == "__main__":
    main()
