"""What the control plane adds to a request, against a direct call to one worker.

The stack is `pdserve up` (one control-plane process, one prefill and one decode `sim` worker as
separate processes, real gRPC and the TCP KV transport between them) with a speed-up so large
that simulated compute is ~0, so what remains is the control plane and the data path. Each
request is a 256-token prompt and 4 output tokens.

- baseline: the decode worker's own `Decode` RPC with local prefill (no router, no ticket);
- local: through the router, prefill forced onto the decode worker (ticket, no transfer);
- disagg: through the router, prefill forced onto the prefill worker (ticket, admit, prefill,
  32 layers of KV over TCP, decode).

Concurrency 1 gives latency percentiles (added = router percentile - baseline percentile, same
run, modes interleaved); concurrency 16 gives requests/s. The headline figures are with tracing
off; the disaggregated path is measured once more with tracing on (every request sampled, spans
exported over OTLP to a collector in this process).

    python bench/overhead.py [--requests 400] [--seconds 8]

Last line: one JSON object with added_p50_ms_disagg_c1, added_p99_ms_disagg_c1,
added_p50_ms_local_c1, rps_disagg_c16, rps_baseline_c16 (and more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
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

MODEL = "llama-3.1-8b"
PROMPT = list(range(1, 257))
MAX_TOKENS = 4


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


class Stack:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.process: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self) -> None:
        argv = [sys.executable, "-m", "pdserve", "up", "--grpc-port", "0", "--http-port", "-1",
                "--speedup", "1e9", "--num-prefill", "1", "--num-decode", "1",
                "--log-level", "WARNING", "--local-prefill-threshold-tokens", "0"]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=self.env)
        assert self.process.stdout is not None
        deadline = time.monotonic() + 60
        for line in self.process.stdout:
            if line.startswith("grpc "):
                self.address = line.split()[1]
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


async def _decode_worker_address(channel: grpc.aio.Channel) -> str:
    stub = pool_pb2_grpc.PoolServiceStub(channel)
    response = await stub.ListWorkers(pool_pb2.ListWorkersRequest(
        deployment=MODEL, role=pb.WORKER_ROLE_DECODE), timeout=10)
    return response.workers[0].address


def make_calls(
    router: router_pb2_grpc.RouterServiceStub, worker: worker_pb2_grpc.WorkerAgentServiceStub
) -> dict[str, Callable[[], Awaitable[None]]]:
    async def via_router(mode: int) -> None:
        count = 0
        async for chunk in router.Generate(router_pb2.GenerateRequest(
            model=MODEL, prompt_token_ids=PROMPT, prefill_mode=mode,
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS)), timeout=30):
            count += len(chunk.token_ids)
        assert count == MAX_TOKENS, count

    async def direct() -> None:
        count = 0
        async for chunk in worker.Decode(worker_pb2.DecodeRequest(
            token=pb.FencingToken(ticket_id=str(uuid.uuid4()), attempt=1),
            prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS),
            is_local_prefill=True, num_blocks=17), timeout=30):
            count += len(chunk.token_ids)
        assert count == MAX_TOKENS, count

    return {
        "baseline": direct,
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


async def measure(env: dict[str, str], args: argparse.Namespace, modes: list[str],
                  with_rps: bool) -> dict[str, object]:
    stack = Stack(env)
    stack.start()
    try:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            worker_address = await _decode_worker_address(channel)
            async with grpc.aio.insecure_channel(worker_address) as worker_channel:
                calls = make_calls(router_pb2_grpc.RouterServiceStub(channel),
                                   worker_pb2_grpc.WorkerAgentServiceStub(worker_channel))
                result: dict[str, object] = {"c1": await latencies_c1(calls, modes, args.requests)}
                if with_rps:
                    result["c16"] = {}
                    for mode in modes:
                        log(f"  c16: {mode}")
                        result["c16"][mode] = await rps(calls[mode], 16, args.seconds)  # type: ignore[index]
                return result
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=400, help="requests per mode at concurrency 1"
    )
    parser.add_argument(
        "--seconds", type=float, default=8.0, help="duration of each concurrency-16 run"
    )
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}

    log("tracing off: baseline, local, disagg")
    off = asyncio.run(measure(env, args, ["baseline", "local", "disagg"], with_rps=True))

    async def traced() -> tuple[dict[str, object], int]:
        sink = OtlpSink()
        endpoint = await sink.start()
        traced_env = dict(env, PDSERVE_OTEL_ENDPOINT=endpoint, PDSERVE_OTEL_SAMPLING_RATIO="1.0")
        try:
            result = await measure(traced_env, args, ["baseline", "disagg"], with_rps=False)
        finally:
            await asyncio.sleep(2)  # let batch exporters flush
            await sink.stop()
        return result, sink.num_spans

    log("tracing on (every request sampled): baseline, disagg")
    on, num_spans = asyncio.run(traced())

    c1_off: dict[str, np.ndarray] = off["c1"]  # type: ignore[assignment]
    c1_on: dict[str, np.ndarray] = on["c1"]  # type: ignore[assignment]
    c16: dict[str, float] = off["c16"]  # type: ignore[assignment]

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q))

    rows = []
    for label, samples in (("tracing off", c1_off), ("tracing on", c1_on)):
        base = samples["baseline"]
        for mode in ("baseline", "local", "disagg"):
            if mode not in samples:
                continue
            values = samples[mode]
            rows.append((label, mode, pct(values, 50), pct(values, 99),
                         pct(values, 50) - pct(base, 50), pct(values, 99) - pct(base, 99),
                         c16.get(mode) if label == "tracing off" else None))
    print(f"{'tracing':<12} {'mode':<9} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} "
          f"{'added p99':>10} {'req/s c16':>10}")
    for label, mode, p50, p99, a50, a99, rate in rows:
        rate_text = f"{rate:10.0f}" if rate is not None else f"{'':>10}"
        print(f"{label:<12} {mode:<9} {p50:8.2f} {p99:8.2f} {a50:10.2f} {a99:10.2f} {rate_text}")
    print(f"(c1: {args.requests} requests per mode, interleaved; c16: {args.seconds:.0f} s per "
          f"mode; spans exported with tracing on: {num_spans})")
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

    base = c1_off["baseline"]
    print(json.dumps({
        "added_p50_ms_disagg_c1": round(pct(c1_off["disagg"], 50) - pct(base, 50), 3),
        "added_p99_ms_disagg_c1": round(pct(c1_off["disagg"], 99) - pct(base, 99), 3),
        "added_p50_ms_local_c1": round(pct(c1_off["local"], 50) - pct(base, 50), 3),
        "added_p99_ms_local_c1": round(pct(c1_off["local"], 99) - pct(base, 99), 3),
        "baseline_p50_ms_c1": round(pct(base, 50), 3),
        "rps_disagg_c16": round(c16["disagg"], 1),
        "rps_local_c16": round(c16["local"], 1),
        "rps_baseline_c16": round(c16["baseline"], 1),
        "added_p50_ms_disagg_c1_tracing_on": round(
            pct(c1_on["disagg"], 50) - pct(c1_on["baseline"], 50), 3),
    }))


if __name__ == "__main__":
    main()
