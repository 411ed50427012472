"""The router core: one request's path through the router, top to bottom.

1. ``generate`` validates the request and registers it (``cancel`` finds it there), runs its
   attempts, ends the stream with usage and timing, and records the outcome.
2. ``_attempts`` routes (``router.policy``: the pure decision, over the pool view and what this
   router has in flight on each worker), admits the request on the first attempt
   (``router.admission``: sheds before any ticket or prefill work is spent) and retries failures
   before the first token on other workers.
3. ``_attempt`` opens the ticket (KV blocks reserved on the decode worker), dispatches prefill
   and decode, streams the decode worker's tokens, and on any failure aborts the ticket and
   cancels both calls.

What the request has in flight lives in one ``InFlightLedger`` (``router.in_flight``): admission
books its prefill there (and moves it when the prefill is sent, ends it when it is done), the
attempt reserves its blocks there for as long as it runs, and routing reads both.

Retries: any failure before the first token (a worker down, a ticket refused for capacity, a
transfer that failed) aborts the ticket and tries again on other workers, up to
``max_attempts``. After the first token a broken stream fails over (``router.failover``): the
request goes on on another decode worker as a new segment (prompt plus the tokens delivered, a
fresh ticket, the missing tokens only), whose attempts retry like the first segment's, within
the failover bounds; beyond them the client gets a clean UNAVAILABLE naming the request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2
from pdserve.common.convert import token_to_pb
from pdserve.common.errors import (
    CapacityError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    UnavailableError,
)
from pdserve.common.tokenizer import prefix_block_hashes
from pdserve.common.types import FencingToken, TicketSpec, WorkerRole, WorkerState
from pdserve.router.admission import AdmissionConfig, AdmissionPolicy, AdmissionRequest
from pdserve.router.clients import TicketClient, WorkerClients, iterate_stream
from pdserve.router.decode_stream import next_or_prefill_failure
from pdserve.router.failover import (
    FailoverBudget,
    FailoverLimits,
    FailoverOutcome,
    gave_up,
    is_resumable,
    resumed_request,
)
from pdserve.router.in_flight import InFlightLedger
from pdserve.router.metrics import CLIENT_RESUMES, FAILOVERS, REFUSALS
from pdserve.router.policy import (
    DecodeCandidate,
    PrefillCandidate,
    RouteDecision,
    RouteRequest,
    RoutingConfig,
    route,
)
from pdserve.router.pool_view import PoolView, WorkerView
from pdserve.router.prediction import snapshot_of
from pdserve.router.thresholds import PublishedThresholds
from pdserve.router.types import (
    PB_TO_FINISH_REASON,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ModelCard,
    OutcomeSink,
    RequestOutcome,
    RequestTiming,
    Usage,
)
from pdserve.state.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

PREFILL_REPLY_WAIT_S = 1.0
"""At a stream's end, how long to wait for a prefill call still returning (its cache count)."""
tracer = trace.get_tracer(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    max_attempts: int = 3
    max_in_flight: int = 4096
    """Requests this router admits at once; beyond it, RESOURCE_EXHAUSTED."""
    max_tokens_limit: int = 32_768
    lease_s: float = 10.0
    rpc_timeout_s: float = 10.0
    request_timeout_s: float = 600.0
    kv_wait_timeout_s: float = 30.0
    stream_idle_timeout_s: float = 20.0
    """Longest wait for the next decode message once the first arrived (the first may take
    ``kv_wait_timeout_s`` more): a frozen decode worker ends the request with DEADLINE_EXCEEDED
    instead of leaving it open until keepalives notice."""
    transport: str = "tcp"
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    admission: AdmissionConfig | None = None
    """Admission and load shedding (``router.admission``); None = defaults with this config's
    ``max_in_flight`` and ``slo_ttft_ms``."""
    failover: FailoverLimits = field(default_factory=FailoverLimits)
    """Bounds on mid-stream failovers (``router.failover``)."""

    def admission_config(self) -> AdmissionConfig:
        return self.admission or AdmissionConfig(slo_ttft_s=self.slo_ttft_ms / 1000,
                                                 max_in_flight=self.max_in_flight)


class _Retry(Exception):
    """A failure before the first token: try other workers."""

    def __init__(self, error: PdserveError, worker_ids: tuple[str, ...],
                 is_backoff: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.worker_ids = worker_ids
        self.is_backoff = is_backoff
        """Wait a little before the next attempt (the control plane, not a worker, failed)."""


class _Failover(Exception):
    """The decode stream broke after its first token: go on on another decode worker."""

    def __init__(self, error: PdserveError, decode_worker_id: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.decode_worker_id = decode_worker_id


@dataclass(slots=True)
class _Progress:
    """One request's stream so far, over all its attempts and segments."""

    budget: FailoverBudget
    delivered_token_ids: list[int]
    """Every token the client has (those it resumed with first)."""
    num_attempts: int = 0
    is_local: bool = False
    exposed_s: float = 0.0
    num_cached_prompt_tokens: int = 0
    """The last segment's prefill: tokens its engine had cached (the usage's, at most the
    original prompt: a failover's prompt also holds the tokens generated before it)."""


class Router:
    """The router core behind both front ends (a ``GenerationBackend``); the module docstring
    follows one request through it."""

    def __init__(
        self,
        config: RouterConfig,
        view: PoolView,
        tickets: TicketClient,
        workers: WorkerClients,
        prefix_index: PrefixIndex | None = None,
        outcome_sink: OutcomeSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        thresholds: PublishedThresholds | None = None,
    ) -> None:
        """``thresholds``: the governor's published local-prefill thresholds (None: the
        config's own threshold for every deployment)."""
        self.config = config
        self.thresholds = thresholds
        self.in_flight = InFlightLedger()
        """This router's prefills and KV reservations on each worker (routing and admission)."""
        self.admission = AdmissionPolicy(config.admission_config(), self.in_flight)
        self._clock = clock
        self._view = view
        self._tickets = tickets
        self._workers = workers
        self._prefix_index = prefix_index
        self._outcome_sink = outcome_sink
        self._tasks: dict[str, asyncio.Task[Any] | None] = {}
        """Request id -> the task serving it, for every request in flight here."""
        self._cancelled: set[str] = set()

    # -- front-end protocol -------------------------------------------------------------------

    def list_models(self) -> list[ModelCard]:
        cards = []
        for deployment in self._view.deployments():
            num_decode = len(self._view.ready(deployment, WorkerRole.DECODE))
            num_prefill = len(self._view.ready(deployment, WorkerRole.PREFILL))
            if num_decode == 0 and num_prefill == 0:
                continue
            cards.append(ModelCard(
                name=deployment, max_context_tokens=self._view.max_context_tokens(deployment),
                num_prefill_workers=num_prefill, num_decode_workers=num_decode,
            ))
        return cards

    async def cancel(self, request_id: str) -> bool:
        """Cancel a request in flight on this router: its task is cancelled, which aborts its
        ticket and cancels its worker calls (everything it holds is freed)."""
        if request_id not in self._tasks:
            return False
        self._cancelled.add(request_id)
        task = self._tasks[request_id]
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        return True

    # -- 1. the request -----------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self._validate(request)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._tasks:
            if request.resume_token_ids:  # its old stream here may still be ending: try again
                raise UnavailableError(f"request {request_id} is still in flight here (its "
                                       f"stream is ending); resume it again shortly")
            raise InvalidArgumentError(f"request_id: {request_id!r} is already in flight",
                                       field="request_id")
        self._tasks[request_id] = asyncio.current_task()
        started = time.perf_counter()
        outcome_error = ""
        first_token_at: float | None = None
        num_streamed = 0  # tokens this router streamed (latencies; usage adds the resumed)
        num_resumed = len(request.resume_token_ids)
        progress = _Progress(FailoverBudget(self.config.failover, self._clock),
                             list(request.resume_token_ids))
        if num_resumed:
            CLIENT_RESUMES.labels(request.model).inc()
        # The span is current only while this generator runs its own code, never across a
        # yield: the caller may close the generator from another context (an HTTP handler's
        # cancellation, the loop's async-generator finalizer), where detaching a context token
        # attached here would fail ("Failed to detach context").
        span = tracer.start_span("router.generate", attributes={
            "pdserve.request_id": request_id, "pdserve.model": request.model,
            "pdserve.num_prompt_tokens": len(request.prompt_token_ids),
            "pdserve.num_resumed_tokens": num_resumed})
        attempts_stream = self._attempts(request, request_id, progress)
        try:
            while True:
                with trace.use_span(span):
                    chunk = await anext(attempts_stream, None)
                if chunk is None:
                    return
                if chunk.token_ids and first_token_at is None:
                    first_token_at = time.perf_counter()
                num_streamed += len(chunk.token_ids)
                if request_id in self._cancelled:
                    yield self._final(request, num_streamed, started, first_token_at,
                                      FinishReason.CANCELLED, progress)
                    return
                if chunk.finish_reason is not None:
                    yield self._final(request, num_streamed, started, first_token_at,
                                      chunk.finish_reason, progress, chunk)
                    return
                yield chunk
        except PdserveError as exc:
            outcome_error = exc.code.name
            raise
        except BaseException:
            outcome_error = "CANCELLED"
            raise
        finally:
            try:
                with trace.use_span(span, end_on_exit=True):
                    await attempts_stream.aclose()  # its clean-up (aborts) runs under the span
            finally:
                if progress.budget.is_failing_over:
                    FAILOVERS.labels(request.model, FailoverOutcome.CANCELLED).inc()
                self.admission.finish(request_id)
                self._tasks.pop(request_id, None)
                self._cancelled.discard(request_id)
                self._record(request, request_id, started, first_token_at, num_streamed,
                             progress, outcome_error)

    def _validate(self, request: GenerationRequest) -> None:
        if not request.model:
            raise InvalidArgumentError("model: required", field="model")
        if request.model not in self._view.deployments() or not self._view.ready(
            request.model, WorkerRole.DECODE
        ):
            known = ", ".join(self._view.deployments()) or "none"
            if request.model not in self._view.deployments():
                raise NotFoundError(f"model: unknown model {request.model!r} (served: {known})",
                                    field="model")
            raise UnavailableError(f"model {request.model!r} has no ready decode worker")
        if not request.prompt_token_ids:
            raise InvalidArgumentError("prompt: empty", field="prompt")
        if request.max_tokens <= 0:
            raise InvalidArgumentError("max_tokens: must be > 0", field="max_tokens")
        if request.resume_token_ids:
            if not request.request_id:
                raise InvalidArgumentError(
                    "request_id: required to resume a stream (resume_token_ids is set)",
                    field="request_id")
            if len(request.resume_token_ids) > request.max_tokens:
                raise InvalidArgumentError(
                    f"resume_token_ids: {len(request.resume_token_ids)} tokens, more than "
                    f"max_tokens ({request.max_tokens})", field="resume_token_ids")
        if request.max_tokens > self.config.max_tokens_limit:
            raise InvalidArgumentError(
                f"max_tokens: {request.max_tokens} exceeds the limit "
                f"{self.config.max_tokens_limit}", field="max_tokens")
        context = self._view.max_context_tokens(request.model)
        if context and len(request.prompt_token_ids) >= context:
            raise InvalidArgumentError(
                f"prompt: {len(request.prompt_token_ids)} tokens, the model's context is "
                f"{context} tokens (prompt and output together)", field="prompt")
        if context and len(request.prompt_token_ids) + request.max_tokens > context:
            raise InvalidArgumentError(
                f"max_tokens: prompt ({len(request.prompt_token_ids)}) + max_tokens "
                f"({request.max_tokens}) exceeds the model's context of {context} tokens",
                field="max_tokens")

    # -- 2. attempts: segments, routing, admission, retries -----------------------------------

    async def _attempts(self, request: GenerationRequest, request_id: str,
                        progress: _Progress) -> AsyncGenerator[GenerationChunk, None]:
        """The request's chunks, segment after segment (``router.failover``): the first segment
        is the request (after the tokens its client resumed with, if any); each failover
        starts the next one, away from the decode worker whose stream broke."""
        budget = progress.budget
        excluded: set[str] = set()
        while True:
            segment = resumed_request(request, tuple(progress.delivered_token_ids))
            if segment.max_tokens <= 0:
                # Every token was delivered before the break: only the end was missing.
                budget.settle()
                yield GenerationChunk(finish_reason=FinishReason.LENGTH)
                return
            try:
                async for chunk in self._segment(segment, request_id, progress, excluded):
                    if budget.is_failing_over:
                        budget.settle()
                        FAILOVERS.labels(request.model, FailoverOutcome.RESUMED).inc()
                    progress.delivered_token_ids.extend(chunk.token_ids)
                    yield chunk
                return
            except _Failover as failover:
                num_delivered = len(progress.delivered_token_ids)
                logger.info("request %s: decode worker %s failed after %d tokens: %s",
                            request_id, failover.decode_worker_id, num_delivered,
                            failover.error.message)
                refusal = budget.begin()
                if refusal is not None:
                    FAILOVERS.labels(request.model, refusal).inc()
                    raise gave_up(request_id, num_delivered, refusal, failover.error) from None
                excluded = {failover.decode_worker_id}
            except PdserveError as exc:
                if not budget.is_failing_over:
                    raise
                outcome = (FailoverOutcome.MAX_TIME if budget.remaining_s() <= 0
                           else FailoverOutcome.NO_WORKER)
                budget.settle()
                FAILOVERS.labels(request.model, outcome).inc()
                raise gave_up(request_id, len(progress.delivered_token_ids), outcome,
                              exc) from None

    async def _segment(self, segment: GenerationRequest, request_id: str, progress: _Progress,
                       excluded: set[str]) -> AsyncGenerator[GenerationChunk, None]:
        """One segment's attempts: routing, admission (the request's first attempt only) and
        retries of failures before the segment's first token on other workers. While failing
        over, no attempt starts once the failover time is up, and a decode pool without room
        is waited for (within that time) rather than refused."""
        budget = progress.budget
        last_error: PdserveError | None = None
        is_backoff = False
        for attempt in range(1, self.config.max_attempts + 1):
            if budget.is_failing_over and budget.remaining_s() <= 0:
                raise last_error or UnavailableError("failover time is up")
            try:
                decision = await self._route(segment, frozenset(excluded))
            except CapacityError as exc:
                if not budget.is_failing_over:
                    raise
                last_error = exc
                await self._backoff(attempt)
                continue
            except UnavailableError:
                if last_error is None or not excluded or not is_backoff:
                    if last_error is not None:
                        raise last_error from None
                    raise
                # Every worker was excluded after control-plane failures (e.g. a store restart
                # until the workers' next heartbeats): after the backoff, try them again.
                excluded.clear()
                decision = await self._route(segment, frozenset())
            progress.num_attempts += 1
            progress.is_local = decision.is_local_prefill
            if progress.num_attempts == 1:
                self._admit(segment, request_id, decision)
            max_first_wait_s = budget.remaining_s() if budget.is_failing_over else None
            try:
                async for chunk, exposed_s in self._attempt(segment, request_id, decision,
                                                            max_first_wait_s):
                    progress.exposed_s = exposed_s
                    if chunk.finish_reason is not None:
                        progress.num_cached_prompt_tokens = chunk.num_cached_prompt_tokens
                    yield chunk
                return
            except _Retry as retry:
                logger.info("request %s attempt %d failed before the first token: %s",
                            request_id, progress.num_attempts, retry.error.message)
                last_error = retry.error
                excluded.update(retry.worker_ids)
                is_backoff = retry.is_backoff
                if retry.is_backoff and attempt < self.config.max_attempts:
                    await self._backoff(attempt)
        assert last_error is not None
        raise last_error

    @staticmethod
    async def _backoff(attempt: int) -> None:
        await asyncio.sleep(random.uniform(0.5, 1.0) * min(1.0, 0.2 * 2 ** attempt))

    async def _route(self, request: GenerationRequest, excluded: frozenset[str]) -> RouteDecision:
        decoders = self._view.ready(request.model, WorkerRole.DECODE)
        prefillers = self._view.ready(request.model, WorkerRole.PREFILL)
        num_prompt_tokens = len(request.prompt_token_ids)
        overlap: dict[str, int] = {}
        block_size = decoders[0].block_size_tokens if decoders else 16
        if self._prefix_index is not None and prefillers and num_prompt_tokens >= block_size:
            # Prefill workers' caches pick the prefill worker; a decode worker's own cache (an
            # engine that keeps one, e.g. vLLM) shortens a local prefill there.
            hashes = prefix_block_hashes(list(request.prompt_token_ids), block_size)
            try:
                overlap = await self._prefix_index.overlap(
                    request.model, [w.worker_id for w in (*prefillers, *decoders)], hashes)
            except Exception:  # noqa: BLE001 - routing without prefix hints is still correct
                logger.debug("prefix index unavailable", exc_info=True)
        return route(
            RouteRequest(num_prompt_tokens, request.max_tokens, request.prefill_mode),
            [self._decode_candidate(w, overlap.get(w.worker_id, 0) * block_size)
             for w in decoders],
            [PrefillCandidate(
                worker_id=w.worker_id,
                # Reported queue plus this router's dispatches since (reports are ~1 s stale).
                num_queued_prefill_tokens=self.admission.estimated_queued_tokens(
                    snapshot_of(w, num_prompt_tokens), self._clock()),
                num_cached_prefix_tokens=overlap.get(w.worker_id, 0) * block_size,
            ) for w in prefillers],
            self.routing_for(request.model),
            excluded,
        )

    def routing_for(self, deployment: str) -> RoutingConfig:
        """The routing knobs of ``deployment``: the config's, with the governor's published
        local-prefill threshold when there is one."""
        if self.thresholds is None:
            return self.config.routing
        return self.thresholds.routing_for(deployment)

    def _decode_candidate(self, worker: WorkerView,
                          num_cached_prefix_tokens: int = 0) -> DecodeCandidate:
        load = worker.record.load
        in_flight = self.in_flight.on(worker.worker_id)
        return DecodeCandidate(
            worker_id=worker.worker_id, num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks, num_running_seqs=load.num_running_seqs,
            block_size_tokens=worker.block_size_tokens,
            num_cached_prefix_tokens=num_cached_prefix_tokens,
            num_pending_blocks=in_flight.num_reserved_blocks,
            num_pending_seqs=in_flight.num_seqs,
        )

    def _admit(self, request: GenerationRequest, request_id: str, decision: RouteDecision) -> None:
        """Admission before any ticket or prefill work: raises ``CapacityError`` to shed."""
        worker_id = decision.prefill_worker_id or decision.decode_worker_id
        worker = self._view.get(request.model, worker_id)
        if worker is None:
            return  # it left the pool: the attempt fails over and retries
        num_tokens = len(request.prompt_token_ids)
        verdict = self.admission.admit(
            AdmissionRequest(request_id, request.tenant, num_tokens),
            snapshot_of(worker, num_tokens), self._clock())
        if not verdict.is_admitted:
            REFUSALS.labels(request.model, request.tenant, verdict.outcome).inc()
            raise CapacityError(verdict.message, retry_after_s=verdict.retry_after_s)

    # -- 3. one attempt: ticket, dispatch, decode stream --------------------------------------

    async def _attempt(
        self, request: GenerationRequest, request_id: str, decision: RouteDecision,
        max_first_wait_s: float | None = None,
    ) -> AsyncIterator[tuple[GenerationChunk, float]]:
        """Chunks of one attempt with the transfer time the decode worker saw exposed so far.
        A failure before the first token is a ``_Retry``, one after it a ``_Failover`` (unless
        no other worker could do better); any failure frees what the ticket holds, on both
        sides. ``max_first_wait_s`` caps the wait for the first token (a failover's time)."""
        decode = self._view.get(request.model, decision.decode_worker_id)
        prefill = (self._view.get(request.model, decision.prefill_worker_id)
                   if decision.prefill_worker_id else None)
        if decode is None or (decision.prefill_worker_id and prefill is None):
            raise _Retry(UnavailableError("worker left the pool"), (decision.decode_worker_id,))
        prompt = list(request.prompt_token_ids)
        token = await self._open_ticket(request, request_id, decision)
        self.in_flight.reserve_blocks(token.ticket_id, decode.worker_id, decision.num_blocks)
        decode_call: grpc.aio.UnaryStreamCall | None = None
        prefill_task: asyncio.Task[worker_pb2.PrefillResponse] | None = None
        is_first = True
        is_finished = False
        try:
            is_admitted_in_decode = prefill is not None and decode.info.admits_in_decode
            if prefill is not None and not is_admitted_in_decode:
                destination = await self._admit_ticket(token, len(prompt), decision, decode)
                prefill_task = self._start_prefill(request_id, prompt, token, destination,
                                                   prefill)
            elif prefill is None:
                self.admission.dispatched(request_id, snapshot_of(decode, len(prompt)),
                                          self._clock())
            decode_call = self._workers.decode(
                decode.record.address,
                self._decode_request(request, request_id, decision, token,
                                     is_admit=is_admitted_in_decode),
                self.config.request_timeout_s)
            stream = iterate_stream(decode_call)
            if is_admitted_in_decode:
                assert prefill is not None
                destination = await self._admitted(stream, decode)
                prefill_task = self._start_prefill(request_id, prompt, token, destination,
                                                   prefill)
            exposed_s = 0.0
            while True:
                message = await self._next_decode_message(stream, prefill_task, is_first,
                                                          decode, prefill, max_first_wait_s,
                                                          request.model)
                if message is None:
                    return
                if message.HasField("stats"):
                    exposed_s = message.stats.exposed_ms / 1000
                if is_first and prefill_task is None:
                    self._prefill_done(request_id)  # local prefill: its first token is out
                is_first = False
                finish = PB_TO_FINISH_REASON.get(message.finish_reason)
                is_finished = finish is not None
                yield GenerationChunk(
                    token_ids=tuple(message.token_ids), finish_reason=finish,
                    prefill_worker_id=decision.prefill_worker_id,
                    decode_worker_id=decision.decode_worker_id,
                    num_cached_prompt_tokens=(await _num_cached_prompt_tokens(prefill_task)
                                              if is_finished else 0),
                ), exposed_s
                if is_finished:
                    return
        except BaseException:
            # After the final chunk the caller closes this generator (GeneratorExit at the
            # yield): the attempt succeeded. Aborting then would race the decode worker's
            # best-effort DONE report and turn a finished ticket into ABORTED.
            if not is_finished:
                await self._abandon(request_id, token, prefill_task, decode_call)
            raise
        finally:
            self.in_flight.release_blocks(token.ticket_id)
            if prefill_task is not None:
                if not prefill_task.done():
                    prefill_task.cancel()
                with contextlib.suppress(BaseException):
                    await prefill_task

    async def _open_ticket(self, request: GenerationRequest, request_id: str,
                           decision: RouteDecision) -> FencingToken:
        """The ticket that reserves ``decision.num_blocks`` on the decode worker."""
        config = self.config
        try:
            return await self._tickets.open(TicketSpec(
                deployment=request.model, decode_worker_id=decision.decode_worker_id,
                prefill_worker_id=decision.prefill_worker_id, num_blocks=decision.num_blocks,
                lease_s=config.lease_s, request_id=request_id,
                num_prompt_tokens=len(request.prompt_token_ids),
            ), config.rpc_timeout_s)
        except CapacityError as exc:
            raise _Retry(exc, (decision.decode_worker_id,)) from None
        except UnavailableError as exc:
            # The coordinator (or its store) could not take the ticket, the worker is draining,
            # or the store no longer knows it (a restart, until its next heartbeat): try other
            # workers after a short wait; all of them again if every one failed so.
            raise _Retry(exc, (decision.decode_worker_id,), is_backoff=True) from None

    async def _admit_ticket(self, token: FencingToken, num_prompt_tokens: int,
                            decision: RouteDecision, decode: WorkerView) -> pb.KvDestination:
        """Where the KV goes, from a decode worker that admits tickets only by ``AdmitTicket``
        (a release before ``WorkerInfo.admits_in_decode``)."""
        config = self.config
        try:
            return await self._workers.admit(
                decode.record.address, token, num_prompt_tokens, decision.num_blocks,
                config.lease_s, config.transport, config.rpc_timeout_s)
        except PdserveError as exc:
            raise _Retry(exc, (decode.worker_id,)) from None

    async def _admitted(self, stream: AsyncIterator[worker_pb2.DecodeResponse],
                        decode: WorkerView) -> pb.KvDestination:
        """Where the KV goes: the first message of a Decode stream opened with ``admit``, which
        the decode worker sends once it has admitted the ticket (as ``AdmitTicket`` answers)."""
        try:
            message = await next_or_prefill_failure(stream, None, self.config.rpc_timeout_s)
            if message is None or not message.is_admitted:
                raise UnavailableError(
                    f"decode worker {decode.worker_id}: its Decode stream did not admit the "
                    "ticket first")
        except PdserveError as exc:
            raise _Retry(exc, (decode.worker_id,)) from None
        return message.destination

    def _start_prefill(
        self, request_id: str, prompt: list[int], token: FencingToken,
        destination: pb.KvDestination, prefill: WorkerView,
    ) -> asyncio.Task[worker_pb2.PrefillResponse]:
        """The prefill, sent where the decode worker said the KV goes; its end, however it
        ends, is admission's ``prefill_done``."""
        config = self.config
        self.admission.dispatched(request_id, snapshot_of(prefill, len(prompt)), self._clock())
        task = asyncio.create_task(self._workers.prefill(
            prefill.record.address, token, prompt, destination, config.lease_s, request_id,
            config.request_timeout_s))
        task.add_done_callback(lambda done: self._prefill_done(request_id, done))
        return task

    def _decode_request(self, request: GenerationRequest, request_id: str,
                        decision: RouteDecision, token: FencingToken,
                        *, is_admit: bool = False) -> worker_pb2.DecodeRequest:
        return worker_pb2.DecodeRequest(
            token=token_to_pb(token), prompt_token_ids=request.prompt_token_ids,
            sampling=pb.SamplingParams(max_tokens=request.max_tokens,
                                       temperature=request.temperature, top_p=request.top_p,
                                       seed=request.seed, ignore_eos=request.ignore_eos,
                                       stop=request.stop),
            is_local_prefill=decision.is_local_prefill, num_blocks=decision.num_blocks,
            kv_wait_timeout_ms=int(self.config.kv_wait_timeout_s * 1000), request_id=request_id,
            admit=is_admit, transport=self.config.transport if is_admit else "",
        )

    async def _next_decode_message(
        self, stream: AsyncIterator[worker_pb2.DecodeResponse],
        prefill_task: asyncio.Task[worker_pb2.PrefillResponse] | None, is_first: bool,
        decode: WorkerView, prefill: WorkerView | None, max_first_wait_s: float | None,
        model: str,
    ) -> worker_pb2.DecodeResponse | None:
        """The next decode message, None at the end of the stream. Before the first one, a
        failure is a ``_Retry`` away from the worker that failed (prefill's, if its call did);
        after it, a ``_Failover`` away from the decode worker. The worker counts as failed as
        soon as its pool manager says so (FAILED in the pool view), whatever its stream does."""
        config = self.config
        idle_s = config.stream_idle_timeout_s + (config.kv_wait_timeout_s if is_first else 0.0)
        if is_first and max_first_wait_s is not None:
            idle_s = max(0.001, min(idle_s, max_first_wait_s))
        decode_id = decode.worker_id

        def why_gone() -> str:
            worker = self._view.get(model, decode_id)
            # Absent is not gone: after a store restart the view lacks live workers until their
            # next heartbeats.
            if worker is not None and worker.record.state is WorkerState.FAILED:
                return f"decode worker {decode_id} failed (its heartbeats stopped)"
            return ""

        try:
            return await next_or_prefill_failure(stream, prefill_task, idle_s, why_gone)
        except PdserveError as exc:
            if not is_first:
                if is_resumable(exc):
                    raise _Failover(exc, decode_id) from None
                raise
            is_prefill_failed = (prefill_task is not None and prefill_task.done()
                                 and prefill_task.exception() is not None)
            failed = prefill if is_prefill_failed and prefill is not None else decode
            raise _Retry(exc, (failed.worker_id,)) from None

    def _prefill_done(self, request_id: str, task: asyncio.Task[Any] | None = None) -> None:
        is_ok = task is None or (not task.cancelled() and task.exception() is None)
        self.admission.prefill_done(request_id, self._clock(), is_ok=is_ok)

    async def _abandon(self, request_id: str, token: FencingToken,
                       prefill_task: asyncio.Task[Any] | None,
                       decode_call: grpc.aio.UnaryStreamCall | None) -> None:
        """A failed or cancelled attempt: free everything the ticket holds, on both sides."""
        self.admission.prefill_done(request_id, self._clock(), is_ok=False)
        if prefill_task is not None and not prefill_task.done():
            prefill_task.cancel()
        if decode_call is not None:
            decode_call.cancel()
        with contextlib.suppress(Exception):
            await asyncio.shield(self._tickets.abort(token, "router: attempt failed",
                                                     self.config.rpc_timeout_s))

    # -- outcomes -----------------------------------------------------------------------------

    def _final(self, request: GenerationRequest, num_streamed: int, started: float,
               first_token_at: float | None, reason: FinishReason, progress: _Progress,
               chunk: GenerationChunk | None = None) -> GenerationChunk:
        """The last chunk. Usage counts the whole request: the original prompt, and every token
        generated for it (those a resuming client already had included)."""
        ttft_s, tpot_s = _latencies_s(started, first_token_at, num_streamed)
        num_output = len(request.resume_token_ids) + num_streamed
        return GenerationChunk(
            token_ids=chunk.token_ids if chunk else (),
            finish_reason=reason,
            usage=Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_output,
                        cached_prompt_tokens=min(progress.num_cached_prompt_tokens,
                                                 len(request.prompt_token_ids))),
            timing=RequestTiming(ttft_ms=ttft_s * 1000, tpot_ms=tpot_s * 1000,
                                 is_local_prefill=progress.is_local,
                                 num_attempts=progress.num_attempts,
                                 num_failovers=progress.budget.num_failovers),
            prefill_worker_id=chunk.prefill_worker_id if chunk else "",
            decode_worker_id=chunk.decode_worker_id if chunk else "",
        )

    def _record(self, request: GenerationRequest, request_id: str, started: float,
                first_token_at: float | None, num_streamed: int, progress: _Progress,
                error: str) -> None:
        if self._outcome_sink is None:
            return
        ttft_s, tpot_s = _latencies_s(started, first_token_at, num_streamed)
        with contextlib.suppress(Exception):
            self._outcome_sink.record(RequestOutcome(
                request_id=request_id, deployment=request.model, ttft_s=ttft_s, tpot_s=tpot_s,
                num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=num_streamed,
                is_ok=not error, is_local_prefill=progress.is_local,
                num_attempts=progress.num_attempts, error_code=error,
                exposed_transfer_s=progress.exposed_s,
            ))


async def _num_cached_prompt_tokens(
        prefill_task: asyncio.Task[worker_pb2.PrefillResponse] | None) -> int:
    """The prefill worker's count of prompt tokens served from its engine's prefix cache; 0
    for a local prefill or a failed prefill call. The prefill call returns once the KV has
    landed, before the decode stream ends, so it is done here in all but rare races, which
    wait for it at most ``PREFILL_REPLY_WAIT_S``."""
    if prefill_task is None:
        return 0
    if not prefill_task.done():
        await asyncio.wait({prefill_task}, timeout=PREFILL_REPLY_WAIT_S)
    if not prefill_task.done() or prefill_task.cancelled() or prefill_task.exception():
        return 0
    return int(prefill_task.result().num_cached_prompt_tokens)


def _latencies_s(started: float, first_token_at: float | None,
                 num_output: int) -> tuple[float, float]:
    """TTFT and mean TPOT until now (``time.perf_counter`` readings); with no token yet, TTFT is
    the time so far and TPOT 0."""
    now = time.perf_counter()
    if not first_token_at:
        return now - started, 0.0
    return first_token_at - started, (now - first_token_at) / max(1, num_output - 1)
