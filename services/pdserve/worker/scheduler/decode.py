"""The in-house decode runtime: blocks allocated at admission, the prompt's KV received into them
(or computed here), and continuous batching over every running sequence.

``admit`` allocates the ticket's blocks and claims them for its fencing token
(``worker.kv_landing.KvLanding``: owner table, then the receiver expects the prompt's layers), so
the destination is known at once. ``decode`` waits for the last layer (or prefills locally),
yields the first token, checksums the prompt's KV as it landed, and joins the batch; one engine
step serves every running sequence, repeatedly. When a stream ends, however it ends, the receiver
refuses anything more of its ticket, the blocks lose their owner and return to the free list.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from functools import partial

from opentelemetry import trace

from pdserve.common.errors import DeadlineError, PdserveError, StaleTokenError
from pdserve.common.types import FencingToken, WorkerLoad
from pdserve.worker.engine import Engine, Sequence
from pdserve.worker.kv_landing import KvLanding
from pdserve.worker.runtime import (
    DecodeChunk,
    DecodeRequest,
    KvIntake,
    KvPlacement,
    ProfilePoint,
    TransferTiming,
    estimate_exposed_s,
)
from pdserve.worker.scheduler.engine_thread import EngineScheduler
from pdserve.worker.transports.registry import TransportBackend
from pdserve.worker.transports.values import TransferResult

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


@dataclass(slots=True, eq=False)
class _Slot:
    """One ticket's blocks and, once it decodes, its sequence."""

    token: FencingToken
    block_ids: list[int]
    sequence: Sequence | None = None
    tokens: asyncio.Queue[int | None] | None = None
    """New tokens from the batch loop; None ends the stream."""
    is_held_by_stream: bool = False
    """A stream computes into or decodes from the blocks: it frees them when it ends."""
    aborted: str = ""
    transfer: TransferResult | None = None
    """The prompt KV's handoff, once it landed."""


def _timing_of(result: TransferResult) -> TransferTiming:
    return TransferTiming(
        num_bytes=result.num_bytes, num_layers=result.num_layers, num_blocks=result.num_blocks,
        prefill_compute_s=result.prefill_compute_s, transfer_s=result.transfer_s,
        exposed_s=estimate_exposed_s(result),
    )


