"""Mid-stream failover on real processes with ``tiny`` workers (a real numpy transformer, greedy,
deterministic and batch-invariant, so a continuation re-prefilled elsewhere must reproduce the
uninterrupted output token for token):

- a decode worker SIGKILLed after the client saw its k-th token (k = 1, 3, 7; remote prefill,
  decode-local prefill, and the router's choice): the stream goes on, and the client's tokens are
  exactly the uninterrupted output, nothing repeated or missing; usage counts the original prompt
  and every token;
- a router replica SIGKILLed mid-stream: the client resumes on the other replica with its request
  id and the tokens it had (``resume_token_ids``) and gets exactly the rest;
- past the bounds (a router with ``--max-failovers 0``) the client gets UNAVAILABLE naming the
  request id and how many tokens it was sent;
- afterwards every decode ledger is free (the dead workers' tickets and the cut stream's blocks
  released).

Decode workers pause before each decode step (``--test-decode-step-pause-s``), so the kill lands
between the k-th token and the next; the assertions do not depend on where exactly it lands.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.common import tokenizer

from .conftest import ServiceProcess
from .faults import (
    MODEL,
    Stack,
    build_stack,
    catch_in_phase,
    kill9,
    settled_idle_ledgers,
    wait_router_sees,
)

pytestmark = [pytest.mark.timeout(240)]

NUM_DECODE = 5
"""Four are killed (three k values and the bounds case); one is left to serve."""
MAX_TOKENS = 12
WORKER_ARGS = ("--engine", "tiny", "--max-num-blocks", "128", "--tiny-num-layers", "4",
               "--test-decode-step-pause-s", "0.25")
PROMPT = tuple(random.Random(16).randrange(32, min(127, tokenizer.VOCAB_SIZE))
               for _ in range(100))
"""Printable byte ids; 100 tokens is past the local-prefill threshold (remote by default)."""


@pytest.fixture(scope="module")
def stack(e2e_redis_url: str, e2e_database_url: str,
          processes: list[ServiceProcess]) -> Iterator[Stack]:
    yield build_stack(processes, e2e_redis_url, e2e_database_url, num_replicas=1,
                      num_routers=2, num_prefill=1, num_decode=NUM_DECODE,
                      pool_args=("--heartbeat-timeout-s", "2"), router_args=("--lease-s", "3"),
                      worker_args=WORKER_ARGS)


def _request(request_id: str, mode: int = pb.PREFILL_MODE_UNSPECIFIED,
             resume_token_ids: tuple[int, ...] = ()) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id, model=MODEL, prompt_token_ids=PROMPT, prefill_mode=mode,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS), resume_token_ids=resume_token_ids)


@dataclass
class _Stream:
    token_ids: list[int]
    last: router_pb2.GenerateResponse | None
    error: grpc.aio.AioRpcError | None = None


async def _generate(address: str, request: router_pb2.GenerateRequest, *,
                    kill_after: int = 0, victim_of: object = None) -> _Stream:
    """Stream ``request``; once ``kill_after`` tokens came, ``victim_of()`` is called (in a
    thread) to kill something, and the stream is read on to its end."""
    stream = _Stream([], None)
    async with grpc.aio.insecure_channel(address) as channel:
        call = router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=60)
        try:
            async for chunk in call:
                stream.token_ids.extend(chunk.token_ids)
                stream.last = chunk
                if kill_after and len(stream.token_ids) >= kill_after and victim_of is not None:
                    await asyncio.to_thread(victim_of)  # type: ignore[arg-type]
                    victim_of = None
        except grpc.aio.AioRpcError as exc:
            stream.error = exc
    return stream


def _kill_the_decoding_worker(stack: Stack) -> ServiceProcess:
    live = [w for w in stack.decode_workers if w.returncode is None]
    victim = catch_in_phase(live, "decoding")
    kill9(victim)
    return victim


@pytest.fixture(scope="module")
def uninterrupted(stack: Stack) -> list[int]:
    """The request's output with nothing killed."""
    with grpc.insecure_channel(stack.router_addresses[0]) as channel:
        chunks = list(router_pb2_grpc.RouterServiceStub(channel).Generate(
            _request("baseline"), timeout=60))
    token_ids = [t for chunk in chunks for t in chunk.token_ids]
    assert len(token_ids) == MAX_TOKENS and chunks[-1].timing.num_failovers == 0
    return token_ids


