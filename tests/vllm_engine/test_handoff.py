"""Two real vLLM engines (prefill, decode) handing KV over pdserve's connector over nixl (UCX
READs out of the prefill engine's registered cache), the rendezvous through a folder (the
in-process stand-in for the coordinator's). The same handoff over tcp runs through the whole
stack (``test_stack``: token exactness, a lease lapsing mid-transfer with late frames refused),
so the engine pair here takes the transport the stack tests cover least at this level.

The colocated reference is the prefill engine itself, run before any ticket exists (pdserve's
connector leaves requests without a ticket alone) and with its prefix cache reset afterwards.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from helpers.requirements import require_nixl
from helpers.vllm_env import ENGINE_ENVIRONMENT

from pdserve.common.tokenizer import prefix_block_hashes
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.engines.vllm.events import ConnectorEvent, EventKind, EventListener
from pdserve.worker.engines.vllm.exchange import DirectoryDestinationExchange
from pdserve.worker.engines.vllm.prefix_events import KvEventSubscriber, PrefixEventIndex
from pdserve.worker.engines.vllm.protocol import (
    ConnectorSettings,
    RendezvousKind,
    TicketParams,
    TicketRole,
)
from pdserve.worker.transports.registry import get_backend
from pdserve.worker.transports.values import TransferFailedError

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
NUM_BLOCKS = 160
NUM_GENERATED = 32
TIMEOUT_S = 60.0


@dataclass
class Side:
    engine: object  # VllmEngine
    events: list[ConnectorEvent]
    kv_events: KvEventSubscriber

    def of_kind(self, kind: EventKind) -> list[ConnectorEvent]:
        return [e for e in self.events if e.kind is kind]

    def ready(self) -> ConnectorEvent:
        return self.of_kind(EventKind.READY)[-1]


@dataclass
class Pair:
    prefill: Side
    decode: Side
    rendezvous_dir: Path
    reference: dict[str, list[int]]
    transport: str


def _prompt(length: int, salt: int) -> list[int]:
    rng = np.random.default_rng(1000 + salt)
    return [int(t) for t in rng.integers(3, 1000, size=length)]


PROMPTS: dict[str, list[int]] = {
    "one_token": _prompt(1, 1),
    "block_minus_one": _prompt(BLOCK_SIZE - 1, 2),
    "one_block": _prompt(BLOCK_SIZE, 3),
    "block_plus_one": _prompt(BLOCK_SIZE + 1, 4),
    "seventy_seven": _prompt(77, 5),
    "two_hundred": _prompt(200, 6),
    "near_limit": _prompt(MAX_MODEL_LEN - NUM_GENERATED - 3, 7),
}
CACHED_PREFIX = _prompt(2 * BLOCK_SIZE, 8)
PROMPTS["decode_has_prefix"] = CACHED_PREFIX + _prompt(45, 9)
ABORT_PROMPT = _prompt(100, 10)


async def _generate(engine: object, request_id: str, prompt: list[int],
                    ticket: TicketParams | None = None, max_tokens: int = NUM_GENERATED
                    ) -> tuple[list[int], str | None]:
    from pdserve.worker.engines.vllm.engine import GenerationParams

    tokens: list[int] = []
    reason = None
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    async for delta in engine.generate(request_id, prompt, params, ticket):  # type: ignore[attr-defined]
        tokens.extend(delta.token_ids)
        reason = delta.finish_reason or reason
    return tokens, reason


async def _start_side(model_dir: Path, rendezvous_dir: Path, events_path: Path,
                      transport: str) -> Side:
    from pdserve.worker.engines.vllm.engine import VllmEngine, VllmEngineSettings

    events: list[ConnectorEvent] = []
    listener = EventListener(str(events_path), events.append)
    await listener.start()
    connector = ConnectorSettings(rendezvous=RendezvousKind.DIRECTORY,
                                  rendezvous_dir=str(rendezvous_dir),
                                  events_path=str(events_path), transport=transport)
    kv_events = KvEventSubscriber(f"ipc://{events_path}.kv", PrefixEventIndex(BLOCK_SIZE))
    kv_events.start()
    engine = VllmEngine(VllmEngineSettings(
        model_path=model_dir, connector=connector, dtype="float32",
        max_model_len=MAX_MODEL_LEN, block_size_tokens=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
        max_num_seqs=16, max_num_batched_tokens=MAX_MODEL_LEN,
        environment=ENGINE_ENVIRONMENT, kv_events_endpoint=kv_events.endpoint))
    return Side(engine, events, kv_events)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["nixl"])
async def pair(request: pytest.FixtureRequest, tiny_model_dir: Path) -> AsyncIterator[Pair]:
    transport = request.param
    if transport == "nixl":
        require_nixl()
    with tempfile.TemporaryDirectory(prefix="pdserve-vllm-") as scratch:
        root = Path(scratch)
        prefill = await _start_side(tiny_model_dir, root / "rendezvous", root / "prefill.sock",
                                    transport)
        decode = await _start_side(tiny_model_dir, root / "rendezvous", root / "decode.sock",
                                   transport)
        try:
            await asyncio.gather(prefill.engine.start(), decode.engine.start())  # type: ignore[attr-defined]
            runs = await asyncio.gather(*(
                _generate(prefill.engine, f"ref-{name}", prompt)
                for name, prompt in [*PROMPTS.items(), ("abort", ABORT_PROMPT)]))
            reference = {name: tokens for name, (tokens, _) in
                         zip([*PROMPTS, "abort"], runs, strict=True)}
            assert await prefill.engine.reset_prefix_cache()  # type: ignore[attr-defined]
            yield Pair(prefill, decode, root / "rendezvous", reference, transport)
        finally:
            await asyncio.gather(prefill.engine.close(), decode.engine.close())  # type: ignore[attr-defined]
            await asyncio.gather(prefill.kv_events.close(), decode.kv_events.close())


async def _wait_for(predicate: object, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def _handoff(pair: Pair, name: str, prompt: list[int]) -> tuple[str, list[int], str]:
    token = FencingToken.new()
    decode = asyncio.create_task(_generate(
        pair.decode.engine, f"dec-{name}", prompt,
        TicketParams(TicketRole.DECODE, token, TIMEOUT_S)))
    first, _ = await _generate(pair.prefill.engine, f"pre-{name}", prompt,
                               TicketParams(TicketRole.PREFILL, token, TIMEOUT_S))
    assert len(first) == 1  # the prefill engine computes the prompt only
    tokens, reason = await decode
    return str(token), tokens, reason or ""


async def test_handoff_matches_colocated_token_for_token(pair: Pair) -> None:
    decode_engine = pair.decode.engine
    # Put two blocks of one prompt's prefix into the decode side's prefix cache first.
    await _generate(decode_engine, "warm-prefix", CACHED_PREFIX, max_tokens=1)
    before = decode_engine.prompt_tokens_by_source()  # type: ignore[attr-defined]

    runs = await asyncio.gather(*(_handoff(pair, name, prompt)
                                  for name, prompt in PROMPTS.items()))

    for name, (_, tokens, reason) in zip(PROMPTS, runs, strict=True):
        assert tokens == pair.reference[name], name
        assert len(tokens) == NUM_GENERATED and reason == "length", name
    await _wait_for(lambda: len(pair.prefill.of_kind(EventKind.SENT)) >= len(PROMPTS))
    sent = {e.token: e for e in pair.prefill.of_kind(EventKind.SENT)}
    received = {e.token: e for e in pair.decode.of_kind(EventKind.RECEIVED)}
    for (name, prompt), (token, _, _) in zip(PROMPTS.items(), runs, strict=True):
        local_blocks = 2 if name == "decode_has_prefix" else 0
        num_blocks = math.ceil(len(prompt) / BLOCK_SIZE) - local_blocks
        assert received[token].num_blocks == sent[token].num_blocks == num_blocks, name
        assert received[token].block_crc32s == sent[token].block_crc32s, name
        assert len(received[token].block_crc32s) == num_blocks
        assert received[token].crc32 == sent[token].crc32, name
        _check_timeline(sent[token], name)

    after = decode_engine.prompt_tokens_by_source()  # type: ignore[attr-defined]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # vLLM counts a load of the whole prompt as external although it recomputes the last
    # token to sample from it; a 1-token prompt it recomputes whole and counts as computed.
    local_hit = 2 * BLOCK_SIZE
    num_single = sum(1 for p in PROMPTS.values() if len(p) == 1)
    num_loaded = sum(len(p) for p in PROMPTS.values() if len(p) > 1) - local_hit
    assert delta["local_cache_hit"] == local_hit
    assert delta["external_kv_transfer"] == num_loaded
    assert delta["local_compute"] == num_single
    assert not pair.decode.of_kind(EventKind.FAILED)


def _check_timeline(sent: ConnectorEvent, name: str) -> None:
    """The layer-wise timeline of one handoff is whole and ordered: each layer's KV was final
    before it was sent, layers finish in order, DONE came after every layer left, and the
    exposed time is DONE minus the end of compute."""
    computed, layer_sent = sent.layer_computed_s, sent.layer_sent_s
    assert len(computed) == len(layer_sent) == sent.num_layers, name
    assert all(t > 0 for t in computed), name
    assert list(computed) == sorted(computed), name
    assert all(s >= c for s, c in zip(layer_sent, computed, strict=True)), name
    assert sent.done_s >= max(layer_sent), name
    assert sent.exposed_s == pytest.approx(sent.done_s - max(computed)), name


async def test_abort_mid_transfer_frees_blocks_refuses_late_frames_caches_nothing(
        pair: Pair) -> None:
    decode_engine = pair.decode.engine
    await _wait_for(lambda: decode_engine.load().num_running_seqs == 0)  # type: ignore[attr-defined]
    idle_free = decode_engine.load().num_free_blocks  # type: ignore[attr-defined]
    token = FencingToken.new()
    decode = asyncio.create_task(_generate(
        decode_engine, "dec-abort", ABORT_PROMPT,
        TicketParams(TicketRole.DECODE, token, TIMEOUT_S)))
    exchange = DirectoryDestinationExchange(pair.rendezvous_dir)
    destination = await exchange.wait(token, TIMEOUT_S)
    assert destination is not None
    assert len(destination.block_ids) == math.ceil(len(ABORT_PROMPT) / BLOCK_SIZE)
    ready = pair.decode.ready()
    layout = KvLayout(num_layers=ready.num_layers, num_blocks=NUM_BLOCKS,
                      block_size_tokens=BLOCK_SIZE, block_nbytes=ready.block_nbytes)
    garbage = KvCache(layout)
    for buffer in garbage.layer_buffers:
        buffer[:] = np.random.default_rng(0).integers(0, 256, size=buffer.shape, dtype=np.uint8)
    src = list(range(len(destination.block_ids)))
    backend = get_backend(pair.transport)
    sender = backend.create_sender(garbage)
    await sender.open(destination, token)
    await sender.offer_layer(0, src)  # half of the layers land, then the request is aborted
    await sender.offer_layer(1, src)
    await asyncio.sleep(0.2)
    num_rejections = max((e.num_rejections for e in pair.decode.of_kind(EventKind.REJECTED)),
                         default=0)
    await decode_engine.abort("dec-abort")  # type: ignore[attr-defined]
    tokens, reason = await asyncio.wait_for(decode, TIMEOUT_S)
    assert reason == "abort" and not tokens
    await _wait_for(lambda: any(e.token == str(token)
                                for e in pair.decode.of_kind(EventKind.FAILED)))
    await _wait_for(lambda: decode_engine.load().num_free_blocks == idle_free)  # type: ignore[attr-defined]

    await sender.close()
    late = backend.create_sender(garbage)  # a late sender of the same ticket
    with pytest.raises(TransferFailedError):
        await late.open(destination, token)  # nixl: refused at its HELLO; tcp: at a layer
        await late.offer_layers(range(layout.num_layers), src)
        await late.finish(0, 0.0)
    await late.close()
    await _wait_for(lambda: max((e.num_rejections for e in
                                 pair.decode.of_kind(EventKind.REJECTED)), default=0)
                    > num_rejections)

    # Nothing half-written was cached: the same prompt, colocated on the decode engine (it
    # would reuse any cached block) and handed over again, gives the reference output.
    local, _ = await _generate(decode_engine, "local-after-abort", ABORT_PROMPT)
    assert local == pair.reference["abort"]
    _, handed, _ = await _handoff(pair, "after-abort", ABORT_PROMPT)
    assert handed == pair.reference["abort"]


async def test_prompt_past_the_context_is_invalid_argument(pair: Pair) -> None:
    from pdserve.common.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as caught:
        await _generate(pair.decode.engine, "too-long", _prompt(MAX_MODEL_LEN, 11))
    assert caught.value.field == "prompt"


async def test_capacity_and_load_are_vllms_own(pair: Pair) -> None:
    engine = pair.decode.engine
    capacity = engine.capacity  # type: ignore[attr-defined]
    assert capacity.num_blocks == NUM_BLOCKS - 1  # vLLM keeps one null block
    assert capacity.block_size_tokens == BLOCK_SIZE
    ready = pair.decode.ready()
    assert ready.num_total_blocks == NUM_BLOCKS and ready.block_size_tokens == BLOCK_SIZE
    await _wait_for(lambda: engine.load().num_running_seqs == 0)  # type: ignore[attr-defined]
    idle = engine.load()  # type: ignore[attr-defined]
    assert idle.num_total_blocks == capacity.num_blocks
    task = asyncio.create_task(_generate(engine, "load-probe", _prompt(300, 12), max_tokens=48))
    await _wait_for(lambda: engine.load().num_running_seqs == 1)  # type: ignore[attr-defined]
    busy = engine.load()  # type: ignore[attr-defined]
    assert busy.num_free_blocks <= idle.num_free_blocks - math.ceil(300 / BLOCK_SIZE)
    await task


async def test_kv_events_name_the_prefixes_vllm_caches_under_the_routers_hashes(
        pair: Pair) -> None:
    # The decode engine: it caches what it computed and what it received, and says so in its
    # KV events; the index names each block with the hash the router computes for the prompt.
    engine, index = pair.decode.engine, pair.decode.kv_events.index
    prompt = _prompt(3 * BLOCK_SIZE + 5, 20)
    await _generate(engine, "events-local", prompt, max_tokens=1)
    local = set(prefix_block_hashes(prompt, BLOCK_SIZE))
    assert len(local) == 3
    await _wait_for(lambda: local <= set(index.all_hashes()))

    handed = _prompt(2 * BLOCK_SIZE + 7, 21)
    _, tokens, _ = await _handoff(pair, "events-handed", handed)
    assert len(tokens) == NUM_GENERATED
    received = set(prefix_block_hashes(handed, BLOCK_SIZE))
    await _wait_for(lambda: received <= set(index.all_hashes()))

    await _wait_for(lambda: engine.load().num_running_seqs == 0)  # type: ignore[attr-defined]
    assert await engine.reset_prefix_cache()  # type: ignore[attr-defined]
    # vLLM publishes a step's events with the step: one more (short) request flushes the reset.
    await _generate(engine, "events-flush", _prompt(3, 22), max_tokens=1)
    await _wait_for(lambda: not (local | received) & set(index.all_hashes()))
    assert pair.decode.kv_events.num_gaps == 0