class DecodeScheduler(EngineScheduler):
    """Implements ``worker.runtime.DecodeRuntime`` over an in-house ``Engine``."""

    def __init__(self, engine: Engine, *, max_batch_size: int = 256,
                 step_pause_s: float = 0.0) -> None:
        """``step_pause_s``: a pause before each decode step (fault injection in tests: a test
        sees token k and acts before token k + 1 exists); 0 = none."""
        super().__init__(engine)
        self._max_batch_size = max_batch_size
        self._step_pause_s = step_pause_s
        self.landing = KvLanding(engine.kv_cache)
        self._slots: dict[FencingToken, _Slot] = {}
        self._running: list[_Slot] = []
        self._batch_wakeup = asyncio.Event()

    async def start(self, kv_host: str, kv_port: int, transport: TransportBackend) -> KvIntake:
        kv_address = await self.landing.start(kv_host, kv_port, transport)
        self._tasks.append(asyncio.create_task(self._batch_loop(), name="decode-loop"))
        return KvIntake(kv_address, self.landing.receiver)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.landing.close()
        await super().close()

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            num_running_seqs=len(self._running),
            num_free_blocks=self.allocator.num_free_blocks,
            num_total_blocks=self.allocator.num_blocks,
        )

    # -- tickets ------------------------------------------------------------------------------

    def admit(self, token: FencingToken, num_prompt_tokens: int, num_blocks: int) -> KvPlacement:
        block_ids = self._allocate(num_blocks)
        try:
            placement = self.landing.claim(token, block_ids, num_prompt_tokens)
        except BaseException:
            self.allocator.free(block_ids)
            raise
        self._slots[token] = _Slot(token, block_ids)
        return placement

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        return [], []  # decoded sequences are not kept for reuse: no prefix cache here

    def all_prefix_hashes(self) -> list[int]:
        return []

    def abort(self, token: FencingToken, reason: str) -> int:
        slot = self._slots.get(token)
        if slot is None:
            return 0
        slot.aborted = reason or "dropped"
        if slot.is_held_by_stream:
            self._finish_running(slot)  # the stream frees the blocks as it ends
            return len(slot.block_ids)
        return self._free(slot, reason)

    def _free(self, slot: _Slot, reason: str) -> int:
        """Nothing more of the ticket lands, its blocks lose their owner and are free again."""
        if self._slots.get(slot.token) is not slot:
            return 0
        del self._slots[slot.token]
        self.landing.release(slot.token, reason or "finished")
        self.allocator.free(slot.block_ids)
        return len(slot.block_ids)

    # -- one sequence -------------------------------------------------------------------------

    async def decode(self, request: DecodeRequest) -> AsyncGenerator[DecodeChunk, None]:
        timing: TransferTiming | None = None
        checksum_block_ids: list[int] = []
        if request.is_local_prefill:
            slot, sequence = await self._prefill_locally(request)
        else:
            slot, sequence, timing = await self._receive(request)
            # Checksummed once the first token is out (off the time to first token), and before
            # the sequence joins the batch (no decode step has written into its blocks yet).
            checksum_block_ids = slot.block_ids[
                :self.layout.num_blocks_for(len(request.prompt_token_ids))]
        try:
            yield DecodeChunk([sequence.output_token_ids[0]], timing)
            if checksum_block_ids:
                self._record_checksum(slot.token, checksum_block_ids, slot.transfer)
                checksum_block_ids = []
            if sequence.is_finished:
                return
            if slot.aborted:
                raise StaleTokenError(f"ticket {slot.token} was dropped: {slot.aborted}")
            slot.sequence, slot.tokens = sequence, asyncio.Queue()
            self._running.append(slot)
            self._batch_wakeup.set()
            tokens = slot.tokens
            while True:
                new_token = await tokens.get()
                # Tokens made while the previous chunk was being sent (a consumer slower than
                # the engine) go out together: one message, not one per step.
                chunk: list[int] = []
                while new_token is not None:
                    chunk.append(new_token)
                    if tokens.empty():
                        break
                    new_token = tokens.get_nowait()
                if chunk:
                    yield DecodeChunk(chunk)
                if new_token is None:
                    if slot.aborted:
                        raise StaleTokenError(f"ticket {slot.token} was dropped: {slot.aborted}")
                    return
        finally:
            if checksum_block_ids:  # closed at the first token
                self._record_checksum(slot.token, checksum_block_ids, slot.transfer)
            if slot in self._running:
                self._running.remove(slot)
            self._free(slot, "")

    async def _prefill_locally(self, request: DecodeRequest) -> tuple[_Slot, Sequence]:
        """Blocks for the ticket, owned by its token, with the prompt computed into them."""
        block_ids = self._allocate(request.num_blocks)
        try:
            self.landing.own(request.token, block_ids)
        except BaseException:
            self.allocator.free(block_ids)
            raise
        slot = _Slot(request.token, block_ids, is_held_by_stream=True)
        self._slots[request.token] = slot
        prompt = list(request.prompt_token_ids)
        sequence = Sequence(request_id=request.request_id or str(request.token),
                            prompt_token_ids=prompt, max_tokens=request.max_tokens,
                            block_ids=block_ids)
        try:
            with tracer.start_as_current_span("decode.local_prefill"):
                started = time.perf_counter()
                await self._run_engine(lambda: list(self.engine.prefill_layers(sequence)))
                self._profile.append(
                    ProfilePoint(len(prompt), 1, time.perf_counter() - started, True))
        except BaseException:
            self._free(slot, "local prefill failed")
            raise
        return slot, sequence

    async def _receive(self, request: DecodeRequest
                       ) -> tuple[_Slot, Sequence, TransferTiming]:
        """The admitted ticket's slot once every layer of its prompt has landed."""
        token = request.token
        slot = self._slots.get(token)
        if slot is None:
            raise StaleTokenError(f"token: ticket {token} is not admitted here (or was dropped)")
        wait_s = request.kv_wait_timeout_s
        try:
            with tracer.start_as_current_span("decode.await_kv"):
                result = await self.landing.wait(token, wait_s)
        except DeadlineError:
            self._free(slot, "kv wait timed out")
            raise DeadlineError(
                f"KV of ticket {token} did not arrive within {wait_s:.1f}s") from None
        except PdserveError:
            self._free(slot, "transfer failed")
            raise
        except asyncio.CancelledError:
            self._free(slot, "cancelled")
            raise
        if slot.aborted:
            raise StaleTokenError(f"ticket {token} was dropped: {slot.aborted}")
        slot.is_held_by_stream = True
        slot.transfer = result
        prompt = list(request.prompt_token_ids)
        sequence = Sequence(
            request_id=request.request_id or str(token), prompt_token_ids=prompt,
            max_tokens=request.max_tokens, block_ids=slot.block_ids,
            num_computed_tokens=len(prompt), output_token_ids=[result.first_token_id],
        )
        return slot, sequence, _timing_of(result)

    # -- the batch ----------------------------------------------------------------------------

    async def _batch_loop(self) -> None:
        """Continuous batching: one engine step over every running sequence, repeatedly."""
        while True:
            if not self._running:
                self._batch_wakeup.clear()
                await self._batch_wakeup.wait()
                continue
            if self._step_pause_s > 0:
                await asyncio.sleep(self._step_pause_s)
            batch = [s for s in self._running[: self._max_batch_size] if s.sequence]
            sequences = [s.sequence for s in batch if s.sequence is not None]
            started = time.perf_counter()
            try:
                tokens = await self._run_engine(partial(self.engine.decode_step, sequences))
            except Exception:  # noqa: BLE001 - fail the batch, keep the loop
                logger.exception("decode step failed")
                for slot in batch:
                    slot.aborted = "engine failure"
                    self._finish_running(slot)
                continue
            self._profile.append(ProfilePoint(sum(s.num_tokens for s in sequences),
                                              len(sequences), time.perf_counter() - started,
                                              False))
            for slot, new_token in zip(batch, tokens, strict=True):
                assert slot.tokens is not None and slot.sequence is not None
                slot.tokens.put_nowait(new_token)
                if slot.sequence.is_finished:
                    self._finish_running(slot)

    def _finish_running(self, slot: _Slot) -> None:
        if slot in self._running:
            self._running.remove(slot)
        if slot.tokens is not None:
            slot.tokens.put_nowait(None)
