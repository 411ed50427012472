"""``inproc``: KV transfer between two ``KvCache``s of one process (tests, one-process stacks).

Same semantics as ``tcp`` — the receiver's ``ReceiverTickets`` admits every layer before a byte
is copied — with a module-level table from ``inproc://host:port`` to live receivers instead of
sockets, and a numpy copy between the caches instead of a wire. Sender and receiver must run on
the same event loop. Refusals are known at once, so ``offer_layer`` raises as soon as the
receiver refuses (``tcp`` can only report them later, in ``finish``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import numpy as np

from pdserve.common.errors import AlreadyExistsError, IllegalTransitionError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.base import KvReceiver, KvSender
from pdserve.worker.transports.values import (
    FrameRefusedError,
    KvDestinationSpec,
    LayerOffer,
    MonotonicClock,
    RejectReason,
    TransferPoll,
    TransferResult,
)

SCHEME = "inproc://"
_ADDRESS_TO_RECEIVER: dict[str, InprocKvReceiver] = {}
_next_port = itertools.count(1)


class InprocKvReceiver(KvReceiver):
    """Decode side of ``inproc``; reachable while started, at the address ``start`` returns."""

    def __init__(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                 clock: MonotonicClock = time.perf_counter) -> None:
        super().__init__(kv_cache, owner_table, clock)
        self._address = ""

    async def start(self, host: str, port: int) -> str:
        if self._address:
            raise IllegalTransitionError(f"receiver already started at {self._address}")
        while port == 0:
            port = next(_next_port)
            if f"{SCHEME}{host}:{port}" in _ADDRESS_TO_RECEIVER:
                port = 0
        address = f"{SCHEME}{host}:{port}"
        if address in _ADDRESS_TO_RECEIVER:
            raise AlreadyExistsError(f"{address} is taken")
        _ADDRESS_TO_RECEIVER[address] = self
        self._address = address
        return address

    async def close(self) -> None:
        if _ADDRESS_TO_RECEIVER.get(self._address) is self:
            del _ADDRESS_TO_RECEIVER[self._address]
        for token in self.tickets.active_tokens():
            self.tickets.fail(token, "receiver closed")

    # ---- what a sender calls (the "wire") ----

    def _on_hello(self, token: FencingToken, dst_block_ids: np.ndarray, layout_key: tuple) -> None:
        num_layers, block_size_tokens, block_nbytes = layout_key
        self.tickets.admit_hello(token, dst_block_ids, num_layers, block_size_tokens, block_nbytes)

    def _on_layer(self, token: FencingToken, offer: LayerOffer, src_cache: KvCache) -> int:
        dst_ids = np.asarray(offer.dst_block_ids, dtype=np.int64)
        if np.unique(dst_ids).size != dst_ids.size:
            raise FrameRefusedError(self.tickets.refuse(
                token, "LAYER", offer.layer, RejectReason.MALFORMED_FRAME, "block ids repeat"))
        admission = self.tickets.admit_layer(token, offer.layer, dst_ids)
        if not admission.still_writable():  # cannot change without an await; checked anyway
            raise FrameRefusedError(self.tickets.rejections[-1])
        src_ids = np.asarray(offer.src_block_ids, dtype=np.int64)
        dst = self.kv_cache.layer_buffers[offer.layer]
        dst[dst_ids] = src_cache.layer_buffers[offer.layer][src_ids]
        num_bytes = dst_ids.size * self.kv_cache.layout.block_nbytes
        self.tickets.layer_landed(admission, num_bytes)
        return num_bytes

    def _on_done(self, token: FencingToken, first_token_id: int, prefill_compute_s: float,
                 num_layers: int) -> None:
        self.tickets.admit_done(token, first_token_id, prefill_compute_s, num_layers)

    def _on_abort(self, token: FencingToken, reason: str) -> None:
        self.tickets.fail(token, f"aborted by sender: {reason}")


class InprocKvSender(KvSender):
    """Prefill side of ``inproc``: copies straight into the receiver's cache (after admission)."""

    def __init__(self, kv_cache: KvCache, clock: MonotonicClock = time.perf_counter) -> None:
        super().__init__(kv_cache, clock)
        self._receiver: InprocKvReceiver | None = None

    def _peer(self) -> InprocKvReceiver:
        assert self._dest is not None
        receiver = _ADDRESS_TO_RECEIVER.get(self._dest.kv_address)
        if receiver is None or (self._receiver is not None and receiver is not self._receiver):
            self._fail(f"no receiver at {self._dest.kv_address}")
            self._raise_failed()
        return receiver

    def _refused(self, exc: FrameRefusedError) -> None:
        rejection = exc.rejection
        self._fail(f"{rejection.reason}: {rejection.detail}")
        self._raise_failed()

    async def open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        self._check_open(dest, token)
        await asyncio.sleep(0)
        self._receiver = self._peer()
        layout = self.kv_cache.layout
        try:
            self._receiver._on_hello(
                token, np.asarray(dest.block_ids, dtype=np.int64),
                (layout.num_layers, layout.block_size_tokens, layout.block_nbytes),
            )
        except FrameRefusedError as exc:
            self._refused(exc)

    async def offer_layer(
        self, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int] | None = None
    ) -> None:
        offer = self._make_offer(layer, src_block_ids, dst_block_ids)
        await asyncio.sleep(0)
        receiver = self._peer()
        assert self._token is not None
        try:
            receiver._on_layer(self._token, offer, self.kv_cache)
        except FrameRefusedError as exc:
            self._refused(exc)
        self._offered(offer)

    async def finish(self, first_token_id: int, prefill_compute_s: float) -> TransferResult:
        if self._state.is_terminal or self._token is None:
            self._raise_failed()
        await asyncio.sleep(0)
        receiver = self._peer()
        assert self._token is not None
        try:
            receiver._on_done(self._token, first_token_id, prefill_compute_s,
                              len(self._offered_layers))
        except FrameRefusedError as exc:
            self._refused(exc)
        return self._succeeded(first_token_id, prefill_compute_s)

    async def abort(self, reason: str) -> None:
        if not self._state.is_terminal and self._token is not None:
            receiver = _ADDRESS_TO_RECEIVER.get(self._dest.kv_address if self._dest else "")
            if receiver is not None:
                receiver._on_abort(self._token, reason)
        self._fail(f"aborted: {reason}")
        await self.close()

    async def close(self) -> None:
        if self._state is not TransferPoll.SUCCESS and self._token is not None:
            receiver = _ADDRESS_TO_RECEIVER.get(self._dest.kv_address if self._dest else "")
            if receiver is not None and receiver is self._receiver:
                receiver.tickets.fail(self._token, "connection lost: sender closed")
        self._fail("closed before finish")


class InprocBackend:
    """The ``inproc`` backend (always available)."""

    name = "inproc"
    is_pull = False
    frame_versions: tuple[int, ...] = InprocKvReceiver.frame_versions

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def create_receiver(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                        *, clock: MonotonicClock = time.perf_counter) -> InprocKvReceiver:
        return InprocKvReceiver(kv_cache, owner_table, clock)

    def create_sender(self, kv_cache: KvCache,
                      *, clock: MonotonicClock = time.perf_counter) -> InprocKvSender:
        return InprocKvSender(kv_cache, clock)


BACKEND = InprocBackend()
