"""A ticket whose lease lapses while its layers are still moving, through the whole stack
(router, coordinator with its reaper, pool managers, a prefill and a decode ``tiny`` worker over
real gRPC; KV over ``tcp`` and ``nixl``).

The prefill worker pauses after two of four layers (its engine stops until the test resumes it),
as a stalled GPU would; nobody renews a ticket that is being prefilled, so the coordinator's
reaper expires it and tells both workers. Then:

- the request fails cleanly and promptly (one attempt allowed: the only other choice would be the
  same two workers), instead of hanging;
- the decode worker has freed every block and forgotten the ticket; the prefill worker, resumed,
  stops at its next layer and frees its blocks too;
- a sender that did not hear of the expiry (a partitioned prefill worker: the same transport,
  KV cache, destination and fencing token) is refused: the receiver's rejection counter rises
  and not a byte of the freed blocks changes;
- a new request is served in those very blocks, with the tokens of a colocated run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.common.types import FencingToken, WorkerRole
from pdserve.worker.engine import Sequence
from pdserve.worker.transports.values import KvDestinationSpec, RejectReason, TransferFailedError

from .test_token_exact import (  # noqa: F401 - one_blas_thread is an autouse fixture
    KvLedger,
    RecordingBackend,
    TinyShape,
    TinyStack,
    one_blas_thread,
    require_transport,
)

pytestmark = pytest.mark.timeout(120)

SHAPE = TinyShape(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, block_size_tokens=16,
                  max_num_blocks=256)
LEASE_S = 5.0
"""Long enough for the prefill to reach its pause on a loaded machine (a running prompt's lease is
not renewed, so with 1.5 s a slow nixl set-up under a full CI run let it lapse before the pause);
the stalled request then fails once this has passed."""
PAUSE_AFTER_LAYERS = 2
PROMPT_TOKENS = 300


class PausingEngine:
    """The prefill worker's engine; when ``pause_next`` is set, the next prefill stops after
    ``PAUSE_AFTER_LAYERS`` layers until ``resume`` is set (in the engine thread, like a stall)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.pause_next = False
        self.is_paused = threading.Event()
        self.resume = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prefill_layers(self, seq: Sequence) -> Iterator[int]:
        is_pausing, self.pause_next = self.pause_next, False
        for layer in self._inner.prefill_layers(seq):
            yield layer
            if is_pausing and layer == PAUSE_AFTER_LAYERS - 1:
                self.is_paused.set()
                self.resume.wait(30.0)


class SenderLog:
    """The destinations and tokens the prefill worker's senders were opened with."""

    def __init__(self) -> None:
        self.opened: list[tuple[KvDestinationSpec, FencingToken]] = []


def _log_opens(backend: Any, log: SenderLog) -> Any:
    create_sender = backend.create_sender

    def create(kv_cache: Any, **kwargs: Any) -> Any:
        sender = create_sender(kv_cache, **kwargs)
        open_ = sender.open

        async def logged_open(dest: KvDestinationSpec, token: FencingToken) -> None:
            log.opened.append((dest, token))
            await open_(dest, token)

        sender.open = logged_open
        return sender

    backend.create_sender = create
    return backend


async def _until(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
async def test_lease_lapsing_mid_transfer(transport: str) -> None:
    require_transport(transport)
    ledger, senders = KvLedger(), SenderLog()
    stack = TinyStack(SHAPE, transport, lease_s=LEASE_S, reap_interval_s=0.05,
                      kv_wait_timeout_s=30.0, max_attempts=1)
    try:
        await stack.start(wrap=lambda backend: _log_opens(RecordingBackend(backend, ledger),
                                                          senders))
        decode, prefill = stack.decode.agent, stack.prefill.agent
        engine = PausingEngine(prefill.engine)
        prefill.engine = engine
        receiver = decode._receiver
        inner_backend = prefill.transport._inner  # the worker's own transport backend
        prompt = np.random.default_rng(7).integers(3, 256, PROMPT_TOKENS).tolist()

        # -- the stalled request: expires after two layers landed, fails cleanly --
        engine.pause_next = True
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stack.generate(prompt, pb.PREFILL_MODE_REMOTE, timeout_s=60.0)
        assert failure.value.code() is not grpc.StatusCode.DEADLINE_EXCEEDED
        assert "expired" in (failure.value.details() or "")
        assert engine.is_paused.is_set(), "the prefill never paused: the lease lapsed elsewhere"
        (dest, token), = senders.opened
        expired = await stack.coordinator.coordinator.get(token.ticket_id)
        assert expired is not None and expired.state.name == "EXPIRED"
        offered_layers = {layer for t, layer, _ in ledger.sent if t == token}
        assert offered_layers == set(range(PAUSE_AFTER_LAYERS))  # it was mid-transfer
        assert decode.allocator.num_free_blocks == decode.allocator.num_blocks
        assert decode.owners.num_owned_blocks == 0 and not decode.tickets()

        engine.resume.set()
        await _until(lambda: prefill.allocator.num_free_blocks == prefill.allocator.num_blocks
                     and not prefill.tickets(), "prefill worker freed its blocks")

        # -- a partitioned prefill worker's late frames are refused; nothing lands --
        dst_ids = list(dest.block_ids)
        before = np.stack(
            [buffer[dst_ids].copy() for buffer in decode.engine.kv_cache.layer_buffers]
        )
        num_rejections = receiver.num_rejections
        src_ids = list(range(len(dst_ids)))
        zombie = inner_backend.create_sender(prefill.engine.kv_cache)
        with pytest.raises(TransferFailedError):
            await zombie.open(dest, token)
            for layer in range(PAUSE_AFTER_LAYERS, SHAPE.num_layers):
                await zombie.offer_layer(layer, src_ids)
            await zombie.finish(0, 0.0)
        await zombie.close()
        assert receiver.num_rejections > num_rejections
        late = [r for r in receiver.rejections if r.token == token]
        assert late and {r.reason for r in late} == {RejectReason.CANCELLED}
        after = np.stack(
            [buffer[dst_ids].copy() for buffer in decode.engine.kv_cache.layer_buffers]
        )
        assert np.array_equal(after, before), "a late frame wrote into freed blocks"

        # -- the freed blocks serve the next request, with the tokens of a colocated run --
        colocated, _ = await stack.generate(prompt, pb.PREFILL_MODE_LOCAL)
        tokens, last = await stack.generate(prompt, pb.PREFILL_MODE_REMOTE)
        assert tokens == colocated and not last.timing.is_local_prefill
        (_, next_token) = senders.opened[-1]
        reused = {block for t, _, block in ledger.landed if t == next_token}
        assert reused & set(dst_ids), "the new request did not get the expired ticket's blocks"
        assert decode.allocator.num_free_blocks == decode.allocator.num_blocks
        assert stack.workers[WorkerRole.PREFILL].agent.allocator.num_free_blocks \
            == prefill.allocator.num_blocks
    finally:
        await stack.close()
