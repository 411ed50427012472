"""Goodput under overload: what early load shedding buys.

The stack is ``pdserve up`` (control plane in one process, sim workers as separate processes,
real gRPC and the TCP KV transport) with the sim GPUs slowed to wall-clock speed (``--speedup 1``)
and sized so that they, not the control plane, are the bottleneck: Llama-3.1-8B on A100-80GB,
2 prefill and 2 decode workers, 2,048-token prompts (about 0.19 s of prefill each by the
calibrated roofline) and 16 output tokens. SLOs: TTFT 1,000 ms, TPOT 100 ms.

1. Capacity: open-loop Poisson load at increasing rates for ``--sweep-s`` seconds each; the
   capacity is the highest rate at which at least 95% of the requests meet both SLOs (a shed
   request counts as a miss).
2. Load at 1x and 3x that capacity for ``--seconds`` each (Poisson arrivals, open loop: the
   arrival process does not slow down when the server does). Goodput = requests per second that
   met both SLOs. Shed requests get RESOURCE_EXHAUSTED with a ``retry-after-ms`` hint; the time
   to that answer is reported too (shedding must be immediate).
3. Fairness: 3x load again, from two tenants (API keys mapped to tenants), one sending ten times
   the other's rate; the light tenant should keep its goodput near its demand. For contrast, the
   same with the fair-share band switched off (``--fair-share-onset 1``: shedding blind to
   tenants).
4. The same 3x load on a second stack with shedding disabled (``--is-shedding-enabled false``;
   the in-flight caps and the decode KV-room check still apply).

    python bench/overload.py [--seconds 30] [--sweep-s 10]

Last line: one JSON object with capacity_rps, goodput_1x, goodput_3x, goodput_3x_no_shedding,
shed_fraction_3x (and more). ``measure_goodput(load_multiplier)`` runs one point (starting its
own stack and measuring the capacity once per process unless given), for other benches to reuse.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, router_pb2, router_pb2_grpc


@dataclass(frozen=True, slots=True)
class Workload:
    """The stack and the requests. The defaults make the simulated GPUs the bottleneck."""

    model: str = "llama-3.1-8b"
    gpu: str = "a100-sxm-80gb"
    num_prefill: int = 2
    num_decode: int = 2
    speedup: float = 1.0
    num_prompt_tokens: int = 2048
    max_tokens: int = 16
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    request_timeout_s: float = 60.0
    """A request with no answer by then counts as hung."""


WORKLOAD = Workload()
_seeds = itertools.count(1)
"""Every run draws new prompts: a repeated prompt would hit the prefill workers' prefix cache."""
TENANT_KEYS = {"heavy": "bench-heavy-tenant-key-0001", "light": "bench-light-tenant-key-0002"}
GOOD_FRACTION = 0.95
"""Capacity = the highest swept rate at which this fraction of requests meets both SLOs."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the stack --------------------------------------------------------------------------------


class Stack:
    """``pdserve up`` as a child process (and its workers, which it stops on SIGTERM)."""

    def __init__(self, workload: Workload, is_shedding_enabled: bool,
                 tenant_keys: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()
                 ) -> None:
        self.workload = workload
        self.is_shedding_enabled = is_shedding_enabled
        self.tenant_keys = tenant_keys
        self.extra_args = extra_args
        self.process: subprocess.Popen[str] | None = None
        self.address = ""
        self._keys_dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> Stack:
        w = self.workload
        argv = [sys.executable, "-m", "pdserve", "up", "--grpc-port", "0", "--http-port", "-1",
                "--model", w.model, "--gpu", w.gpu, "--num-prefill", str(w.num_prefill),
                "--num-decode", str(w.num_decode), "--speedup", str(w.speedup),
                "--slo-ttft-ms", str(w.slo_ttft_ms), "--slo-tpot-ms", str(w.slo_tpot_ms),
                "--is-shedding-enabled", str(self.is_shedding_enabled).lower(),
                "--log-level", "WARNING", *self.extra_args]
        if self.tenant_keys:
            self._keys_dir = tempfile.TemporaryDirectory(prefix="pdserve-bench-")
            path = Path(self._keys_dir.name) / "api_keys"
            path.write_text(
                "".join(f"{key} {tenant}\n" for tenant, key in self.tenant_keys.items())
            )
            argv += ["--api-keys-path", str(path)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "OTEL_"))}
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env=env)
        assert self.process.stdout is not None
        deadline = time.monotonic() + 90
        for line in self.process.stdout:
            if line.startswith("grpc "):
                self.address = line.split()[1]
            if line.startswith("ready"):
                return self
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("pdserve up did not become ready")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._keys_dir is not None:
            self._keys_dir.cleanup()


@contextmanager
def running_stack(workload: Workload, is_shedding_enabled: bool,
                  tenant_keys: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()
                  ) -> Iterator[Stack]:
    stack = Stack(workload, is_shedding_enabled, tenant_keys, extra_args).start()
    try:
        yield stack
    finally:
        stack.stop()


# -- load -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it. Times in seconds from its start."""

    status: str = ""
    """ok, shed (RESOURCE_EXHAUSTED), hung (no answer in time) or the gRPC code name."""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    answer_s: float = 0.0
    """Time to the first answer: first token, or the error."""
    retry_after_ms: int = -1
    num_tokens: int = 0