def _wait_gone(stack: Stack, victim: ServiceProcess) -> None:
    """Every router sees the killed worker leave READY (the next request does not start there)."""
    stack.decode_workers.remove(victim)
    for router in stack.routers:
        if router.returncode is None:
            wait_router_sees(router, len(stack.prefill_workers), len(stack.decode_workers))


@pytest.mark.parametrize(("k", "mode"), [(1, pb.PREFILL_MODE_REMOTE),
                                         (3, pb.PREFILL_MODE_LOCAL),
                                         (7, pb.PREFILL_MODE_UNSPECIFIED)])
async def test_greedy_output_survives_its_decode_worker_killed_after_token_k(
        stack: Stack, uninterrupted: list[int], k: int, mode: int) -> None:
    victims: list[ServiceProcess] = []
    stream = await _generate(stack.router_addresses[0], _request(f"failover-{k}", mode),
                             kill_after=k,
                             victim_of=lambda: victims.append(_kill_the_decoding_worker(stack)))
    assert victims, "no decode worker was killed"
    assert stream.error is None, stream.error
    assert stream.token_ids == uninterrupted  # nothing repeated, nothing missing, same tokens
    assert stream.last is not None and stream.last.finish_reason == pb.FINISH_REASON_LENGTH
    assert stream.last.timing.num_failovers == 1
    assert stream.last.usage.prompt_tokens == len(PROMPT)
    assert stream.last.usage.completion_tokens == MAX_TOKENS
    assert stream.last.decode_worker_id  # it ended on a live worker
    await asyncio.to_thread(_wait_gone, stack, victims[0])


async def test_a_client_resumes_on_another_router_replica_by_request_id(
        stack: Stack, uninterrupted: list[int]) -> None:
    victim = stack.routers[0]
    first = await _generate(stack.router_addresses[0], _request("resume-1"), kill_after=3,
                            victim_of=lambda: kill9(victim))
    assert first.error is not None and first.error.code() is grpc.StatusCode.UNAVAILABLE
    assert 3 <= len(first.token_ids) < MAX_TOKENS
    rest = await _generate(stack.router_addresses[1],
                           _request("resume-1", resume_token_ids=tuple(first.token_ids)))
    assert rest.error is None, rest.error
    assert first.token_ids + rest.token_ids == uninterrupted
    assert rest.last is not None and rest.last.finish_reason == pb.FINISH_REASON_LENGTH
    assert rest.last.usage.prompt_tokens == len(PROMPT)
    assert rest.last.usage.completion_tokens == MAX_TOKENS
    # A resume that asks for more than max_tokens is refused, naming the field.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _generate_strict(stack.router_addresses[1],
                               _request("resume-2", resume_token_ids=(65,) * (MAX_TOKENS + 1)))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "resume_token_ids" in (refused.value.details() or "")


async def _generate_strict(address: str, request: router_pb2.GenerateRequest) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        async for _ in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=30):
            pass


async def test_past_the_failover_bounds_the_client_gets_a_clean_error(stack: Stack) -> None:
    stack.router_args = (*stack.router_args, "--max-failovers", "0")
    strict = stack.start_router(len(stack.routers))
    stack.routers.append(strict)
    await asyncio.to_thread(strict.wait_ready)
    await asyncio.to_thread(wait_router_sees, strict, len(stack.prefill_workers),
                            len(stack.decode_workers))
    victims: list[ServiceProcess] = []
    stream = await _generate(strict.grpc_address, _request("bounded"), kill_after=2,
                             victim_of=lambda: victims.append(_kill_the_decoding_worker(stack)))
    assert victims
    assert stream.error is not None and stream.error.code() is grpc.StatusCode.UNAVAILABLE
    details = stream.error.details() or ""
    assert "request bounded" in details
    assert f"after {len(stream.token_ids)} tokens were delivered" in details
    assert "max_failovers" in details
    await asyncio.to_thread(_wait_gone, stack, victims[0])
    # Nothing is left behind: the dead workers' tickets and the cut streams' blocks are free.
    assert not await settled_idle_ledgers(stack)
