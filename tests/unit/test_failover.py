"""Mid-stream failover (``router.failover``): the continuation's request, the bounds, and the
router core failing a broken stream over to another decode worker (fake worker clients whose
"engine" is a deterministic function of the sequence so far, so a continuation must equal the
uninterrupted output). The same on real processes and the tiny engine: tests/e2e/test_failover.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import REGISTRY

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2
from pdserve.common.clock import ManualClock
from pdserve.common.errors import (
    InvalidArgumentError,
    PdserveError,
    UnavailableError,
)
from pdserve.common.types import (
    FencingToken,
    TicketSpec,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)
from pdserve.router.core import Router, RouterConfig
from pdserve.router.failover import (
    FailoverBudget,
    FailoverLimits,
    FailoverOutcome,
    gave_up,
    is_resumable,
    resumed_request,
    resumed_seed,
)
from pdserve.router.pool_view import PoolView
from pdserve.router.types import FinishReason, GenerationChunk, GenerationRequest, PrefillMode

PROMPT = tuple(range(40, 60))
REQUEST = GenerationRequest(request_id="r1", model="m", prompt_token_ids=PROMPT, max_tokens=10,
                            prefill_mode=PrefillMode.LOCAL)


# -- the pure parts --------------------------------------------------------------------------


def test_the_continuation_asks_for_the_missing_tokens_after_the_delivered_ones() -> None:
    segment = resumed_request(REQUEST, (1, 2, 3))
    assert segment.prompt_token_ids == (*PROMPT, 1, 2, 3)
    assert segment.max_tokens == 7
    assert segment.request_id == "r1" and segment.prefill_mode is PrefillMode.LOCAL
    assert resumed_request(REQUEST, ()) == REQUEST
    client_resume = GenerationRequest(request_id="r1", model="m", prompt_token_ids=PROMPT,
                                      max_tokens=10, resume_token_ids=(5, 6))
    assert resumed_request(client_resume, (5, 6)).resume_token_ids == ()


def test_a_seeded_continuation_moves_its_seed_on_an_unseeded_one_stays_unseeded() -> None:
    assert resumed_seed(0, 5) == 0
    assert resumed_seed(42, 0) == 42
    assert resumed_seed(42, 5) == resumed_seed(42, 5)  # the same break, the same continuation
    assert len({42, resumed_seed(42, 5), resumed_seed(42, 6), resumed_seed(43, 5)}) == 4
    assert 0 < resumed_seed(42, 5) < 2**63
    seeded = GenerationRequest(request_id="r", model="m", prompt_token_ids=(1,), max_tokens=4,
                               temperature=0.7, seed=42)
    assert resumed_request(seeded, (9,)).seed == resumed_seed(42, 1)


def test_the_budget_counts_failovers_and_their_time() -> None:
    clock = ManualClock(100.0)
    budget = FailoverBudget(FailoverLimits(max_failovers=2, max_failover_s=5.0), clock)
    assert budget.begin() is None and budget.is_failing_over
    clock.advance(3.0)
    assert budget.remaining_s() == pytest.approx(2.0)
    budget.settle()
    assert not budget.is_failing_over
    clock.advance(60.0)  # streaming time is not failover time
    assert budget.remaining_s() == pytest.approx(2.0)
    assert budget.begin() is None
    clock.advance(2.5)
    assert budget.remaining_s() < 0
    budget.settle()
    assert budget.begin() is FailoverOutcome.MAX_FAILOVERS
    timed = FailoverBudget(FailoverLimits(max_failovers=5, max_failover_s=1.0), clock)
    assert timed.begin() is None
    clock.advance(1.5)
    timed.settle()
    assert timed.begin() is FailoverOutcome.MAX_TIME
    assert timed.num_failovers == 1


def test_giving_up_names_the_request_and_the_tokens_delivered() -> None:
    error = gave_up("req-7", 4, FailoverOutcome.MAX_FAILOVERS, UnavailableError("worker gone"))
    assert isinstance(error, UnavailableError)
    assert "request req-7" in error.message and "after 4 tokens" in error.message
    assert "max_failovers" in error.message and "worker gone" in error.message
    assert is_resumable(UnavailableError("x"))
    assert not is_resumable(InvalidArgumentError("x"))


# -- the router core over fake workers ----------------------------------------------------------


def _next_token(sequence: list[int]) -> int:
    """The fake engine: greedy and deterministic in the whole sequence so far."""
    return 32 + (sum(sequence) * 31 + len(sequence)) % 90


def _uninterrupted(prompt: tuple[int, ...], num_tokens: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(num_tokens):
        sequence.append(_next_token(sequence))
    return sequence[len(prompt):]


class _Call:
    """A decode call: the worker's tokens one per message, or a break after ``break_after``."""

    def __init__(self, request: worker_pb2.DecodeRequest, break_after: int | None,
                 error: PdserveError, hang: asyncio.Event | None) -> None:
        self._request = request
        self._break_after = break_after
        self._error = error
        self._hang = hang
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True

    async def __aiter__(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        sequence = list(self._request.prompt_token_ids)
        max_tokens = self._request.sampling.max_tokens
        for index in range(max_tokens):
            if index == self._break_after:
                if self._hang is not None:
                    await self._hang.wait()  # a silent worker: its pool manager says FAILED
                raise self._error
            sequence.append(_next_token(sequence))
            finish = pb.FINISH_REASON_LENGTH if index == max_tokens - 1 else None
            yield worker_pb2.DecodeResponse(token_ids=[sequence[-1]], finish_reason=finish)
            await asyncio.sleep(0)


class _Workers:
    """Decode workers by address; ``breaks[address]`` = tokens after which its stream breaks."""

    def __init__(self, breaks: dict[str, int], error: PdserveError | None = None,
                 hang: asyncio.Event | None = None) -> None:
        self.breaks = breaks
        self.error = error or UnavailableError("connection lost")
        self.hang = hang
        self.requests: list[tuple[str, worker_pb2.DecodeRequest]] = []

    def decode(self, address: str, request: worker_pb2.DecodeRequest,
               timeout_s: float) -> _Call:
        self.requests.append((address, request))
        return _Call(request, self.breaks.get(address), self.error, self.hang)


class _Tickets:
    def __init__(self) -> None:
        self.opened: list[TicketSpec] = []
        self.aborted: list[FencingToken] = []

    async def open(self, spec: TicketSpec, timeout_s: float) -> FencingToken:
        self.opened.append(spec)
        return FencingToken.new()

    async def abort(self, token: FencingToken, reason: str, timeout_s: float) -> None:
        self.aborted.append(token)


def _view(num_decode: int) -> PoolView:
    view = PoolView()
    view.replace("m", [_record(f"d{i}") for i in range(num_decode)])
    return view


def _record(worker_id: str, state: WorkerState = WorkerState.READY) -> WorkerRecord:
    info = pb.WorkerInfo(worker_id=worker_id, kv_layout=pb.KvLayout(
        num_layers=2, num_blocks=1024, block_size_tokens=16, block_nbytes=64))
    return WorkerRecord(worker_id=worker_id, deployment="m", role=WorkerRole.DECODE,
                        state=state, address=worker_id, spec=info.SerializeToString(),
                        load=WorkerLoad(num_free_blocks=1024, num_total_blocks=1024))


async def _collect(router: Router, request: GenerationRequest = REQUEST
                   ) -> tuple[list[int], GenerationChunk]:
    token_ids: list[int] = []
    last = GenerationChunk()
    async for chunk in router.generate(request):
        token_ids.extend(chunk.token_ids)
        last = chunk
    return token_ids, last


def _failovers(outcome: FailoverOutcome) -> float:
    value = REGISTRY.get_sample_value("pdserve_router_failovers_requests_total",
                                      {"model": "m", "outcome": outcome})
    return value or 0.0


async def test_a_broken_stream_goes_on_on_another_worker_with_the_same_tokens() -> None:
    workers, tickets = _Workers({"d0": 3, "d1": 3}), _Tickets()
    router = Router(RouterConfig(), _view(3), tickets, workers)  # type: ignore[arg-type]
    resumed_before = _failovers(FailoverOutcome.RESUMED)
    token_ids, last = await _collect(router)
    assert token_ids == _uninterrupted(PROMPT, 10)
    # d0 or d1 broke after 3 tokens, the other (or d2) after 3 more; each continuation was
    # asked for the prompt plus every token delivered and only the missing tokens.
    addresses = [address for address, _ in workers.requests]
    assert len(addresses) == len(set(addresses))  # never back to a worker that broke
    delivered = 0
    for address, request in workers.requests:
        assert list(request.prompt_token_ids) == [*PROMPT, *token_ids[:delivered]]
        assert request.sampling.max_tokens == 10 - delivered
        delivered += workers.breaks.get(address, request.sampling.max_tokens)
    assert delivered == 10
    assert last.finish_reason is FinishReason.LENGTH
    assert last.usage is not None and last.usage.prompt_tokens == len(PROMPT)
    assert last.usage.completion_tokens == 10
    assert last.timing is not None and last.timing.num_failovers == len(workers.requests) - 1
    assert len(tickets.aborted) == len(workers.requests) - 1  # the broken attempts' tickets
    assert [spec.num_prompt_tokens for spec in tickets.opened] == [
        len(request.prompt_token_ids) for _, request in workers.requests]
    assert _failovers(FailoverOutcome.RESUMED) - resumed_before == len(workers.requests) - 1


async def test_past_max_failovers_the_client_gets_unavailable_naming_the_request() -> None:
    workers = _Workers({"d0": 2, "d1": 2, "d2": 2})
    config = RouterConfig(failover=FailoverLimits(max_failovers=1))
    router = Router(config, _view(3), _Tickets(), workers)  # type: ignore[arg-type]
    token_ids: list[int] = []
    with pytest.raises(UnavailableError) as caught:
        async for chunk in router.generate(REQUEST):
            token_ids.extend(chunk.token_ids)
    assert token_ids == _uninterrupted(PROMPT, 4)  # what was streamed is right, no more
    assert "request r1" in caught.value.message
    assert "after 4 tokens were delivered" in caught.value.message
    assert len(workers.requests) == 2


async def test_with_no_other_decode_worker_the_error_is_clean() -> None:
    router = Router(RouterConfig(), _view(1), _Tickets(), _Workers({"d0": 5}))  # type: ignore[arg-type]
    with pytest.raises(UnavailableError, match=r"request r1: .* after 5 tokens"):
        await _collect(router)


async def test_a_failure_the_request_caused_is_not_failed_over() -> None:
    workers = _Workers({"d0": 2, "d1": 2}, error=InvalidArgumentError("bad", field="x"))
    router = Router(RouterConfig(), _view(2), _Tickets(), workers)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        await _collect(router)
    assert len(workers.requests) == 1


async def test_a_worker_its_pool_manager_declares_failed_is_left_while_its_stream_hangs() -> None:
    hang = asyncio.Event()  # never set: the stream stays open and silent
    view = _view(2)
    workers = _Workers({"d0": 4, "d1": 4}, hang=hang)
    router = Router(RouterConfig(stream_idle_timeout_s=60.0), view, _Tickets(),  # type: ignore[arg-type]
                    workers)
    task = asyncio.create_task(_collect(router))
    while len(workers.requests) < 1:
        await asyncio.sleep(0.01)
    first = workers.requests[0][0]
    await asyncio.sleep(0.05)  # it has streamed its 4 tokens and hangs
    view.upsert(_record(first, WorkerState.FAILED))
    workers.breaks.pop("d1" if first == "d0" else "d0")  # the other one does not break
    token_ids, last = await asyncio.wait_for(task, 10.0)
    assert token_ids == _uninterrupted(PROMPT, 10)
    assert last.timing is not None and last.timing.num_failovers == 1


async def test_a_client_resume_streams_only_the_rest_and_counts_the_whole_request() -> None:
    workers = _Workers({})
    router = Router(RouterConfig(), _view(1), _Tickets(), workers)  # type: ignore[arg-type]
    had = tuple(_uninterrupted(PROMPT, 4))
    resume = GenerationRequest(request_id="r1", model="m", prompt_token_ids=PROMPT,
                               max_tokens=10, resume_token_ids=had)
    token_ids, last = await _collect(router, resume)
    assert [*had, *token_ids] == _uninterrupted(PROMPT, 10)
    assert last.usage is not None and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == len(PROMPT)
    # Every token already had: only the end is sent, no worker is asked.
    done = GenerationRequest(request_id="r2", model="m", prompt_token_ids=PROMPT, max_tokens=10,
                             resume_token_ids=tuple(_uninterrupted(PROMPT, 10)))
    num_calls = len(workers.requests)
    token_ids, last = await _collect(router, done)
    assert token_ids == [] and last.finish_reason is FinishReason.LENGTH
    assert len(workers.requests) == num_calls
    with pytest.raises(InvalidArgumentError, match="request_id"):
        await _collect(router, GenerationRequest(request_id="", model="m",
                                                 prompt_token_ids=PROMPT, max_tokens=10,
                                                 resume_token_ids=(1,)))


async def test_resuming_a_request_still_in_flight_here_is_unavailable_not_invalid() -> None:
    hang = asyncio.Event()
    workers = _Workers({"d0": 2}, hang=hang)
    router = Router(RouterConfig(), _view(1), _Tickets(), workers)  # type: ignore[arg-type]
    old = asyncio.create_task(_collect(router))
    while not workers.requests:
        await asyncio.sleep(0.01)
    resume = GenerationRequest(request_id="r1", model="m", prompt_token_ids=PROMPT,
                               max_tokens=10, resume_token_ids=(1, 2))
    with pytest.raises(UnavailableError, match="still in flight"):
        await _collect(router, resume)
    with pytest.raises(InvalidArgumentError, match="already in flight"):
        await _collect(router, REQUEST)
    old.cancel()
    with pytest.raises(asyncio.CancelledError):
        await old