@dataclass(slots=True)
class Run:
    rate_rps: float
    duration_s: float
    outcomes: list[Outcome] = field(default_factory=list)


async def _one(stub: router_pb2_grpc.RouterServiceStub, prompt: list[int], workload: Workload,
               outcome: Outcome, metadata: tuple[tuple[str, str], ...]) -> None:
    started = time.perf_counter()
    first = last = 0.0
    request = router_pb2.GenerateRequest(model=workload.model, prompt_token_ids=prompt,
                                         sampling=pb.SamplingParams(max_tokens=workload.max_tokens))
    try:
        async for chunk in stub.Generate(request, timeout=workload.request_timeout_s,
                                         metadata=metadata):
            if chunk.token_ids:
                last = time.perf_counter()
                if not first:
                    first = last
                outcome.num_tokens += len(chunk.token_ids)
        outcome.status = "ok" if outcome.num_tokens == workload.max_tokens else "truncated"
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            outcome.status = "shed"
            for key, value in exc.trailing_metadata() or ():
                if key == "retry-after-ms":
                    outcome.retry_after_ms = int(value)
        elif code is grpc.StatusCode.DEADLINE_EXCEEDED and not first:
            outcome.status = "hung"
        else:
            outcome.status = code.name
    now = time.perf_counter()
    outcome.answer_s = (first or now) - started
    if first:
        outcome.ttft_s = first - started
        outcome.tpot_s = (last - first) / max(1, outcome.num_tokens - 1)


async def run_load(address: str, rate_rps: float, duration_s: float,
                   workload: Workload = WORKLOAD, seed: int | None = None,
                   api_key: str | None = None) -> Run:
    """Poisson arrivals at ``rate_rps`` for ``duration_s``, open loop; waits for every answer.
    ``api_key`` is sent as ``authorization: Bearer`` (it picks the tenant)."""
    rng = np.random.default_rng(next(_seeds) if seed is None else seed)
    run = Run(rate_rps, duration_s)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        tasks = []
        start = time.perf_counter()
        next_at = rng.exponential(1 / rate_rps)
        while next_at < duration_s:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # Distinct random prompts: no prefix-cache hits make a request cheaper.
            prompt = rng.integers(32, 127, size=workload.num_prompt_tokens).tolist()
            outcome = Outcome()
            run.outcomes.append(outcome)
            tasks.append(asyncio.create_task(_one(stub, prompt, workload, outcome, metadata)))
            next_at += rng.exponential(1 / rate_rps)
        await asyncio.gather(*tasks)
    return run


