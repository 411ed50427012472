"""The whole stack on vLLM, shared by the stack tests: coordinator, both pool managers and the
router as their own processes on Redis and Postgres, a prefill and a decode worker (``pdserve serve
worker --engine vllm``) each driving a real vLLM engine (CPU build, the float32 tiny Llama), every
hop real gRPC, the KV over pdserve's transport (``tcp`` or ``nixl``) between vLLM's own KV caches.
Local prefill is off: every prompt is computed by the prefill engine and decoded by the decode
engine.

The reference is one colocated vLLM engine in this process with the same model, dtype, block
size and context (prefix caching off), run before the stack sees any request; a prompt's
reference is computed once per session, by the first module that needs it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
from e2e.conftest import ServiceProcess
from e2e.faults import MODEL, Stack, build_stack, list_workers, wait_router_sees
from helpers.vllm_env import ENGINE_ENVIRONMENT

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.common.grpc_client import channel_target

if TYPE_CHECKING:
    from pdserve.worker.engines.vllm.engine import VllmEngine

BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
NUM_BLOCKS = 160
NUM_GENERATED = 32
LEASE_S = 5.0
WORKER_START_S = 300.0
"""Two engines loading at once on two cores (plus, the first time, this process's reference
engine)."""


def _prompt(length: int, salt: int) -> list[int]:
    rng = np.random.default_rng(2000 + salt)
    return [int(t) for t in rng.integers(3, 1000, size=length)]


CACHED_PREFIX = _prompt(2 * BLOCK_SIZE, 0)
PROMPTS: dict[str, list[int]] = {
    "one_token": _prompt(1, 1),
    "two_tokens": _prompt(2, 2),
    "block_minus_one": _prompt(BLOCK_SIZE - 1, 3),
    "one_block": _prompt(BLOCK_SIZE, 4),
    "block_plus_one": _prompt(BLOCK_SIZE + 1, 5),
    "two_blocks": _prompt(2 * BLOCK_SIZE, 6),
    "seventy_seven": _prompt(77, 7),
    "hundred_thirty": _prompt(130, 8),
    "two_hundred": _prompt(200, 9),
    "three_hundred_one": _prompt(301, 10),
    "near_limit": _prompt(MAX_MODEL_LEN - NUM_GENERATED - 1, 11),
    "prefix_seed": CACHED_PREFIX + _prompt(20, 12),
}
AFTER_SEED = {"decode_has_prefix": CACHED_PREFIX + _prompt(45, 13)}
"""Sent once ``prefix_seed`` is done: the decode engine holds the shared two blocks."""
LAPSE_PROMPT = _prompt(100, 14)
KILL_PROMPT = _prompt(150, 15)
ALL_PROMPTS = {**PROMPTS, **AFTER_SEED, "lapse": LAPSE_PROMPT, "kill": KILL_PROMPT}


@dataclass
class VllmStack:
    stack: Stack
    prefills: list[ServiceProcess]
    decode: ServiceProcess
    reference: dict[str, list[int]]
    seen_loading: bool

    @property
    def prefill(self) -> ServiceProcess:
        return self.prefills[0]

    def workers(self, role: str) -> list[pb.WorkerInfo]:
        wanted = pb.WORKER_ROLE_PREFILL if role == "prefill" else pb.WORKER_ROLE_DECODE
        return [w for w in list_workers(self.stack.pool_address(role))
                if w.role == wanted and w.state != pb.WORKER_STATE_FAILED]

    def worker(self, role: str) -> pb.WorkerInfo:
        (info,) = self.workers(role)
        return info

    async def status(self, role: str) -> worker_pb2.GetStatusResponse:
        return await status_of(self.worker(role))


async def status_of(worker: pb.WorkerInfo) -> worker_pb2.GetStatusResponse:
    target, options = channel_target(worker.address)
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        return await worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
            worker_pb2.GetStatusRequest(), timeout=10)


async def _colocated(engine: VllmEngine, name: str, prompt: list[int]) -> list[int]:
    from pdserve.worker.engines.vllm.engine import GenerationParams

    tokens: list[int] = []
    params = GenerationParams(max_tokens=NUM_GENERATED, ignore_eos=True)
    async for delta in engine.generate(f"ref-{name}", prompt, params):
        tokens.extend(delta.token_ids)
    return tokens


_REFERENCE_OUTPUTS: dict[tuple[str, tuple[int, ...]], list[int]] = {}
"""Colocated outputs computed so far in this session, by (model folder, prompt): the stack
modules share prompts (the nixl module's are among the tcp module's), and a second reference
engine loading beside the workers' engines on two cores cost its module's set-up ~13 s
(nixl set-up 78 s -> 65 s)."""


async def _reference(model_dir: Path, prompts: dict[str, list[int]]
                     ) -> dict[str, list[int]]:
    """The colocated outputs of ``prompts``, by name; only those not computed before in this
    session load an engine."""
    def key(prompt: list[int]) -> tuple[str, tuple[int, ...]]:
        return str(model_dir), tuple(prompt)

    missing = {name: prompt for name, prompt in prompts.items()
               if key(prompt) not in _REFERENCE_OUTPUTS}
    if missing:
        for prompt, tokens in zip(missing.values(), await _colocated_outputs(model_dir, missing),
                                  strict=True):
            _REFERENCE_OUTPUTS[key(prompt)] = tokens
    return {name: list(_REFERENCE_OUTPUTS[key(prompt)]) for name, prompt in prompts.items()}


async def _colocated_outputs(model_dir: Path, prompts: dict[str, list[int]]) -> list[list[int]]:
    from pdserve.worker.engines.vllm.engine import VllmEngine, VllmEngineSettings

    engine = VllmEngine(VllmEngineSettings(
        model_path=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN,
        block_size_tokens=BLOCK_SIZE, num_blocks=NUM_BLOCKS, is_prefix_caching_enabled=False,
        environment={**ENGINE_ENVIRONMENT, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}))
    await engine.start()
    try:
        runs = await asyncio.gather(*(_colocated(engine, name, prompt)
                                      for name, prompt in prompts.items()))
    finally:
        await engine.close()
    return list(runs)


def _start_workers(stack: Stack, model_dir: Path, transport: str, num_prefill: int
                   ) -> tuple[list[ServiceProcess], ServiceProcess, bool]:
    args = ("--engine", "vllm", "--model-path", str(model_dir), "--vllm-dtype", "float32",
            "--vllm-block-size-tokens", str(BLOCK_SIZE), "--vllm-num-blocks", str(NUM_BLOCKS),
            "--vllm-max-model-len", str(MAX_MODEL_LEN), "--vllm-handoff-timeout-s", "20",
            "--transport", transport)
    stack.worker_args = args
    prefills = [stack.start_worker("prefill", f"vllm-prefill-{i}") for i in range(num_prefill)]
    decode = stack.start_worker("decode", "vllm-decode")
    # Registered while vLLM loads: LOADING, until the engine serves.
    seen_loading = False
    deadline = time.monotonic() + WORKER_START_S
    while time.monotonic() < deadline:
        states = {w.state for role in ("prefill", "decode")
                  for w in list_workers(stack.pool_address(role))}
        seen_loading |= pb.WORKER_STATE_LOADING in states
        if states == {pb.WORKER_STATE_READY} and len(states) == 1:
            break
        for process in (*prefills, decode):
            assert process.returncode is None, process.describe()
        time.sleep(0.5)
    for process in (*prefills, decode):
        process.wait_ready(timeout_s=30.0)
    for router in stack.routers:
        wait_router_sees(router, num_prefill, 1, timeout_s=60.0)
    return prefills, decode, seen_loading

async def start_vllm_stack(model_dir: Path, redis_url: str, database_url: str,
                           processes: list[ServiceProcess], transport: str = "tcp",
                           prompts: dict[str, list[int]] | None = None,
                           num_prefill: int = 1) -> VllmStack:
    """The reference outputs of ``prompts`` (default: every prompt here), then the stack with its
    vLLM workers (``num_prefill`` prefill, one decode) READY in the router's view."""
    stack = build_stack(processes, redis_url, database_url, num_prefill=0,
                        num_decode=0, pool_args=("--heartbeat-timeout-s", "10"),
                        router_args=("--lease-s", str(LEASE_S),
                                     "--local-prefill-threshold-tokens", "0",
                                     # Admission sheds on predicted TTFT; these tests check
                                     # the handoff, not shedding on a two-core machine.
                                     "--is-shedding-enabled", "false",
                                     "--transport", transport),
                        extra_env=ENGINE_ENVIRONMENT)
    # The colocated reference loads while the workers' engines do (their start-ups overlap).
    reference, (prefills, decode, seen_loading) = await asyncio.gather(
        _reference(model_dir, ALL_PROMPTS if prompts is None else prompts),
        asyncio.to_thread(_start_workers, stack, model_dir, transport, num_prefill))
    return VllmStack(stack, prefills, decode, reference, seen_loading)
