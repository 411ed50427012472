"""vLLM's own prefix cache, as pdserve's prefix index sees it: KV cache events -> pdserve hashes.

With ``kv_events_config`` enabled, vLLM's scheduler publishes one batch of events per step on a
ZMQ PUB socket: ``BlockStored`` (vLLM's hashes of a run of newly cached full blocks, the hash of
the block before them, and their token ids), ``BlockRemoved`` (hashes evicted) and
``AllBlocksCleared`` (the prefix cache was reset). The agent subscribes (``KvEventSubscriber``)
and keeps a ``PrefixEventIndex``: vLLM's hash of each cached block -> pdserve's chained hash of
the same block (``common.tokenizer.chained_block_hash`` over the event's token ids, chained from
the parent block's pdserve hash). The router hashes prompts with ``prefix_block_hashes``, so it
finds exactly the blocks the engine holds, and the worker reports them on its heartbeats like
any other engine's (``take_delta`` / ``all_hashes``); the pool drops a worker's entries when it
leaves.

A block whose parent vLLM never announced (stored before the subscriber joined: a PUB socket
drops what it sends before a SUB connects) cannot be named and is skipped, as are its
descendants; the subscriber connects before the engine starts, so that happens only for a
subscriber restarted mid-run. A gap in vLLM's batch sequence numbers (a dropped batch) is
counted and logged: the index may then name blocks the engine evicted (a routing preference
that costs a recomputation, never a wrong answer) until they are stored or cleared again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable, Sequence
from typing import Any

from pdserve.common.tokenizer import chained_block_hash

logger = logging.getLogger(__name__)

TOPIC = "pdserve.kv-events"


class PrefixEventIndex:
    """The blocks one engine holds in its prefix cache, under pdserve's hashes.

    ``take_delta`` returns what changed since its previous call (the heartbeat's report);
    ``all_hashes`` everything held now (a full report). Pure bookkeeping: no I/O, no clock.
    """

    def __init__(self, block_size_tokens: int) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be positive, got {block_size_tokens}")
        self.block_size_tokens = block_size_tokens
        self._vllm_to_pdserve: dict[Hashable, int] = {}
        self._counts: dict[int, int] = {}
        """pdserve hash -> how many of vLLM's blocks carry it (one, unless groups repeat it)."""
        self._reported: set[int] = set()
        self.num_skipped_blocks = 0
        """Blocks stored under a parent this index never saw (not indexed)."""

    def on_stored(self, block_hashes: Sequence[Hashable], parent_block_hash: Hashable | None,
                  token_ids: Sequence[int], block_size: int) -> None:
        """A run of full blocks was cached: ``token_ids`` holds ``block_size`` tokens per hash."""
        if block_size != self.block_size_tokens or len(token_ids) != block_size * len(
                block_hashes):
            self.num_skipped_blocks += len(block_hashes)
            logger.warning("KV event with %d blocks of %d tokens (%d token ids) does not fit "
                           "blocks of %d tokens: skipped", len(block_hashes), block_size,
                           len(token_ids), self.block_size_tokens)
            return
        parent: int | None = None
        if parent_block_hash is not None:
            known = self._vllm_to_pdserve.get(parent_block_hash)
            if known is None:
                self.num_skipped_blocks += len(block_hashes)
                return
            parent = known
        for index, vllm_hash in enumerate(block_hashes):
            start = index * block_size
            parent = chained_block_hash(parent, token_ids[start:start + block_size])
            if vllm_hash in self._vllm_to_pdserve:
                continue  # already held (a repeated event)
            self._vllm_to_pdserve[vllm_hash] = parent
            self._counts[parent] = self._counts.get(parent, 0) + 1

    def on_removed(self, block_hashes: Sequence[Hashable]) -> None:
        for vllm_hash in block_hashes:
            ours = self._vllm_to_pdserve.pop(vllm_hash, None)
            if ours is None:
                continue
            remaining = self._counts[ours] - 1
            if remaining:
                self._counts[ours] = remaining
            else:
                del self._counts[ours]

    def on_cleared(self) -> None:
        self._vllm_to_pdserve.clear()
        self._counts.clear()

    def take_delta(self) -> tuple[list[int], list[int]]:
        """(added, removed) pdserve hashes since the previous call."""
        held = set(self._counts)
        added, removed = held - self._reported, self._reported - held
        self._reported = held
        return sorted(added), sorted(removed)

    def all_hashes(self) -> list[int]:
        """Every pdserve hash held now (and the baseline of the next ``take_delta``)."""
        self._reported = set(self._counts)
        return sorted(self._reported)

    def __len__(self) -> int:
        return len(self._counts)


class KvEventSubscriber:
    """Feeds a ``PrefixEventIndex`` from vLLM's ZMQ event publisher at ``endpoint``, on the
    agent's event loop (``zmq.asyncio``); decoded with vLLM's own event types."""

    def __init__(self, endpoint: str, index: PrefixEventIndex) -> None:
        self.endpoint = endpoint
        self.index = index
        self.num_batches = 0
        self.num_gaps = 0
        self._task: asyncio.Task[None] | None = None
        self._socket: Any = None
        self._last_seq: int | None = None

    def start(self) -> None:
        """Connect (before the engine binds is fine: ZMQ reconnects) and start consuming."""
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        self._socket = context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.endpoint)
        self._socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-kv-events")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            _, seq_bytes, payload = await self._socket.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:  # the publisher's end-of-stream marker
                continue
            if self._last_seq is not None and seq != self._last_seq + 1:
                self.num_gaps += 1
                logger.warning("KV events %d..%d missed: the prefix index may be stale",
                               self._last_seq + 1, seq - 1)
            self._last_seq = seq
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as exc:
                logger.warning("undecodable KV event batch skipped: %s", exc)
                continue
            self.num_batches += 1
            self.apply(batch.events)

    def apply(self, events: Sequence[Any]) -> None:
        """Apply vLLM event objects in order (by type name: vLLM's classes or look-alikes)."""
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                if getattr(event, "lora_id", None) is not None:
                    # An adapter's blocks: the router's hashes name base-model prefixes only.
                    self.index.num_skipped_blocks += len(event.block_hashes)
                    continue
                self.index.on_stored(event.block_hashes, event.parent_block_hash,
                                     event.token_ids, event.block_size)
            elif kind == "BlockRemoved":
                self.index.on_removed(event.block_hashes)
            elif kind == "AllBlocksCleared":
                self.index.on_cleared()