async def run_tenants(address: str, rate_by_key: dict[str, float], duration_s: float,
                      workload: Workload = WORKLOAD) -> list[Run]:
    """One ``run_load`` per API key, at the same time."""
    return list(await asyncio.gather(*(
        run_load(address, rate, duration_s, workload, api_key=key)
        for key, rate in rate_by_key.items())))


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(run: Run, workload: Workload = WORKLOAD) -> dict[str, float]:
    """Goodput and the rest of one run. Times in milliseconds, rates per second."""
    outcomes = run.outcomes
    ok = [o for o in outcomes if o.status == "ok"]
    good = [o for o in ok if o.ttft_s * 1000 <= workload.slo_ttft_ms
            and o.tpot_s * 1000 <= workload.slo_tpot_ms]
    shed = [o for o in outcomes if o.status == "shed"]
    num = max(1, len(outcomes))
    return {
        "rate_rps": run.rate_rps,
        "num_requests": len(outcomes),
        "goodput_rps": len(good) / run.duration_s,
        "slo_fraction": len(good) / num,
        "num_ok": len(ok),
        "shed_fraction": len(shed) / num,
        "num_failed_other": sum(o.status not in ("ok", "shed", "hung") for o in outcomes),
        "num_hung": sum(o.status == "hung" for o in outcomes),
        "ttft_p50_ms": _pct([o.ttft_s * 1000 for o in ok], 50),
        "ttft_p99_ms": _pct([o.ttft_s * 1000 for o in ok], 99),
        "tpot_p99_ms": _pct([o.tpot_s * 1000 for o in ok], 99),
        "shed_answer_p99_ms": _pct([o.answer_s * 1000 for o in shed], 99),
        "retry_after_p50_ms": _pct([o.retry_after_ms for o in shed if o.retry_after_ms >= 0], 50),
        "num_shed_without_hint": sum(o.retry_after_ms < 0 for o in shed),
    }


async def leaked_blocks(address: str, model: str) -> int:
    """Blocks the decode ledger still counts reserved or held (0 once everything finished)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        ledger = await stub.GetLedger(kv_transfer_pb2.GetLedgerRequest(deployment=model),
                                      timeout=10)
    return sum(e.num_reserved_blocks + e.num_held_blocks for e in ledger.entries)


# -- capacity and goodput ---------------------------------------------------------------------


def estimated_rate_rps(workload: Workload = WORKLOAD) -> float:
    """What the prefill pool can do by the performance model (the sweep's centre)."""
    from pdserve.perf.perf_model import perf_model_for

    prefill_s = perf_model_for(workload.model, workload.gpu).prefill_time_s(
        [workload.num_prompt_tokens]) / workload.speedup
    return workload.num_prefill / prefill_s


def warm_up(address: str, workload: Workload = WORKLOAD) -> None:
    """A few seconds of moderate load: channels open, every worker's prefill rate learned."""
    asyncio.run(run_load(address, 0.5 * estimated_rate_rps(workload), 4.0, workload))


def measure_capacity(address: str, workload: Workload = WORKLOAD, sweep_s: float = 10.0
                     ) -> tuple[float, list[dict[str, float]]]:
    """The highest swept rate at which ``GOOD_FRACTION`` of requests meet both SLOs."""
    estimate = estimated_rate_rps(workload)
    rows = []
    capacity = 0.0
    for fraction in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1):
        rate = round(fraction * estimate, 2)
        row = summarize(asyncio.run(run_load(address, rate, sweep_s, workload)), workload)
        rows.append(row)
        log(f"  sweep {rate:6.2f} rps: {row['slo_fraction']:.1%} met the SLOs, "
            f"shed {row['shed_fraction']:.1%}, ttft p99 {row['ttft_p99_ms']:.0f} ms")
        if row["slo_fraction"] >= GOOD_FRACTION:
            capacity = rate
        elif capacity:
            break
    if not capacity:
        raise RuntimeError("no swept rate met the SLOs: is the machine overloaded?")
    return capacity, rows


_capacity_cache: dict[Workload, float] = {}


