"""Overload end to end: ``pdserve up`` with one prefill and one decode sim worker running at
wall-clock speed (Llama-3.1-8B on an A100, 2,048-token prompts: about 0.2 s of prefill each, so
about 5 requests/s), driven at roughly three times that for a few seconds over gRPC and HTTP.

Asserted: every request is answered -- with its tokens or RESOURCE_EXHAUSTED / HTTP 429 -- and
none hangs; every refusal carries a retry hint (gRPC ``retry-after-ms`` and ``RetryInfo``; HTTP
``Retry-After``) and comes back at once, with no prefill work spent on it; most admitted requests
meet the TTFT SLO; and afterwards every decode ledger is free again (no leaked blocks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2, status_pb2

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import (
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    pool_pb2,
    pool_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

from .conftest import ServiceProcess

pytestmark = pytest.mark.timeout(120)

MODEL = "llama-3.1-8b"
NUM_PROMPT_TOKENS = 2048
MAX_TOKENS = 8
SLO_TTFT_MS = 1000.0
RATE_RPS = 15.0
"""About 3x what one simulated A100 prefills per second at this prompt length."""
LOAD_S = 4.0
NO_HANG_S = 30.0
"""An answer later than this counts as a hang (the request deadline)."""
NUM_WARM_UP = 4
SHED_ANSWER_BOUND_S = 5.0
"""A refusal must come back well within this (shedding is immediate; the bound only tells
a refusal from a request that sat in a queue)."""


@pytest.fixture(scope="module")
def stack(processes: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    up = ServiceProcess("pdserve-up", [
        "up", "--grpc-port", "0", "--http-port", "0", "--gpu", "a100-sxm-80gb",
        "--num-prefill", "1", "--num-decode", "1", "--speedup", "1",
        "--slo-ttft-ms", str(SLO_TTFT_MS), "--max-num-blocks", "2048",
    ])
    processes.append(up.start())
    up.wait_ready()
    assert up.grpc_address and up.http_url, f"no addresses announced\n{up.describe()}"
    yield up


@dataclass
class Answer:
    kind: str  # ok, shed, or the gRPC code / HTTP status
    answer_s: float = 0.0
    """Time to the first token or to the error."""
    ttft_s: float = 0.0
    num_tokens: int = 0
    retry_after_ms: int = -1
    has_retry_info: bool = False


def _prompt(rng: np.random.Generator) -> list[int]:
    return rng.integers(32, 127, size=NUM_PROMPT_TOKENS).tolist()


async def _grpc_request(stub: router_pb2_grpc.RouterServiceStub, prompt: list[int]) -> Answer:
    started = time.perf_counter()
    answer = Answer("")
    try:
        async for chunk in stub.Generate(router_pb2.GenerateRequest(
                model=MODEL, prompt_token_ids=prompt,
                sampling=pb.SamplingParams(max_tokens=MAX_TOKENS)), timeout=NO_HANG_S):
            if chunk.token_ids and not answer.num_tokens:
                answer.ttft_s = answer.answer_s = time.perf_counter() - started
            answer.num_tokens += len(chunk.token_ids)
        answer.kind = "ok"
    except grpc.aio.AioRpcError as exc:
        answer.answer_s = answer.answer_s or time.perf_counter() - started
        answer.kind = (
            "shed" if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED else exc.code().name
        )
        for key, value in exc.trailing_metadata() or ():
            if key == "retry-after-ms":
                answer.retry_after_ms = int(value)
            elif key == "grpc-status-details-bin":
                status = status_pb2.Status.FromString(value)
                answer.has_retry_info = any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
                                            for d in status.details)
    return answer


async def _http_request(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> Answer:
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": bytes(prompt).decode("ascii"), "max_tokens": MAX_TOKENS,
    }) as response:
        await response.read()
        answer = Answer("ok" if response.status == 200 else str(response.status),
                        answer_s=time.perf_counter() - started)
        if response.status == 429:
            answer.kind = "shed"
            answer.retry_after_ms = int(response.headers.get("Retry-After", "-1")) * 1000
            answer.has_retry_info = "retry-after-ms" in response.headers
    return answer


async def _overload(stack: ServiceProcess) -> tuple[list[Answer], list[Answer]]:
    """Warm up at a third of capacity, then Poisson arrivals at ``RATE_RPS`` for ``LOAD_S``,
    every fourth one over HTTP."""
    rng = np.random.default_rng(7)
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=NO_HANG_S)) as session:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for _ in range(NUM_WARM_UP):  # the router learns the worker's prefill rate
            assert (await _grpc_request(stub, _prompt(rng))).kind == "ok"
        grpc_tasks, http_tasks = [], []
        started = time.perf_counter()
        next_at = 0.0
        index = 0
        while next_at < LOAD_S:
            await asyncio.sleep(max(0.0, started + next_at - time.perf_counter()))
            if index % 4 == 3:
                http_tasks.append(asyncio.create_task(
                    _http_request(session, stack.http_url, _prompt(rng))))
            else:
                grpc_tasks.append(asyncio.create_task(_grpc_request(stub, _prompt(rng))))
            index += 1
            next_at += rng.exponential(1 / RATE_RPS)
        return list(await asyncio.gather(*grpc_tasks)), list(await asyncio.gather(*http_tasks))


async def _control_plane_state(address: str) -> tuple[list[Any], list[Any], list[Any]]:
    """(decode ledger entries, decode workers, tickets) as the control plane reports them."""
    async with grpc.aio.insecure_channel(address) as channel:
        coordinator = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        ledger = await coordinator.GetLedger(
            kv_transfer_pb2.GetLedgerRequest(deployment=MODEL), timeout=10)
        tickets = await coordinator.ListTickets(
            kv_transfer_pb2.ListTicketsRequest(limit=100_000), timeout=10)
        workers = await pool_pb2_grpc.PoolServiceStub(channel).ListWorkers(
            pool_pb2.ListWorkersRequest(deployment=MODEL, role=pb.WORKER_ROLE_DECODE), timeout=10)
    return list(ledger.entries), list(workers.workers), list(tickets.tickets)


async def test_overload_sheds_at_once_with_retry_hints_and_leaks_nothing(
        stack: ServiceProcess) -> None:
    grpc_answers, http_answers = await _overload(stack)
    answers = grpc_answers + http_answers

    # Nothing hangs, nothing fails otherwise: tokens or a clean refusal.
    assert {a.kind for a in answers} <= {"ok", "shed"}, [a.kind for a in answers]
    ok = [a for a in answers if a.kind == "ok"]
    assert all(a.num_tokens == MAX_TOKENS for a in grpc_answers if a.kind == "ok")

    # At ~3x capacity the router refuses some of them, at once and with a retry hint.
    grpc_shed = [a for a in grpc_answers if a.kind == "shed"]
    http_shed = [a for a in http_answers if a.kind == "shed"]
    assert grpc_shed and http_shed, (len(grpc_shed), len(http_shed))
    assert all(a.retry_after_ms > 0 and a.has_retry_info for a in grpc_shed)
    assert all(a.retry_after_ms >= 1000 and a.has_retry_info for a in http_shed)  # whole seconds
    assert max(a.answer_s for a in grpc_shed + http_shed) < SHED_ANSWER_BOUND_S

    # The admitted ones mostly meet the TTFT SLO (the point of refusing the others early).
    timed = [a for a in grpc_answers if a.kind == "ok"]
    met = sum(a.ttft_s * 1000 <= SLO_TTFT_MS for a in timed)
    assert len(ok) >= 10 and met >= 0.8 * len(timed), sorted(a.ttft_s for a in timed)

    # Afterwards every decode ledger is free again: no reservation or sequence was leaked.
    deadline = time.monotonic() + 15.0
    while True:
        entries, workers, tickets = await _control_plane_state(stack.grpc_address)
        is_free = entries and all(e.num_reserved_blocks == e.num_held_blocks == 0
                                  and e.num_free_blocks == e.num_total_blocks for e in entries)
        is_free = is_free and all(w.load.num_free_blocks == w.load.num_total_blocks
                                  for w in workers)
        if is_free or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert is_free, (entries, [w.load for w in workers])

    # Refused before any work: only the admitted requests (and the warm-up) opened a ticket.
    assert len(tickets) == len(ok) + NUM_WARM_UP, (len(tickets), len(ok))
    assert all(t.state == pb.TICKET_STATE_DONE for t in tickets), {t.state for t in tickets}
