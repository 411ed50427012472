"""The worker agent core: one per engine instance. It owns the engine's blocks (scheduler side),
the KV data path, and the batch loop; the gRPC servicer and the membership loop are adapters.

Decode side. ``admit`` allocates the ticket's physical blocks, records their owner (the fencing
token) in the owner table, and tells the transport receiver to expect the prompt's layers there;
only frames whose token owns every target block are written. ``decode`` waits for the last layer
(or prefills locally), then joins the continuous batch and streams tokens. When the sequence
ends, its blocks return to the free list and the ledger is told (off the token path).

Prefill side. ``prefill`` queues the prompt (FIFO, renewing the ticket's lease while it waits),
computes it layer by layer in the engine thread and hands each finished layer to the transport
while the next one computes; the first token travels with the last frame. Then the local copy is
freed (its prefix hashes stay in the prefix index the router consults).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.common.errors import (
    CapacityError,
    DeadlineError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    StaleTokenError,
    UnavailableError,
)
from pdserve.common.tokenizer import prefix_block_hashes
from pdserve.common.types import FencingToken, TicketState, WorkerLoad, WorkerRole, WorkerState
from pdserve.worker.engine import BlockAllocator, Engine, Sequence
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.base import KvReceiver
from pdserve.worker.transports.values import KvDestinationSpec
from pdserve.worker.transports.registry import TransportBackend

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """What one handoff cost, seconds, and how many bytes it moved."""

    num_bytes: int = 0
    num_layers: int = 0
    num_blocks: int = 0
    prefill_compute_s: float = 0.0
    transfer_s: float = 0.0
    exposed_s: float = 0.0


def estimate_exposed_s(result: object) -> float:
    """Transfer time the request saw after prefill ended, from the receiver's own clock.

    Layer l of L finishes computing at ``(l + 1) / L`` of the prefill time, and the first layer
    lands one wire delay after it finished. So prefill ended about
    ``prefill_compute_s x (L - 1) / L`` after the first layer landed, and what lands after that
    is exposed. Clock-free (no comparison with the sender's clock); it slightly underestimates by
    the wire delay of the first layer. The sender measures the same quantity exactly
    (``PrefillResponse.stats.exposed_ms``).
    """
    num_layers = max(1, result.num_layers)  # type: ignore[attr-defined]
    hidden_s = result.prefill_compute_s * (num_layers - 1) / num_layers  # type: ignore[attr-defined]
    return max(0.0, result.transfer_s - hidden_s)  # type: ignore[attr-defined]


def kv_checksum(kv_cache: object, block_ids: list[int]) -> int:
    """CRC-32 of every layer of ``block_ids`` (layer-major, blocks in sequence order): what both
    sides of a handoff compute over the prompt's KV, so an audit can compare them."""
    crc = 0
    ids = np.asarray(block_ids, dtype=np.int64)
    for buffer in kv_cache.layer_buffers:  # type: ignore[attr-defined]
        crc = zlib.crc32(np.ascontiguousarray(buffer[ids]), crc)
    return crc


@dataclass(frozen=True, slots=True)
class KvChecksum:
    """One handoff's prompt KV as one side saw it (sent by prefill, accepted by decode)."""

    token: FencingToken
    crc32: int
    num_blocks: int
    num_layers: int


MAX_CHECKSUMS = 4096
"""Recent handoffs whose checksums a worker keeps for audits."""


class ControlPlane(Protocol):
    """What the agent tells the coordinator. Calls are best effort and off the token path."""

    async def report(self, token: FencingToken, state: TicketState, timing: TransferTiming | None) -> None: ...

    async def renew(self, token: FencingToken, lease_s: float) -> None: ...

    async def release(self, token: FencingToken) -> None: ...


@runtime_checkable
class ExpertParallelEngine(Protocol):
    """An engine that spreads MoE experts over its GPUs (expert parallelism): it counts the
    tokens routed to each expert and runs the expert placement the governor rolls out."""

    num_moe_layers: int
    num_experts: int
    num_expert_gpus: int

    def install_expert_placement(self, slot_to_expert: np.ndarray) -> None:
        """Use ``[num_moe_layers, num_slots]`` from the next forward pass on."""
        ...

    def take_expert_token_counts(self) -> np.ndarray:
        """``[num_moe_layers, num_experts]`` tokens routed since the previous call."""
        ...


def _checked_slot_map(engine: ExpertParallelEngine, num_layers: int, num_slots: int,
                      slot_to_expert: list[int]) -> np.ndarray:
    """The slot map as ``int64[num_layers, num_slots]``, or ``InvalidArgumentError``."""
    if num_layers != engine.num_moe_layers:
        raise InvalidArgumentError(
            f"num_layers: the engine has {engine.num_moe_layers} MoE layers, got {num_layers}",
            field="num_layers")
    if num_slots < engine.num_experts or num_slots % engine.num_expert_gpus:
        raise InvalidArgumentError(
            f"num_slots: must be >= num_experts ({engine.num_experts}) and a multiple of the "
            f"instance's {engine.num_expert_gpus} GPUs, got {num_slots}", field="num_slots")
    slot_map = np.asarray(slot_to_expert, dtype=np.int64)
    if slot_map.size != num_layers * num_slots:
        raise InvalidArgumentError("slot_to_expert: length must be num_layers x num_slots",
                                   field="slot_to_expert")
    slot_map = slot_map.reshape(num_layers, num_slots)
    if slot_map.min() < 0 or slot_map.max() >= engine.num_experts:
        raise InvalidArgumentError(
            f"slot_to_expert: expert ids must be in [0, {engine.num_experts})",
            field="slot_to_expert")
    for layer, row in enumerate(slot_map):
        if np.unique(row).size != engine.num_experts:
            raise InvalidArgumentError(
                f"slot_to_expert: layer {layer} leaves an expert without a slot",
                field="slot_to_expert")
    return slot_map


class NullControlPlane:
    async def report(self, token: FencingToken, state: TicketState, timing: TransferTiming | None) -> None:
        return None

    async def renew(self, token: FencingToken, lease_s: float) -> None:
        return None

    async def release(self, token: FencingToken) -> None:
        return None


@dataclass(frozen=True, slots=True)
class AgentConfig:
    worker_id: str
    deployment: str
    role: WorkerRole
    transport: str = "tcp"
    max_batch_size: int = 256
    prefix_cache_blocks: int = 4096
    """Prefill side: prefix hashes remembered (LRU) and reported for prefix-aware routing."""
    is_prefix_cache_simulated: bool = False
    """Sim engine: cached prefix tokens are not recomputed (timing only; KV is still sent)."""
    kv_wait_timeout_s: float = 30.0


@dataclass(slots=True)
class _DecodeTicket:
    token: FencingToken
    block_ids: list[int]
    num_prompt_tokens: int
    phase: str = "admitted"
    sequence: Sequence | None = None
    queue: asyncio.Queue[int | None] | None = None
    admitted_at: float = field(default_factory=time.perf_counter)
    dropped: str = ""


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


@dataclass(slots=True)
class _PrefillJob:
    token: FencingToken
    prompt_token_ids: list[int]
    destination: KvDestinationSpec
    lease_s: float
    request_id: str
    future: asyncio.Future[tuple[int, TransferTiming, int]]
    phase: str = "queued"
    cancel_reason: str = ""
    reported_state: TicketState | None = None
    trace_context: otel_context.Context | None = None
    """The Prefill call's trace context: the job runs on the prefill loop's task, which would
    otherwise start a trace of its own."""


class WorkerAgent:
    def __init__(
        self,
        config: AgentConfig,
        engine: Engine,
        transport: TransportBackend,
        control: ControlPlane | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.allocator = BlockAllocator(engine.layout.num_blocks)
        self.owners = BlockOwnerTable(engine.layout.num_blocks)
        self.transport = transport
        self.control: ControlPlane = control or NullControlPlane()
        self.state = WorkerState.REGISTERING
        self.kv_address = ""
        self._receiver: KvReceiver | None = None
        # One engine thread: the engine is not re-entrant; prefill and decode steps serialise.
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._decode: dict[str, _DecodeTicket] = {}
        self._running: list[_DecodeTicket] = []
        self._batch_wakeup = asyncio.Event()
        self._prefill_queue: collections.deque[_PrefillJob] = collections.deque()
        self._prefill_jobs: dict[str, _PrefillJob] = {}
        self._prefill_wakeup = asyncio.Event()
        self._num_queued_prefill_tokens = 0
        self._prefix_lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._prefix_added: set[int] = set()
        self._prefix_removed: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self.profile: collections.deque[tuple[int, int, float, bool]] = collections.deque(maxlen=512)
        self.expert_placement_version = 0
        self._slot_to_expert: list[int] = []
        self._control_chains: dict[str, asyncio.Future[None]] = {}
        self.kv_checksums: collections.deque[KvChecksum] = collections.deque(maxlen=MAX_CHECKSUMS)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, kv_host: str = "127.0.0.1", kv_port: int = 0) -> None:
        if self.config.role is WorkerRole.DECODE:
            self._receiver = self.transport.create_receiver(self.engine.kv_cache, self.owners)
            self.kv_address = await self._receiver.start(kv_host, kv_port)
            self._tasks.append(asyncio.create_task(self._decode_loop(), name="decode-loop"))
        else:
            self._tasks.append(asyncio.create_task(self._prefill_loop(), name="prefill-loop"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        if self._receiver is not None:
            await self._receiver.close()
        self._engine_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def receiver(self) -> KvReceiver | None:
        """Decode side: the KV receiver (its refusal and fencing counters); None on prefill."""
        return self._receiver

    @property
    def num_in_flight(self) -> int:
        return len(self._decode) + len(self._prefill_jobs)

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            num_queued_prefill_tokens=self._num_queued_prefill_tokens,
            num_running_seqs=len(self._running),
            num_free_blocks=self.allocator.num_free_blocks,
            num_total_blocks=self.allocator.num_blocks,
        )

    def held_blocks(self) -> dict[str, int]:
        """Decode side: blocks owned per fencing token, for ledger reconciliation."""
        return {str(t.token): len(t.block_ids) for t in self._decode.values()}

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        added, removed = list(self._prefix_added), list(self._prefix_removed)
        self._prefix_added.clear()
        self._prefix_removed.clear()
        return added, removed

    def all_prefix_hashes(self) -> list[int]:
        self._prefix_added.clear()
        self._prefix_removed.clear()
        return list(self._prefix_lru)

    def tickets(self) -> list[tuple[FencingToken, int, str]]:
        decode = [(t.token, len(t.block_ids), t.phase) for t in self._decode.values()]
        prefill = [(j.token, 0, j.phase) for j in self._prefill_jobs.values()]
        return decode + prefill

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def begin_drain(self, reason: str = "") -> None:
        """Take no new work; the membership loop reports DRAINED once nothing is in flight."""
        if self.state in (WorkerState.REGISTERING, WorkerState.LOADING, WorkerState.READY):
            logger.info("worker %s draining: %s", self.config.worker_id, reason or "requested")
            self.state = WorkerState.DRAINING

    def apply_expert_placement(self, version: int, num_layers: int, num_slots: int,
                               slot_to_expert: list[int]) -> int:
        """Install placement ``version`` (a flattened ``[num_layers, num_slots]`` slot map) and
        return the slots whose expert changed, i.e. the expert weights a real engine loads.

        A version at or below the one in force is acknowledged without change (roll-outs are
        retried). An expert-parallel engine validates the map against its MoE shape
        (``InvalidArgumentError`` naming the constraint) and swaps it in between two forward
        passes; requests keep running on the old map until then.
        """
        if version <= self.expert_placement_version:
            return 0
        moe = self._moe_engine()
        if moe is not None:
            moe.install_expert_placement(_checked_slot_map(moe, num_layers, num_slots, slot_to_expert))
        if len(self._slot_to_expert) == len(slot_to_expert):
            moved = sum(1 for a, b in zip(self._slot_to_expert, slot_to_expert, strict=True) if a != b)
        else:
            moved = len(slot_to_expert)
        self._slot_to_expert = list(slot_to_expert)
        self.expert_placement_version = version
        return moved

    def take_expert_token_counts(self) -> tuple[int, list[int]]:
        """``(num_moe_layers, flattened [layers, experts] token counts)`` routed since the previous
        call, for the heartbeat; ``(0, [])`` for a dense engine or when nothing was routed."""
        moe = self._moe_engine()
        if moe is None:
            return 0, []
        counts = moe.take_expert_token_counts()
        if not counts.any():
            return 0, []
        return moe.num_moe_layers, counts.reshape(-1).tolist()

    def _moe_engine(self) -> ExpertParallelEngine | None:
        engine = self.engine
        if isinstance(engine, ExpertParallelEngine) and engine.num_moe_layers > 0:
            return engine
        return None

    def _control(self, token: FencingToken, call: Awaitable[None]) -> None:
        """Run control-plane calls of one ticket in order (DONE before release), off the token
        path; failures are logged (the coordinator also learns through leases and heartbeats)."""
        key = str(token)
        previous = self._control_chains.get(key)

        async def chained() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                await call
            except Exception as exc:  # noqa: BLE001 - best effort by design
                logger.debug("control-plane call for %s failed: %s", key, exc)

        future = asyncio.ensure_future(chained())
        self._control_chains[key] = future
        self._background.add(future)  # type: ignore[arg-type]

        def done(f: asyncio.Future[None]) -> None:
            self._background.discard(f)  # type: ignore[arg-type]
            if self._control_chains.get(key) is f:
                del self._control_chains[key]

        future.add_done_callback(done)

    def _check_accepting(self) -> None:
        if self.state is not WorkerState.READY:
            raise UnavailableError(f"worker {self.config.worker_id} is {self.state}")

    # -- decode side --------------------------------------------------------------------------

    def admit(self, token: FencingToken, num_prompt_tokens: int, num_blocks: int) -> KvDestinationSpec:
        """Allocate the ticket's blocks, make the token their owner, expect the prompt's layers."""
        self._require_role(WorkerRole.DECODE)
        self._check_accepting()
        self._validate_blocks(num_prompt_tokens, num_blocks)
        key = str(token)
        if key in self._decode:
            raise InvalidArgumentError(f"token: ticket {key} already admitted", field="token")
        block_ids = self._allocate(num_blocks)
        self.owners.assign(token, block_ids)
        ticket = _DecodeTicket(token=token, block_ids=block_ids, num_prompt_tokens=num_prompt_tokens)
        self._decode[key] = ticket
        num_prompt_blocks = self.engine.layout.num_blocks_for(num_prompt_tokens)
        assert self._receiver is not None
        self._receiver.expect(token, block_ids[:num_prompt_blocks], self.engine.layout.num_layers)
        return KvDestinationSpec(
            kv_address=self.kv_address,
            block_ids=tuple(block_ids[:num_prompt_blocks]),
            transport=self.transport.name,
            layout=self.engine.layout,
            metadata=self._receiver.metadata(),
            decode_worker_id=self.config.worker_id,
        )

    def _validate_blocks(self, num_prompt_tokens: int, num_blocks: int) -> None:
        if num_prompt_tokens <= 0:
            raise InvalidArgumentError("num_prompt_tokens: must be > 0", field="num_prompt_tokens")
        if num_blocks < self.engine.layout.num_blocks_for(num_prompt_tokens + 1):
            raise InvalidArgumentError(
                f"num_blocks: {num_blocks} cannot hold {num_prompt_tokens} prompt tokens and one "
                f"more", field="num_blocks")
        if num_blocks > self.allocator.num_blocks:
            raise InvalidArgumentError(
                f"num_blocks: {num_blocks} exceeds the worker's {self.allocator.num_blocks}",
                field="num_blocks")

    def _allocate(self, num_blocks: int) -> list[int]:
        try:
            return self.allocator.allocate(num_blocks)
        except MemoryError as exc:
            raise CapacityError(f"worker {self.config.worker_id}: {exc}", retry_after_s=0.2) from None

    async def decode(
        self,
        token: FencingToken,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        is_local_prefill: bool = False,
        num_blocks: int = 0,
        kv_wait_timeout_s: float | None = None,
        request_id: str = "",
    ) -> AsyncIterator[tuple[list[int], TransferTiming | None]]:
        """Yield (new tokens, timing-on-first-chunk); ends after ``max_tokens`` tokens."""
        self._require_role(WorkerRole.DECODE)
        if max_tokens <= 0:
            raise InvalidArgumentError("sampling.max_tokens: must be > 0", field="sampling.max_tokens")
        if not prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids: empty", field="prompt_token_ids")
        key = str(token)
        timing: TransferTiming | None = None
        checksum_block_ids: list[int] = []
        if is_local_prefill:
            self._check_accepting()
            self._validate_blocks(len(prompt_token_ids), num_blocks)
            if key in self._decode:
                raise InvalidArgumentError(f"token: ticket {key} already admitted", field="token")
            block_ids = self._allocate(num_blocks)
            self.owners.assign(token, block_ids)
            ticket = _DecodeTicket(token=token, block_ids=block_ids,
                                   num_prompt_tokens=len(prompt_token_ids), phase="prefilling")
            self._decode[key] = ticket
            sequence = Sequence(request_id=request_id or key, prompt_token_ids=list(prompt_token_ids),
                                max_tokens=max_tokens, block_ids=block_ids)
            try:
                with tracer.start_as_current_span("decode.local_prefill"):
                    started = time.perf_counter()
                    await self._run_engine(lambda: list(self.engine.prefill_layers(sequence)))
                    self.profile.append((len(prompt_token_ids), 1, time.perf_counter() - started, True))
            except BaseException:
                self._free_decode(key, "local prefill failed")
                raise
            self._control(token, self.control.report(token, TicketState.DONE, None))
        else:
            ticket = self._decode.get(key)
            if ticket is None:
                raise StaleTokenError(f"token: ticket {key} is not admitted here (or was dropped)")
            if len(prompt_token_ids) != ticket.num_prompt_tokens:
                raise InvalidArgumentError(
                    f"prompt_token_ids: {len(prompt_token_ids)} tokens, ticket admitted "
                    f"{ticket.num_prompt_tokens}", field="prompt_token_ids")
            ticket.phase = "receiving"
            assert self._receiver is not None
            wait_s = kv_wait_timeout_s or self.config.kv_wait_timeout_s
            try:
                with tracer.start_as_current_span("decode.await_kv"):
                    result = await self._receiver.wait(token, wait_s)
            except DeadlineError:
                self._free_decode(key, "kv wait timed out")
                raise DeadlineError(f"KV of ticket {key} did not arrive within {wait_s:.1f}s") from None
            except PdserveError:
                self._free_decode(key, "transfer failed")
                raise
            except asyncio.CancelledError:
                self._free_decode(key, "cancelled")
                raise
            if ticket.dropped:
                raise StaleTokenError(f"ticket {key} was dropped: {ticket.dropped}")
            # Checksummed once the first token is out (off the time to first token), and before
            # the sequence joins the batch (no decode step has written into its blocks yet).
            checksum_block_ids = ticket.block_ids[
                :self.engine.layout.num_blocks_for(len(prompt_token_ids))]
            sequence = Sequence(
                request_id=request_id or key, prompt_token_ids=list(prompt_token_ids),
                max_tokens=max_tokens, block_ids=ticket.block_ids,
                num_computed_tokens=len(prompt_token_ids),
                output_token_ids=[result.first_token_id],
            )
            timing = TransferTiming(
                num_bytes=result.num_bytes, num_layers=result.num_layers,
                num_blocks=result.num_blocks, prefill_compute_s=result.prefill_compute_s,
                transfer_s=result.transfer_s, exposed_s=estimate_exposed_s(result),
            )
            self._control(token, self.control.report(token, TicketState.DONE, timing))
        ticket.sequence = sequence
        ticket.phase = "decoding"
        try:
            yield [sequence.output_token_ids[0]], timing
            if checksum_block_ids:
                self._record_checksum(token, checksum_block_ids)
                checksum_block_ids = []
            if sequence.is_finished:
                return
            ticket.queue = asyncio.Queue()
            self._running.append(ticket)
            self._batch_wakeup.set()
            while True:
                new_token = await ticket.queue.get()
                if new_token is None:
                    if ticket.dropped:
                        raise StaleTokenError(f"ticket {key} was dropped: {ticket.dropped}")
                    return
                yield [new_token], None
        finally:
            if checksum_block_ids:  # closed at the first token
                self._record_checksum(token, checksum_block_ids)
            if ticket in self._running:
                self._running.remove(ticket)
            self._free_decode(key, "")
            self._control(token, self.control.release(token))

    async def _decode_loop(self) -> None:
        """Continuous batching: one engine step over every running sequence, repeatedly."""
        while True:
            if not self._running:
                self._batch_wakeup.clear()
                await self._batch_wakeup.wait()
                continue
            batch = [t for t in self._running[: self.config.max_batch_size] if t.sequence]
            sequences = [t.sequence for t in batch if t.sequence is not None]
            started = time.perf_counter()
            try:
                tokens = await self._run_engine(lambda: self.engine.decode_step(sequences))
            except Exception:  # noqa: BLE001 - fail the batch, keep the loop
                logger.exception("decode step failed")
                for ticket in batch:
                    ticket.dropped = "engine failure"
                    self._finish_running(ticket)
                continue
            self.profile.append((sum(s.num_tokens for s in sequences), len(sequences),
                                 time.perf_counter() - started, False))
            for ticket, new_token in zip(batch, tokens, strict=True):
                assert ticket.queue is not None and ticket.sequence is not None
                ticket.queue.put_nowait(new_token)
                if ticket.sequence.is_finished:
                    self._finish_running(ticket)

    def _record_checksum(self, token: FencingToken, block_ids: list[int]) -> None:
        """Keep the checksum of a handoff's prompt KV as it landed here, for audits."""
        self.kv_checksums.append(KvChecksum(token, kv_checksum(self.engine.kv_cache, block_ids),
                                            len(block_ids), self.engine.layout.num_layers))

    def _finish_running(self, ticket: _DecodeTicket) -> None:
        if ticket in self._running:
            self._running.remove(ticket)
        if ticket.queue is not None:
            ticket.queue.put_nowait(None)

    def _free_decode(self, key: str, reason: str) -> int:
        ticket = self._decode.pop(key, None)
        if ticket is None:
            return 0
        if self._receiver is not None:
            self._receiver.cancel(ticket.token, reason or "finished")
        self.owners.release(ticket.token)
        self.allocator.free(ticket.block_ids)
        return len(ticket.block_ids)

    # -- prefill side -------------------------------------------------------------------------

    async def prefill(
        self, token: FencingToken, prompt_token_ids: list[int], destination: KvDestinationSpec,
        lease_s: float, request_id: str = "",
    ) -> tuple[int, TransferTiming, int]:
        """Queue, compute and ship a prompt; returns (first token, timing, cached prompt tokens)."""
        self._require_role(WorkerRole.PREFILL)
        self._check_accepting()
        if not prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids: empty", field="prompt_token_ids")
        if destination.layout.num_layers != self.engine.layout.num_layers or (
            destination.layout.block_size_tokens != self.engine.layout.block_size_tokens
            or destination.layout.block_nbytes != self.engine.layout.block_nbytes
        ):
            raise InvalidArgumentError(
                f"destination.kv_layout: {destination.layout} does not match this worker's "
                f"{self.engine.layout}", field="destination.kv_layout")
        if len(destination.block_ids) != self.engine.layout.num_blocks_for(len(prompt_token_ids)):
            raise InvalidArgumentError(
                f"destination.block_ids: {len(destination.block_ids)} blocks for "
                f"{len(prompt_token_ids)} tokens", field="destination.block_ids")
        key = str(token)
        if key in self._prefill_jobs:
            raise InvalidArgumentError(f"token: ticket {key} is already queued", field="token")
        job = _PrefillJob(token, list(prompt_token_ids), destination, lease_s, request_id,
                          asyncio.get_running_loop().create_future(),
                          trace_context=otel_context.get_current())
        self._prefill_jobs[key] = job
        self._prefill_queue.append(job)
        self._num_queued_prefill_tokens += len(prompt_token_ids)
        self._prefill_wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancel_reason = job.cancel_reason or "cancelled by caller"
            if job in self._prefill_queue:
                self._prefill_queue.remove(job)
                self._num_queued_prefill_tokens -= len(job.prompt_token_ids)
            raise
        finally:
            self._prefill_jobs.pop(key, None)

    async def _prefill_loop(self) -> None:
        while True:
            if not self._prefill_queue:
                self._prefill_wakeup.clear()
                await self._prefill_wakeup.wait()
                continue
            job = self._prefill_queue.popleft()
            attached = otel_context.attach(job.trace_context) if job.trace_context is not None else None
            try:
                if job.cancel_reason:
                    raise StaleTokenError(f"ticket {job.token} dropped: {job.cancel_reason}")
                result = await self._run_prefill(job)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - goes to the caller
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(result)
            finally:
                self._num_queued_prefill_tokens -= len(job.prompt_token_ids)
                if attached is not None:
                    otel_context.detach(attached)

    async def _run_prefill(self, job: _PrefillJob) -> tuple[int, TransferTiming, int]:
        layout = self.engine.layout
        prompt = job.prompt_token_ids
        job.phase = "prefilling"
        hashes = prefix_block_hashes(prompt, layout.block_size_tokens)
        num_cached_blocks = 0
        for value in hashes:
            if value not in self._prefix_lru:
                break
            num_cached_blocks += 1
        num_cached_tokens = min(num_cached_blocks * layout.block_size_tokens, len(prompt) - 1)
        block_ids = self._allocate(layout.num_blocks_for(len(prompt)))
        sequence = Sequence(request_id=job.request_id or str(job.token), prompt_token_ids=prompt,
                            max_tokens=1, block_ids=block_ids,
                            num_computed_tokens=num_cached_tokens if self.config.is_prefix_cache_simulated else 0)
        sender = self.transport.create_sender(self.engine.kv_cache)
        loop = asyncio.get_running_loop()
        ready = _ReadyLayers(loop)
        compute_done = threading.Event()

        def compute() -> None:
            try:
                for layer in self.engine.prefill_layers(sequence):
                    ready.put(layer)
                ready.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                ready.put(exc)
            finally:
                compute_done.set()

        try:
            with tracer.start_as_current_span("prefill.compute_and_send") as span:
                span.set_attribute("pdserve.num_prompt_tokens", len(prompt))
                await sender.open(job.destination, job.token)
                started = time.perf_counter()
                compute_future = loop.run_in_executor(self._engine_thread, compute)
                first_sent = None
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
                    if job.cancel_reason:
                        raise StaleTokenError(f"ticket {job.token} dropped: {job.cancel_reason}")
                    if first_sent is None:
                        first_sent = time.perf_counter()
                        job.phase = "sending"
                    # Layers finished while the previous ones were being sent go out together.
                    with tracer.start_as_current_span("prefill.send_layer") as layer_span:
                        layer_span.set_attribute("pdserve.layer", layers[0])
                        layer_span.set_attribute("pdserve.num_layers", len(layers))
                        await sender.offer_layers(layers, block_ids[:len(job.destination.block_ids)])
                if not compute_done.is_set():  # it is, unless the thread has yet to return
                    await compute_future
                compute_end = time.perf_counter()
                compute_s = compute_end - started
                self.profile.append((len(prompt), 1, compute_s, True))
                result = await sender.finish(sequence.output_token_ids[0], compute_s)
                exposed_s = time.perf_counter() - compute_end
                num_sent = len(job.destination.block_ids)
                self.kv_checksums.append(KvChecksum(
                    job.token, kv_checksum(self.engine.kv_cache, block_ids[:num_sent]),
                    num_sent, layout.num_layers))
        except BaseException:
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
        return sequence.output_token_ids[0], timing, num_cached_tokens

    def _remember_prefix(self, hashes: list[int]) -> None:
        for value in hashes:
            if value in self._prefix_lru:
                self._prefix_lru.move_to_end(value)
                continue
            self._prefix_lru[value] = None
            self._prefix_added.add(value)
            self._prefix_removed.discard(value)
        while len(self._prefix_lru) > self.config.prefix_cache_blocks:
            evicted, _ = self._prefix_lru.popitem(last=False)
            self._prefix_removed.add(evicted)
            self._prefix_added.discard(evicted)

    async def renew_queued_leases(self) -> None:
        """Prefill side, called periodically (the heartbeat cadence): renew the leases of queued
        prompts (the waiting side renews) and report the progress of prompts in flight.

        Progress is reported here rather than as it happens, so a prompt that goes from queue to
        landed between two calls costs the coordinator nothing but the decode side's DONE; only
        long prefills and transfers show PREFILLING / TRANSFERRING in the ticket's history.
        """
        for job in list(self._prefill_jobs.values()):
            if job.phase == "queued":
                self._control(job.token, self.control.renew(job.token, job.lease_s))
                continue
            state = TicketState.PREFILLING if job.phase == "prefilling" else TicketState.TRANSFERRING
            if job.reported_state is not state:
                job.reported_state = state
                self._control(job.token, self.control.report(job.token, state, None))

    # -- either side --------------------------------------------------------------------------

    def drop(self, token: FencingToken, reason: str) -> int:
        """Drop whatever this worker has for the ticket; returns the blocks freed."""
        key = str(token)
        job = self._prefill_jobs.get(key)
        if job is not None:
            job.cancel_reason = reason or "dropped"
            if job in self._prefill_queue:
                self._prefill_queue.remove(job)
                self._num_queued_prefill_tokens -= len(job.prompt_token_ids)
                self._prefill_jobs.pop(key, None)
                if not job.future.done():
                    job.future.set_exception(StaleTokenError(f"ticket {key} dropped: {reason}"))
            return 0
        ticket = self._decode.get(key)
        if ticket is None:
            return 0
        ticket.dropped = reason or "dropped"
        if ticket in self._running or ticket.queue is not None:
            self._finish_running(ticket)  # the decode stream frees the blocks as it ends
            return len(ticket.block_ids)
        return self._free_decode(key, reason)

    def _require_role(self, role: WorkerRole) -> None:
        if self.config.role is not role:
            raise InvalidArgumentError(
                f"worker {self.config.worker_id} is a {self.config.role} worker", field="worker")

    async def _run_engine(self, fn: Callable[[], object]) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn)

    def ensure_exists(self, token: FencingToken) -> None:
        if str(token) not in self._decode and str(token) not in self._prefill_jobs:
            raise NotFoundError(f"token: no work for ticket {token}", field="token")