def measure_goodput(load_multiplier: float, *, capacity_rps: float | None = None,
                    duration_s: float = 30.0, is_shedding_enabled: bool = True,
                    address: str | None = None, workload: Workload = WORKLOAD
                    ) -> dict[str, float]:
    """Goodput (requests/s meeting both SLOs) at ``load_multiplier`` x capacity, Poisson arrivals
    for ``duration_s``. Without ``address`` a stack is started (and stopped; shedding as
    ``is_shedding_enabled`` says, which is ignored with an ``address``); without
    ``capacity_rps`` the capacity is measured first (once per process and workload). The dict
    holds ``summarize``'s figures plus ``capacity_rps``, ``load_multiplier`` and
    ``leaked_blocks`` (ledger blocks still reserved or held afterwards; 0 is right)."""
    if address is None:
        with running_stack(workload, is_shedding_enabled) as stack:
            return measure_goodput(load_multiplier, capacity_rps=capacity_rps,
                                   duration_s=duration_s, address=stack.address,
                                   workload=workload)
    if capacity_rps is None:
        if workload not in _capacity_cache:
            warm_up(address, workload)
            _capacity_cache[workload], _ = measure_capacity(address, workload)
        capacity_rps = _capacity_cache[workload]
    run = asyncio.run(run_load(address, load_multiplier * capacity_rps, duration_s, workload))
    result = summarize(run, workload)
    time.sleep(1.0)  # the decode workers' releases reach the ledger
    result.update(capacity_rps=capacity_rps, load_multiplier=load_multiplier,
                  leaked_blocks=asyncio.run(leaked_blocks(address, workload.model)))
    return result


def measure_fairness(capacity_rps: float, duration_s: float, workload: Workload = WORKLOAD,
                     is_fair: bool = True) -> dict[str, dict[str, float]]:
    """3x capacity from two tenants, ``heavy`` at ten times ``light``'s rate, on a stack of its
    own (API keys for the two); ``is_fair=False`` switches the fair-share band off."""
    extra = () if is_fair else ("--fair-share-onset", "1")
    total = 3.0 * capacity_rps
    rates = {"heavy": total * 10 / 11, "light": total / 11}
    with running_stack(workload, True, TENANT_KEYS, extra) as stack:
        asyncio.run(run_tenants(stack.address, {TENANT_KEYS[t]: 0.5 * r for t, r in rates.items()},
                                4.0, workload))  # warm-up
        runs = asyncio.run(run_tenants(stack.address, {TENANT_KEYS[t]: r for t, r in rates.items()},
                                       duration_s, workload))
        time.sleep(1.0)
        leaked = asyncio.run(leaked_blocks(stack.address, workload.model))
    results = {}
    for tenant, run in zip(rates, runs, strict=True):
        results[tenant] = summarize(run, workload)
        results[tenant]["leaked_blocks"] = leaked
    return results


# -- main -------------------------------------------------------------------------------------


