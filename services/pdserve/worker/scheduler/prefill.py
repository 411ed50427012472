"""The in-house prefill runtime: a FIFO queue of prompts, computed layer by layer on the engine
thread while each finished layer goes to the destination.

One prompt runs at a time (the engine thread is the unit of compute). The prompt's blocks are
allocated when it starts and freed when its transfer has ended; the KV leaves layer by layer as
the engine yields each layer (layers found finished together leave together, in one offer), and
the first token travels with the sender's DONE. Prefix hashes of the prompts computed stay in an
LRU that the router's prefix index follows (``take_prefix_delta``); the ``sim`` engine may skip
the cached part of a prompt (``is_prefix_cache_simulated``: timing only, the KV is still sent).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.common.errors import StaleTokenError
from pdserve.common.tokenizer import prefix_block_hashes
from pdserve.common.types import FencingToken, WorkerLoad
from pdserve.worker.engine import Engine, Sequence
from pdserve.worker.kv_checksums import checksum_of
from pdserve.worker.runtime import (
    PrefillPhase,
    PrefillResult,
    PrefillTicket,
    ProfilePoint,
    TransferTiming,
)
from pdserve.worker.scheduler.engine_thread import EngineScheduler
from pdserve.worker.transports.registry import TransportBackend

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


class _ReadyLayers:
    """Finished layers, from the engine thread to the event loop: the thread ``put``s each
    layer (then None, or an exception), the loop ``take_all``s whatever is there. One wake-up
    of the loop per batch, not per layer, and the loop sends every layer it finds at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque[int | BaseException | None] = collections.deque()
        self._lock = threading.Lock()
        self._is_wake_pending = False
        self._event = asyncio.Event()

    def put(self, item: int | BaseException | None) -> None:
        """Engine thread."""
        with self._lock:
            self._items.append(item)
            if self._is_wake_pending:
                return
            self._is_wake_pending = True
        self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        with self._lock:
            self._is_wake_pending = False
        self._event.set()

    async def take_all(self) -> list[int | BaseException | None]:
        """Event loop: every item put so far (at least one), oldest first."""
        while True:
            with self._lock:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    return items
                self._event.clear()
            await self._event.wait()


@dataclass(slots=True, eq=False)
class _Job:
    ticket: PrefillTicket
    future: asyncio.Future[PrefillResult]
    trace_context: otel_context.Context
    """The Prefill call's trace context: the job runs on the prefill loop's task, which would
    otherwise start a trace of its own."""
    cancel_reason: str = ""