@dataclass
class Reply:
    tokens: list[int]
    final: router_pb2.GenerateResponse | None
    error: grpc.StatusCode | None = None


async def _generate(stack: VllmStack, prompt: list[int], max_tokens: int = NUM_GENERATED,
                    timeout_s: float = 120.0,
                    on_tokens: Callable[[list[int]], Awaitable[None]] | None = None) -> Reply:
    """The request through the first router; ``on_tokens`` is awaited with the tokens so far
    after every streamed message (the stream waits for it)."""
    tokens: list[int] = []
    final = None
    target, options = channel_target(stack.stack.router_addresses[0])
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(
            model=MODEL, prompt_token_ids=prompt, prefill_mode=pb.PREFILL_MODE_REMOTE,
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        try:
            async for message in stub.Generate(request, timeout=timeout_s):
                tokens.extend(message.token_ids)
                final = message
                if on_tokens is not None:
                    await on_tokens(tokens)
        except grpc.aio.AioRpcError as exc:
            return Reply(tokens, final, exc.code())
    return Reply(tokens, final)


async def _wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 30.0,
                    what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if await predicate():
            return
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.2)


def _engine_pids(process: ServiceProcess) -> set[int]:
    return process.descendants()


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""



async def check_token_exact_and_checksummed(vllm_stack: VllmStack) -> None:
    """Every prompt of ``PROMPTS`` then ``AFTER_SEED`` through the stack equals the colocated
    reference token for token; every block's checksum on the decode side equals its source's;
    vLLM's own prompt-token accounting on the decode engine adds up."""
    decode_before = await vllm_stack.status("decode")
    prefill_workers = vllm_stack.workers("prefill")
    decode_id = vllm_stack.worker("decode").worker_id
    replies = dict(zip(PROMPTS, await asyncio.gather(
        *(_generate(vllm_stack, prompt) for prompt in PROMPTS.values())), strict=True))
    replies.update({name: await _generate(vllm_stack, prompt)
                    for name, prompt in AFTER_SEED.items()})

    for name, reply in replies.items():
        assert reply.error is None, (name, reply.error)
        assert reply.tokens == vllm_stack.reference[name], name
        assert len(reply.tokens) == NUM_GENERATED, name
        assert reply.final is not None
        assert reply.final.prefill_worker_id in {w.worker_id for w in prefill_workers}, name
        assert reply.final.decode_worker_id == decode_id, name
        assert not reply.final.timing.is_local_prefill, name

    # Every block's checksum on the decode side equals its source's on the prefill side.
    decode = await vllm_stack.status("decode")
    seen = {(c.token.ticket_id, c.token.attempt) for c in decode_before.kv_checksums}
    landed = [c for c in decode.kv_checksums if (c.token.ticket_id, c.token.attempt) not in seen]
    sent = {(c.token.ticket_id, c.token.attempt): c for w in prefill_workers
            for c in (await status_of(w)).kv_checksums}
    assert len(landed) == len(replies)
    expected_blocks = sorted(
        math.ceil(len(p) / BLOCK_SIZE) - (2 if name == "decode_has_prefix" else 0)
        for name, p in {**PROMPTS, **AFTER_SEED}.items())
    assert sorted(c.num_blocks for c in landed) == expected_blocks
    for checksum in landed:
        source = sent[(checksum.token.ticket_id, checksum.token.attempt)]
        assert list(checksum.block_crc32s) == list(source.block_crc32s)
        assert len(checksum.block_crc32s) == checksum.num_blocks
        assert checksum.crc32 == source.crc32

    # vLLM's own accounting on the decode engine: every prompt token it did not compute came
    # from the transfer (a whole-prompt load still recomputes the last token to sample from,
    # which vLLM counts as transferred; a one-token prompt it recomputes and counts as computed).
    before, after = decode_before.prompt_tokens_by_source, decode.prompt_tokens_by_source
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    prompts = [*PROMPTS.values(), *AFTER_SEED.values()]
    local_hit = 2 * BLOCK_SIZE
    assert delta.get("local_cache_hit", 0) == local_hit
    assert delta["external_kv_transfer"] == sum(len(p) for p in prompts if len(p) > 1) - local_hit
    assert delta.get("local_compute", 0) == sum(1 for p in prompts if len(p) == 1)