def _table(rows: list[tuple[str, dict[str, float]]]) -> str:
    columns = [("rate_rps", "rate/s", "{:.2f}"), ("num_requests", "requests", "{:.0f}"),
               ("goodput_rps", "goodput/s", "{:.2f}"), ("slo_fraction", "met SLO", "{:.1%}"),
               ("shed_fraction", "shed", "{:.1%}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
               ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"), ("tpot_p99_ms", "TPOT p99 ms", "{:.0f}"),
               ("shed_answer_p99_ms", "shed answer p99 ms", "{:.0f}"),
               ("retry_after_p50_ms", "retry hint p50 ms", "{:.0f}"),
               ("num_hung", "hung", "{:.0f}"), ("num_failed_other", "other errors", "{:.0f}"),
               ("leaked_blocks", "leaked blocks", "{:.0f}")]
    header = ["run"] + [title for _, title, _ in columns]
    body = [[name] + [fmt.format(row.get(key, float("nan"))) for key, _, fmt in columns]
            for name, row in rows]
    widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(widths[i]) for i, c in enumerate(r)) for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="Duration of each load run.")
    parser.add_argument("--sweep-s", type=float, default=10.0, help="Duration of each sweep point.")
    args = parser.parse_args()
    workload = WORKLOAD
    started = time.monotonic()
    log(f"stack: {workload}")
    rows: list[tuple[str, dict[str, float]]] = []
    with running_stack(workload, is_shedding_enabled=True) as stack:
        warm_up(stack.address, workload)
        log(f"capacity sweep (estimate from the perf model {estimated_rate_rps(workload):.2f} rps)")
        capacity, _ = measure_capacity(stack.address, workload, args.sweep_s)
        log(f"capacity {capacity:.2f} rps")
        for multiplier in (1.0, 3.0):
            result = measure_goodput(multiplier, capacity_rps=capacity, duration_s=args.seconds,
                                     address=stack.address, workload=workload)
            rows.append((f"{multiplier:g}x shedding", result))
            log(f"  {multiplier:g}x: goodput {result['goodput_rps']:.2f} rps")
    for is_fair in (True, False):
        name = "fair share" if is_fair else "tenant-blind"
        for tenant, result in measure_fairness(capacity, args.seconds, workload, is_fair).items():
            rows.append((f"3x {name}: {tenant}", result))
        log(f"  3x {name}: light tenant met the SLOs for {result['slo_fraction']:.1%}")
    with running_stack(workload, is_shedding_enabled=False) as stack:
        warm_up(stack.address, workload)
        result = measure_goodput(3.0, capacity_rps=capacity, duration_s=args.seconds,
                                 address=stack.address, workload=workload)
        rows.append(("3x no shedding", result))
    print(f"pdserve up: {workload.num_prefill} prefill + {workload.num_decode} decode sim workers, "
          f"{workload.model} on {workload.gpu}, speedup {workload.speedup:g}; prompts "
          f"{workload.num_prompt_tokens} tokens, {workload.max_tokens} output tokens; SLO TTFT "
          f"{workload.slo_ttft_ms:.0f} ms, TPOT {workload.slo_tpot_ms:.0f} ms")
    print(f"capacity (highest rate with >= {GOOD_FRACTION:.0%} of requests meeting both SLOs): "
          f"{capacity:.2f} requests/s; Poisson arrivals, {args.seconds:.0f} s per run; "
          f"two-tenant runs: heavy sends 10x light's rate, 3x capacity in all")
    print(_table(rows))
    by_name = dict(rows)
    one, three, blind = by_name["1x shedding"], by_name["3x shedding"], by_name["3x no shedding"]
    print(f"goodput 3x / 1x: {three['goodput_rps'] / max(1e-9, one['goodput_rps']):.2f} with "
          f"shedding, {blind['goodput_rps'] / max(1e-9, one['goodput_rps']):.2f} without "
          f"({time.monotonic() - started:.0f} s)")
    print(json.dumps({
        "capacity_rps": capacity,
        "goodput_1x": round(one["goodput_rps"], 3),
        "goodput_3x": round(three["goodput_rps"], 3),
        "goodput_3x_no_shedding": round(blind["goodput_rps"], 3),
        "shed_fraction_3x": round(three["shed_fraction"], 4),
        "shed_fraction_3x_no_shedding": round(blind["shed_fraction"], 4),
        "ttft_p50_ms_3x": round(three["ttft_p50_ms"], 1),
        "ttft_p99_ms_3x": round(three["ttft_p99_ms"], 1),
        "ttft_p99_ms_3x_no_shedding": round(blind["ttft_p99_ms"], 1),
        "shed_answer_p99_ms_3x": round(three["shed_answer_p99_ms"], 1),
        "light_tenant_slo_fraction_3x": round(by_name["3x fair share: light"]["slo_fraction"], 4),
        "heavy_tenant_shed_fraction_3x": round(by_name["3x fair share: heavy"]["shed_fraction"], 4),
        "light_tenant_slo_fraction_3x_blind": round(
            by_name["3x tenant-blind: light"]["slo_fraction"], 4),
        "hung": int(sum(r["num_hung"] for _, r in rows)),
        # (The two rows of a two-tenant run share one stack and one ledger count.)
        "leaked_blocks": int(sum(r["leaked_blocks"] for name, r in rows
                                 if not name.endswith(": light"))),
    }))


if __name__ == "__main__":
    main()
