"""Prefill side of ``nixl``: announces each layer on the receiver's control socket (no KV
crosses it); the receiver READs the layers out of this worker's registered buffers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import numpy as np

from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.transports.addresses import parse_address
from pdserve.worker.transports.base import KvSender
from pdserve.worker.transports.nixl.agent import NixlAgent
from pdserve.worker.transports.nixl.control import (
    MAX_TEXT_NBYTES,
    ControlError,
    Hello,
    Kind,
    encode_done,
    encode_layer,
    encode_message,
    read_message,
)
from pdserve.worker.transports.nixl.settings import DEFAULT_NIXL_SETTINGS, NixlTransportSettings
from pdserve.worker.transports.values import KvDestinationSpec, MonotonicClock, TransferResult


class SenderAgent:
    """The prefill side's agent for one KV cache, shared by its senders, and the task that
    drives its progress while any of them is open."""

    def __init__(self, kv_cache: KvCache, settings: NixlTransportSettings) -> None:
        self.local = NixlAgent(kv_cache, "send")
        self._settings = settings
        self._num_open = 0
        self._task: asyncio.Task[None] | None = None

    def acquire(self) -> None:
        self._num_open += 1
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._progress_loop(), name="nixl-progress")

    def release(self) -> None:
        self._num_open -= 1
        if self._num_open == 0 and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _progress_loop(self) -> None:
        while True:
            self.local.progress()
            await asyncio.sleep(self._settings.sender_progress_interval_s)


class NixlKvSender(KvSender):
    """Prefill side of ``nixl``: announces layers; the receiver READs them."""

    def __init__(self, kv_cache: KvCache, shared: SenderAgent,
                 clock: MonotonicClock = time.perf_counter,
                 settings: NixlTransportSettings = DEFAULT_NIXL_SETTINGS) -> None:
        super().__init__(kv_cache, clock)
        self._shared = shared
        self._settings = settings
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reply_task: asyncio.Task[None] | None = None
        self._hello_reply: asyncio.Future[str | None] | None = None
        self._done_reply: asyncio.Future[str | None] | None = None
        self._dst_ids: np.ndarray | None = None
        self._is_acquired = False

    async def open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        self._check_open(dest, token)
        host, port = parse_address(dest.kv_address)
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), self._settings.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            self._fail(f"cannot connect to {dest.kv_address}: {exc or 'timeout'}")
            self._raise_failed()
        self._shared.acquire()
        self._is_acquired = True
        loop = asyncio.get_running_loop()
        self._hello_reply, self._done_reply = loop.create_future(), loop.create_future()
        self._reply_task = asyncio.create_task(self._read_replies(), name=f"nixl-replies-{token}")
        self._dst_ids = np.asarray(dest.block_ids, dtype=np.int64)
        local = self._shared.local
        layout = self.kv_cache.layout
        hello = Hello(layout.num_layers, layout.block_size_tokens, layout.block_nbytes,
                      layout.num_blocks, self._dst_ids, local.base_addresses, local.name,
                      local.metadata, local.memory_kind, local.device_id)
        await self._send(encode_message(Kind.HELLO, token, hello.encode()))
        await self._await_reply(self._hello_reply, self._settings.reply_timeout_s)

    async def offer_layer(
        self, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int] | None = None
    ) -> None:
        offer = self._make_offer(layer, src_block_ids, dst_block_ids)
        dst = (self._dst_ids if dst_block_ids is None
               else np.asarray(offer.dst_block_ids, dtype=np.int64))
        assert dst is not None
        src = np.asarray(offer.src_block_ids, dtype=np.int64)
        await self._send(encode_message(Kind.LAYER, self._token, encode_layer(layer, dst, src)))
        self._offered(offer)

    async def finish(self, first_token_id: int, prefill_compute_s: float) -> TransferResult:
        if self._state.is_terminal or self._done_reply is None:
            self._raise_failed()
        body = encode_done(first_token_id, prefill_compute_s, len(self._offered_layers))
        await self._send(encode_message(Kind.DONE, self._token, body))
        assert self._done_reply is not None
        await self._await_reply(self._done_reply, self._settings.reply_timeout_s)
        return self._succeeded(first_token_id, prefill_compute_s)

    async def abort(self, reason: str) -> None:
        if not self._state.is_terminal and self._writer is not None:
            message = encode_message(Kind.ABORT, self._token,
                                     reason.encode()[:MAX_TEXT_NBYTES])
            with contextlib.suppress(OSError, TimeoutError):
                self._writer.write(message)
                await asyncio.wait_for(self._writer.drain(), self._settings.connect_timeout_s)
        self._fail(f"aborted: {reason}")
        await self.close()

    async def close(self) -> None:
        self._fail("closed before finish")
        if self._reply_task is not None:
            self._reply_task.cancel()
            await asyncio.gather(self._reply_task, return_exceptions=True)
            self._reply_task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._is_acquired:
            self._is_acquired = False
            self._shared.release()

    async def _send(self, message: bytes) -> None:
        if self._writer is None:
            self._raise_failed()
        assert self._writer is not None
        try:
            self._writer.write(message)
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self._fail(f"connection lost: {exc}")
            self._raise_failed()

    @staticmethod
    def _resolve(reply: asyncio.Future[str | None] | None, error: str | None) -> None:
        if reply is not None and not reply.done():
            reply.set_result(error)

    async def _read_replies(self) -> None:
        assert self._reader is not None
        error = "connection closed by the receiver"
        try:
            while True:
                message = await read_message(self._reader, 2 * MAX_TEXT_NBYTES)
                if message is None:
                    break
                kind, token, body = message
                if kind not in (Kind.ACK, Kind.ERROR):
                    error = f"receiver sent a {Kind(kind).name} message"
                    break
                if token is not None and token != self._token:
                    continue
                if kind == Kind.ACK:
                    answered = body[0] if body else 0
                    if answered == Kind.HELLO:
                        self._resolve(self._hello_reply, None)
                    elif answered == Kind.DONE:
                        self._resolve(self._done_reply, None)
                    continue
                reason, _, detail = body[1:].decode("utf-8", errors="replace").partition("\0")
                error = f"refused: {detail or reason}"
                self._fail(error)
                break
        except (ControlError, ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            error = f"connection lost: {exc}"
        done_reply = self._done_reply
        if done_reply is None or not done_reply.done() or done_reply.result() is not None:
            self._fail(error)  # unless the receiver had acknowledged DONE
        self._resolve(self._hello_reply, error)
        self._resolve(self._done_reply, error)