class PrefillScheduler(EngineScheduler):
    """Implements ``worker.runtime.PrefillRuntime`` over an in-house ``Engine``."""

    takes_late_destinations = False
    """Every ticket names its destination (the in-house decode side picks blocks at admit)."""

    def __init__(self, engine: Engine, *, prefix_cache_blocks: int = 4096,
                 is_prefix_cache_simulated: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: monotonic seconds, of the progress watermark (``progress_stall_s``)."""
        super().__init__(engine)
        self._prefix_cache_blocks = prefix_cache_blocks
        self._is_prefix_cache_simulated = is_prefix_cache_simulated
        self._transport: TransportBackend | None = None
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[FencingToken, _Job] = {}
        self._wakeup = asyncio.Event()
        self._num_queued_prefill_tokens = 0
        self._prefix_lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._prefix_added: set[int] = set()
        self._prefix_removed: set[int] = set()
        self._clock = clock
        self._last_progress_s = clock()
        """When the loop last advanced: took a prompt, got or sent layers, finished a prompt."""
        self._running: _Job | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._is_advancing = asyncio.Event()
        self._is_advancing.set()

    async def start(self, transport: TransportBackend) -> None:
        self._transport = transport
        self._loop_task = asyncio.create_task(self._loop(), name="prefill-loop")
        self._tasks.append(self._loop_task)

    # -- the progress watermark ---------------------------------------------------------------

    def _advance(self) -> None:
        self._last_progress_s = self._clock()

    def progress_stall_s(self) -> float:
        if self._loop_task is not None and self._loop_task.done():
            return float("inf")  # the loop is gone: nothing here will ever advance
        if not self._queue and self._running is None:
            return 0.0
        return max(0.0, self._clock() - self._last_progress_s)

    def hold(self) -> None:
        """Fault injection (tests): the loop stops advancing (takes no prompt, sends no layer)
        until ``release``, as a hung engine or transport would; the process stays alive."""
        logger.warning("prefill loop held (fault injection)")
        self._is_advancing.clear()

    def release(self) -> None:
        logger.warning("prefill loop released (fault injection)")
        self._is_advancing.set()

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            num_queued_prefill_tokens=self._num_queued_prefill_tokens,
            num_free_blocks=self.allocator.num_free_blocks,
            num_total_blocks=self.allocator.num_blocks,
        )

    # -- the queue ----------------------------------------------------------------------------

    async def prefill(self, ticket: PrefillTicket) -> PrefillResult:
        job = _Job(ticket, asyncio.get_running_loop().create_future(), otel_context.get_current())
        if not self._queue and self._running is None:
            self._advance()  # an idle loop was not stalled: the wait starts now
        self._jobs[ticket.token] = job
        self._queue.append(job)
        self._num_queued_prefill_tokens += len(ticket.prompt_token_ids)
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancel_reason = job.cancel_reason or "cancelled by caller"
            self._dequeue(job)
            raise
        finally:
            if self._jobs.get(ticket.token) is job:
                del self._jobs[ticket.token]

    def abort(self, token: FencingToken, reason: str) -> None:
        job = self._jobs.get(token)
        if job is None:
            return
        job.cancel_reason = reason or "dropped"
        if self._dequeue(job):
            del self._jobs[token]
            if not job.future.done():
                job.future.set_exception(StaleTokenError(f"ticket {token} dropped: {reason}"))

    def _dequeue(self, job: _Job) -> bool:
        """Take a job that has not started out of the queue; False if it is not there."""
        if job not in self._queue:
            return False
        self._queue.remove(job)
        self._num_queued_prefill_tokens -= len(job.ticket.prompt_token_ids)
        return True

    async def _loop(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._is_advancing.wait()
            if not self._queue:
                continue
            job = self._queue.popleft()
            self._running = job
            self._advance()
            attached = otel_context.attach(job.trace_context)
            try:
                if job.cancel_reason:
                    raise StaleTokenError(f"ticket {job.ticket.token} dropped: {job.cancel_reason}")
                result = await self._run(job)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - goes to the caller
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(result)
            finally:
                self._running = None
                self._advance()
                self._num_queued_prefill_tokens -= len(job.ticket.prompt_token_ids)
                otel_context.detach(attached)

    # -- one prompt ---------------------------------------------------------------------------

    async def _run(self, job: _Job) -> PrefillResult:
        ticket = job.ticket
        layout = self.engine.layout
        prompt = ticket.prompt_token_ids
        ticket.phase = PrefillPhase.PREFILLING
        hashes = prefix_block_hashes(prompt, layout.block_size_tokens)
        num_cached_blocks = 0
        for value in hashes:
            if value not in self._prefix_lru:
                break
            num_cached_blocks += 1
        num_cached_tokens = min(num_cached_blocks * layout.block_size_tokens, len(prompt) - 1)
        block_ids = self._allocate(layout.num_blocks_for(len(prompt)))
        sequence = Sequence(
            request_id=ticket.request_id or str(ticket.token), prompt_token_ids=prompt,
            max_tokens=1, block_ids=block_ids,
            num_computed_tokens=num_cached_tokens if self._is_prefix_cache_simulated else 0)
        assert self._transport is not None, "start() first"
        sender = self._transport.create_sender(self.engine.kv_cache)
        loop = asyncio.get_running_loop()
        ready = _ReadyLayers(loop)
        compute_done = threading.Event()
        engine = self.engine

        def compute() -> None:
            try:
                for layer in engine.prefill_layers(sequence):
                    ready.put(layer)
                ready.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                ready.put(exc)
            finally:
                compute_done.set()

        assert ticket.destination is not None  # takes_late_destinations is False: the agent checks
        num_sent = len(ticket.destination.block_ids)
        transfer_span: trace.Span | None = None
        try:
            with tracer.start_as_current_span("prefill.compute_and_send") as span:
                span.set_attribute("pdserve.num_prompt_tokens", len(prompt))
                # The KV hop itself, from opening the destination to its last acknowledgement;
                # it overlaps the compute (layers leave as they are done).
                transfer_span = tracer.start_span("kv.transfer", attributes={
                    "pdserve.ticket": str(ticket.token),
                    "pdserve.kv_address": ticket.destination.kv_address,
                    "pdserve.transport": ticket.destination.transport,
                    "pdserve.num_blocks": num_sent,
                })
                await sender.open(ticket.destination, ticket.token)
                started = time.perf_counter()
                compute_future = loop.run_in_executor(self._engine_thread, compute)
                is_computed = False
                while not is_computed:
                    layers: list[int] = []
                    for item in await ready.take_all():
                        if item is None:
                            is_computed = True
                            break
                        if isinstance(item, BaseException):
                            raise item
                        layers.append(item)
                    if not layers:
                        continue
                    self._advance()
                    await self._is_advancing.wait()
                    if job.cancel_reason:
                        raise StaleTokenError(
                            f"ticket {ticket.token} dropped: {job.cancel_reason}")
                    ticket.phase = PrefillPhase.SENDING
                    # Layers finished while the previous ones were being sent go out together.
                    with tracer.start_as_current_span("prefill.send_layer") as layer_span:
                        layer_span.set_attribute("pdserve.layer", layers[0])
                        layer_span.set_attribute("pdserve.num_layers", len(layers))
                        await sender.offer_layers(layers, block_ids[:num_sent])
                    self._advance()
                if not compute_done.is_set():  # it is, unless the thread has yet to return
                    await compute_future
                compute_end = time.perf_counter()
                compute_s = compute_end - started
                self._profile.append(ProfilePoint(len(prompt), 1, compute_s, True))
                result = await sender.finish(sequence.output_token_ids[0], compute_s)
                exposed_s = time.perf_counter() - compute_end
                transfer_span.set_attributes({
                    "pdserve.num_bytes": result.num_bytes, "pdserve.num_layers": result.num_layers,
                    "pdserve.exposed_ms": exposed_s * 1e3,
                })
                transfer_span.end()
                self._kv_checksums.append(checksum_of(
                    self.engine.kv_cache, ticket.token, block_ids[:num_sent],
                    frame_version=result.frame_version, crc32=result.kv_crc32))
        except BaseException as exc:
            if transfer_span is not None and transfer_span.is_recording():
                transfer_span.record_exception(exc)
                transfer_span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
                transfer_span.end()
            await sender.abort("prefill failed")
            raise
        finally:
            if not compute_done.is_set():
                await asyncio.to_thread(compute_done.wait)
            await sender.close()
            self.allocator.free(block_ids)
        self._remember_prefix(hashes)
        timing = TransferTiming(
            num_bytes=result.num_bytes, num_layers=result.num_layers, num_blocks=len(block_ids),
            prefill_compute_s=compute_s, transfer_s=result.transfer_s, exposed_s=exposed_s,
        )
        return PrefillResult(sequence.output_token_ids[0], timing, num_cached_tokens)

    # -- prefix cache -------------------------------------------------------------------------

    def _remember_prefix(self, hashes: list[int]) -> None:
        for value in hashes:
            if value in self._prefix_lru:
                self._prefix_lru.move_to_end(value)
                continue
            self._prefix_lru[value] = None
            self._prefix_added.add(value)
            self._prefix_removed.discard(value)
        while len(self._prefix_lru) > self._prefix_cache_blocks:
            evicted, _ = self._prefix_lru.popitem(last=False)
            self._prefix_removed.add(evicted)
            self._prefix_added.discard(evicted)

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        added, removed = list(self._prefix_added), list(self._prefix_removed)
        self._prefix_added.clear()
        self._prefix_removed.clear()
        return added, removed

    def all_prefix_hashes(self) -> list[int]:
        self._prefix_added.clear()
        self._prefix_removed.clear()
        return list(self._prefix_lru)
