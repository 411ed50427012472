"""Worker side of pdserve's connector: runs in vLLM's worker process, owns the KV data path.

vLLM's KV tensors are viewed (no copy) as pdserve's ``KvCache``: one ``uint8[num_blocks,
block_nbytes]`` buffer per layer, so pdserve's transports move whole blocks as opaque bytes in
vLLM's own layout (on CPU ``[num_blocks, kv_heads, block_size, 2 * head_size]`` with K stored
transposed inside a block: never indexed by token here). The transport is the worker's
(``ConnectorSettings.transport``): ``tcp`` pushes each layer into the decode side's blocks;
``nixl`` announces each layer and the decode side READs it out of this engine's registered
cache into blocks it owns. Both run the same receiver-side admission (ticket live, fencing
token owns every destination block, layer in range and not yet received, sizes match) before a
byte lands, and the same checksums.

Threads: vLLM calls the connector on its model-runner thread; the data path lives on an asyncio
loop in one daemon thread (``_LoopThread``), which alone touches the receiver, the senders and the
block owner table (none of them is thread-safe). The model thread only posts work to the loop
(``call_soon_threadsafe``) and collects results from lock-protected sets, so a step never waits
for the network.

Decode (``LoadSpec``): the fencing token is made owner of exactly the blocks vLLM allocated
(``BlockOwnerTable``), the receiver expects it, the destination is published through the
rendezvous, and the receiver — which validates every frame against the owner table before a
byte lands — collects the KV. The request is then reported finished receiving exactly once: as a
success only if every layer of every block landed; otherwise (timeout, refusal, abort, a
destination nobody took) also as ``failed_recving``, so vLLM never caches those blocks and, under
its default ``kv_load_failure_policy="fail"``, ends the request with an error the agent retries.
The ticket is cancelled and its blocks released in the owner table *before* that report, so no
late frame can land in blocks vLLM hands to someone else; late frames are refused and counted.

Prefill (``SendSpec``): ``save_kv_layer`` runs right after each layer's attention; it posts
(layer, blocks now final) to the request's send job, which pushes them while later layers compute.
The job waits for the destination (given, or from the rendezvous), checks it against the prompt,
and after the last layer sends DONE. The request's blocks stay allocated (``request_finished``
returned True) until the job has ended and vLLM has reported the request finished.

Layer-wise evidence (``LayerTimeline``, in the ``SENT`` event): per layer, when its KV was
final (the model thread's ``save_kv_layer`` for the prompt's last step) and when the transport
had taken it (tcp: written to the socket; nixl: announced, the READ is the receiver's), and when
the receiver acknowledged DONE. **Exposed transfer time** is DONE's acknowledgement minus the
end of prefill compute (the last layer's KV final): the time the decode side waits beyond the
prefill itself, all that layer-wise overlap cannot hide.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import zlib
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.common.errors import InvalidArgumentError, PdserveError
from pdserve.worker.engine import KvCache, KvLayout, KvMemory
from pdserve.worker.engines.vllm.events import ConnectorEvent, EventKind, EventSink
from pdserve.worker.engines.vllm.exchange import DestinationExchange, make_exchange
from pdserve.worker.engines.vllm.protocol import (
    ConnectorSettings,
    DestinationPlacement,
    LoadSpec,
    SendSpec,
)
from pdserve.worker.kv_checksums import crc_kind_for, kv_checksum
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.base import KvReceiver, KvSender
from pdserve.worker.transports.registry import TransportBackend, get_backend
from pdserve.worker.transports.values import KvDestinationSpec

logger = logging.getLogger(__name__)

_SETUP_TIMEOUT_S = 30.0
_REJECTION_POLL_S = 0.25
IDLE_STEP_WAIT_S = 0.005
"""Longest an empty step (no forward; requests waiting for KV) waits for a transfer to end."""


# ---- vLLM's tensors as pdserve's KvCache -------------------------------------------------------


class VllmKvCache(KvCache):
    """``KvCache`` over vLLM's per-layer tensors (shared memory: writes land in vLLM's cache).

    Each tensor must be contiguous with the block index first (the CPU backend's layout, and
    FlashInfer's on GPUs); the bytes of one block of one layer are then one contiguous run of
    ``block_nbytes``. A layout with K and V first (FlashAttention's ``[2, num_blocks, ...]``)
    splits each block in two runs: refused when vLLM's ``num_blocks`` is known and the first
    dimension is not it. Host tensors are viewed as the byte
    buffers every transport uses; tensors on one CUDA device are registered with NIXL as that
    GPU's memory (``memory``) and have no host buffers: only the ``nixl`` transport moves them,
    and checksums copy the blocks they cover to the host.
    """

    def __init__(self, tensors: Sequence[Any], block_size_tokens: int,
                 expected_num_blocks: int = 0) -> None:  # torch.Tensor
        # No super().__init__(): it would allocate buffers; these are views of vLLM's memory.
        if not tensors:
            raise ValueError("no KV cache tensors registered")
        first = tensors[0]
        num_blocks = int(first.shape[0])
        if expected_num_blocks and num_blocks != expected_num_blocks:
            raise NotImplementedError(
                f"KV layer tensors are {tuple(first.shape)} for {expected_num_blocks} blocks: "
                "pdserve's connector needs the block index first (K and V first is "
                "FlashAttention's layout; FlashInfer's and the CPU backend's put blocks first)")
        devices = {str(tensor.device) for tensor in tensors}
        if len(devices) != 1 or first.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(
                f"KV layers on {sorted(devices)}: pdserve's connector moves one host or one "
                "CUDA device's KV cache")
        for index, tensor in enumerate(tensors):
            if not tensor.is_contiguous() or int(tensor.shape[0]) != num_blocks:
                raise ValueError(f"KV layer {index}: shape {tuple(tensor.shape)} is not "
                                 f"[num_blocks={num_blocks}, ...] contiguous")
        self.tensors = list(tensors)
        layer_nbytes = [int(t.numel()) * int(t.element_size()) for t in tensors]
        if len(set(layer_nbytes)) != 1 or layer_nbytes[0] % num_blocks:
            raise ValueError(f"KV layers of {sorted(set(layer_nbytes))} bytes do not split into "
                             f"{num_blocks} equal blocks")
        self.layout = KvLayout(num_layers=len(tensors), num_blocks=num_blocks,
                               block_size_tokens=block_size_tokens,
                               block_nbytes=layer_nbytes[0] // num_blocks)
        self._is_host = first.device.type == "cpu"
        self._memory = KvMemory(
            "DRAM" if self._is_host else "VRAM",
            0 if self._is_host else int(first.device.index or 0),
            tuple(int(t.data_ptr()) for t in tensors), tuple(layer_nbytes))
        self.layer_buffers = ([t.view(-1).view(dtype=_torch_uint8()).numpy()
                               .reshape(num_blocks, -1) for t in tensors]
                              if self._is_host else [])

    @property
    def memory(self) -> KvMemory:
        return self._memory

    def layer_blocks(self, layer: int, block_ids: np.ndarray) -> np.ndarray:
        if self._is_host:
            return super().layer_blocks(layer, block_ids)
        import torch

        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.tensors[layer].device)
        picked = self.tensors[layer].index_select(0, index)
        return picked.reshape(len(block_ids), -1).view(torch.uint8).cpu().numpy()

    def zero_blocks(self, block_ids: np.ndarray) -> None:
        if self._is_host:
            super().zero_blocks(block_ids)
            return
        import torch

        for tensor in self.tensors:
            index = torch.as_tensor(block_ids, dtype=torch.long, device=tensor.device)
            tensor.index_fill_(0, index, 0)


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


def block_crc32s(kv_cache: KvCache, block_ids: Sequence[int]) -> tuple[int, ...]:
    """One CRC-32 per block, over its layers in order."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if kv_cache.memory.is_host:  # views, no copy
        layers: list[np.ndarray] = kv_cache.layer_buffers
    else:  # one copy to the host of the blocks named, per layer
        layers = [kv_cache.layer_blocks(layer, ids) for layer in range(kv_cache.layout.num_layers)]
        ids = np.arange(ids.size)
    crcs = []
    for block_id in ids:
        crc = 0
        for blocks in layers:
            crc = zlib.crc32(blocks[block_id], crc)
        crcs.append(crc)
    return tuple(crcs)


@dataclass(frozen=True, slots=True)
class LayerTimeline:
    """One prefill's layer-wise handoff, in seconds since the first forward step that computed
    part of its prompt began.

    ``layer_computed_s[l]``: layer l's prompt KV was final; ``layer_sent_s[l]``: the transport had
    taken its last blocks; ``done_s``: the receiver acknowledged DONE (the decode side may start);
    ``exposed_s = done_s - max(layer_computed_s)``: the transfer time layer-wise overlap did not
    hide. A layer the decode side already held (its prefix cache) counts as sent when computed.
    """

    layer_computed_s: tuple[float, ...]
    layer_sent_s: tuple[float, ...]
    done_s: float
    exposed_s: float

    @staticmethod
    def of(job: _SendJob, done_s: float) -> LayerTimeline:
        base = job.started_s
        computed = tuple(max(0.0, t - base) for t in job.computed_s)
        sent = tuple(max(c, t - base) if t else c for c, t in zip(computed, job.sent_s,
                                                                   strict=True))
        done = done_s - base
        return LayerTimeline(computed, sent, done, max(0.0, done - max(computed, default=0.0)))


# ---- the loop thread ------------------------------------------------------------------------


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def post(self, callback: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


@dataclass(slots=True)
class _SendJob:
    req_id: str
    token: Any
    num_prompt_blocks: int
    queue: asyncio.Queue[tuple[int, SendSpec, float]]
    """(layer, spec, when the model thread posted it: ``time.perf_counter()``)."""
    sent_upto: list[int]
    """Per layer: logical blocks below this index were offered."""
    task: asyncio.Task[None] | None = None
    started_s: float = field(default_factory=time.perf_counter)
    """When the first forward step that computed part of this prompt began."""
    computed_s: list[float] = field(default_factory=list)
    """Per layer: when its whole prompt KV was final (0 until then)."""
    sent_s: list[float] = field(default_factory=list)
    """Per layer: when the transport had taken its last blocks (0 until then)."""


class WorkerSide:
    """One per vLLM worker process. All public methods are called on vLLM's model thread."""

    def __init__(self, settings: ConnectorSettings, *, is_consumer: bool, is_producer: bool,
                 exchange: DestinationExchange | None = None) -> None:
        self._settings = settings
        self._is_consumer = is_consumer
        self._is_producer = is_producer
        self._exchange = exchange
        self._thread: _LoopThread | None = None
        self.kv_cache: VllmKvCache | None = None
        self._layer_index: dict[str, int] = {}
        self._owner_table: BlockOwnerTable | None = None
        self._backend: TransportBackend | None = None
        self._receiver: KvReceiver | None = None
        self._kv_address = ""
        self._events = EventSink(settings.events_path)
        # loop-thread state
        self._load_tasks: dict[str, asyncio.Task[None]] = {}
        self._send_jobs: dict[str, _SendJob] = {}
        self._num_rejections_reported = 0
        self._poller: asyncio.Task[None] | None = None
        # shared with the model thread, under _lock
        self._lock = threading.Lock()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._ended_sending: set[str] = set()
        self._finished_by_vllm: set[str] = set()
        self._send_req_ids: set[str] = set()
        """Model thread only: requests this worker sent for and has not reported yet."""
        self._step_started_s = 0.0
        """Model thread only: when the current forward step began (``time.perf_counter()``)."""
        self._transfer_ended = threading.Event()
        """Set by the loop thread when a load or a send ends (wakes an idle step)."""

    # -- registration --

    def register_kv_caches(self, kv_caches: dict[str, Any], block_size_tokens: int,
                           num_blocks: int = 0) -> None:
        names = list(kv_caches)
        self._layer_index = {name: index for index, name in enumerate(names)}
        self.kv_cache = VllmKvCache([kv_caches[name] for name in names], block_size_tokens,
                                    num_blocks)
        self._thread = _LoopThread()
        self._thread.run(self._setup(), _SETUP_TIMEOUT_S)
        layout = self.kv_cache.layout
        logger.info("pdserve connector: %d layers x %d blocks of %d tokens (%d bytes); "
                    "receiver %s", layout.num_layers, layout.num_blocks,
                    layout.block_size_tokens, layout.block_nbytes, self._kv_address or "off")
        self._events.emit(ConnectorEvent(
            EventKind.READY, kv_address=self._kv_address, num_layers=layout.num_layers,
            num_total_blocks=layout.num_blocks, block_size_tokens=layout.block_size_tokens,
            block_nbytes=layout.block_nbytes))

    async def _setup(self) -> None:
        assert self.kv_cache is not None
        if self._exchange is None:
            self._exchange = make_exchange(self._settings, self._events)
        if not self.kv_cache.memory.is_host and self._settings.transport != "nixl":
            raise NotImplementedError(
                f"the KV cache is on a GPU ({self.kv_cache.memory.kind} device "
                f"{self.kv_cache.memory.device_id}): transport {self._settings.transport!r} "
                "moves host memory only; use nixl")
        self._backend = get_backend(self._settings.transport)
        if self._is_consumer:
            self._owner_table = BlockOwnerTable(self.kv_cache.layout.num_blocks)
            self._receiver = self._backend.create_receiver(self.kv_cache, self._owner_table)
            self._kv_address = await self._receiver.start(self._settings.kv_host,
                                                          self._settings.kv_port)
            self._poller = asyncio.create_task(self._poll_rejections())

    # -- per step, model thread --

    def begin_step(self) -> None:
        """vLLM bound this step's metadata: its forward (if any) starts now."""
        self._step_started_s = time.perf_counter()

    def wait_for_transfer_progress(self) -> None:
        """After a step without a forward: return when a load or a send ends, or after
        ``IDLE_STEP_WAIT_S``, so that vLLM's empty steps do not spin while KV moves (a transfer
        that ends wakes it at once: no latency is added to the handoff)."""
        self._transfer_ended.wait(IDLE_STEP_WAIT_S)
        self._transfer_ended.clear()

    def start_loads(self, loads: Sequence[LoadSpec]) -> None:
        """Called every step, after the step's forward where its loads are asynchronous."""
        if not loads:
            return
        if self._receiver is None:
            raise RuntimeError("a KV load on an engine whose connector is not a consumer")
        for spec in loads:
            self._post(self._begin_load, spec)

    def save_layer(self, sends: Sequence[SendSpec], layer_name: str) -> None:
        if not sends:
            return
        layer = self._layer_index[layer_name]
        now_s = time.perf_counter()
        step_started_s = min(self._step_started_s or now_s, now_s)
        for spec in sends:
            self._send_req_ids.add(spec.req_id)
            self._post(self._offer, spec, layer, now_s, step_started_s)

    def abort_sends(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self._post(self._abort_send, req_id)

    def get_transfer_results(self, finished_req_ids: set[str]
                             ) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving); each id once, ever."""
        if finished_req_ids:
            self._post(self._on_requests_finished, set(finished_req_ids))
        with self._lock:
            self._finished_by_vllm |= finished_req_ids & self._send_req_ids
            recving, self._done_recving = self._done_recving, set()
            failed = self._failed_recving & recving
            self._failed_recving -= failed
            sending = self._ended_sending & self._finished_by_vllm
            self._ended_sending -= sending
            self._finished_by_vllm -= sending
        self._send_req_ids -= sending
        return sending, recving, failed

    def shutdown(self) -> None:
        if self._thread is None:
            return
        try:
            self._thread.run(self._teardown(), 10.0)
        except Exception:  # shutting down: report, never raise into vLLM's teardown
            logger.exception("pdserve connector teardown failed")
        self._thread.stop()
        self._thread = None
        self._events.close()

    async def _teardown(self) -> None:
        for task in [*self._load_tasks.values(),
                     *(job.task for job in self._send_jobs.values() if job.task)]:
            task.cancel()
        if self._poller is not None:
            self._poller.cancel()
        if self._receiver is not None:
            await self._receiver.close()
        if self._settings.transport == "tcp":
            from pdserve.worker.transports.tcp.sender import close_sender_connections

            close_sender_connections()
        if self._exchange is not None:
            await self._exchange.close()

    def _post(self, callback: Any, *args: Any) -> None:
        if self._thread is None:
            raise RuntimeError("pdserve connector used before register_kv_caches")
        self._thread.post(callback, *args)

    # -- decode side, loop thread --

    def _begin_load(self, spec: LoadSpec) -> None:
        task = asyncio.get_running_loop().create_task(self._run_load(spec),
                                                      name=f"kv-load-{spec.req_id}")
        self._load_tasks[spec.req_id] = task

    async def _run_load(self, spec: LoadSpec) -> None:
        assert self._receiver is not None and self._owner_table is not None
        assert self.kv_cache is not None and self._exchange is not None
        token = spec.token
        is_ok = False
        reason = ""
        started_s = time.perf_counter()
        try:
            self._owner_table.assign(token, spec.dst_block_ids)
            self._receiver.expect(token, spec.dst_block_ids, self.kv_cache.layout.num_layers)
            destination = KvDestinationSpec(
                kv_address=self._kv_address, block_ids=spec.dst_block_ids,
                transport=self._settings.transport,
                layout=self.kv_cache.layout, decode_worker_id=self._settings.worker_id,
                frame_versions=self._receiver.frame_versions,
                metadata=DestinationPlacement(spec.first_block, spec.num_prompt_tokens).encode())
            await asyncio.wait_for(self._exchange.publish(token, destination),
                                   self._settings.rpc_timeout_s)
            result = await self._receiver.wait(token, spec.timeout_s)
            # The checksum DONE carried, which the landed KV was checked against (tcp frame
            # versions 2 and 3); else computed now, before vLLM may write into the blocks again.
            crc = (result.kv_crc32 if result.kv_crc32 is not None else kv_checksum(
                self.kv_cache, spec.dst_block_ids, crc_kind_for(result.frame_version)))
            self._events.emit(ConnectorEvent(
                EventKind.RECEIVED, req_id=spec.req_id, token=str(token), crc32=crc,
                block_crc32s=block_crc32s(self.kv_cache, spec.dst_block_ids),
                num_blocks=len(spec.dst_block_ids), num_layers=result.num_layers,
                num_bytes=result.num_bytes, transfer_s=time.perf_counter() - started_s))
            is_ok = True
        except asyncio.CancelledError:
            reason = "request finished before its KV landed (aborted)"
        except (PdserveError, TimeoutError, OSError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            if not is_ok:
                self._receiver.cancel(token, reason or "load failed")
                # vLLM skipped zeroing these blocks for the load and reuses them unzeroed once
                # freed; half-written bytes (NaN, say) in slots a later request masks would
                # still poison its attention. They are still ours: clear them.
                self.kv_cache.zero_blocks(np.asarray(spec.dst_block_ids, dtype=np.int64))
            self._owner_table.release(token)  # before vLLM learns: no late write lands
            self._load_tasks.pop(spec.req_id, None)
            with self._lock:
                self._done_recving.add(spec.req_id)
                if not is_ok:
                    self._failed_recving.add(spec.req_id)
            self._transfer_ended.set()
            if not is_ok:
                logger.warning("KV load of %s (%s) failed: %s", spec.req_id, token, reason)
                self._events.emit(ConnectorEvent(EventKind.FAILED, req_id=spec.req_id,
                                                 token=str(token), reason=reason))
            self._check_rejections()

    def _on_requests_finished(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            task = self._load_tasks.get(req_id)
            if task is not None:
                task.cancel()

    async def _poll_rejections(self) -> None:
        while True:
            await asyncio.sleep(_REJECTION_POLL_S)
            self._check_rejections()

    def _check_rejections(self) -> None:
        if self._receiver is None:
            return
        num = self._receiver.num_rejections
        if num != self._num_rejections_reported:
            self._num_rejections_reported = num
            last = self._receiver.rejections[-1] if self._receiver.rejections else None
            self._events.emit(ConnectorEvent(
                EventKind.REJECTED, num_rejections=num,
                token=str(last.token) if last and last.token else "",
                reason=f"{last.reason}: {last.detail}" if last else ""))

    # -- prefill side, loop thread --

    def _offer(self, spec: SendSpec, layer: int, posted_s: float, step_started_s: float) -> None:
        assert self.kv_cache is not None
        job = self._send_jobs.get(spec.req_id)
        if job is None:
            num_blocks = math.ceil(spec.num_prompt_tokens / self.kv_cache.layout.block_size_tokens)
            num_layers = self.kv_cache.layout.num_layers
            job = _SendJob(spec.req_id, spec.token, num_blocks, asyncio.Queue(),
                           [0] * num_layers, started_s=step_started_s,
                           computed_s=[0.0] * num_layers, sent_s=[0.0] * num_layers)
            job.task = asyncio.get_running_loop().create_task(
                self._run_send(job, spec), name=f"kv-send-{spec.req_id}")
            self._send_jobs[spec.req_id] = job
        if spec.num_ready_blocks >= job.num_prompt_blocks and not job.computed_s[layer]:
            job.computed_s[layer] = posted_s
        job.queue.put_nowait((layer, spec, posted_s))

    def _abort_send(self, req_id: str) -> None:
        job = self._send_jobs.get(req_id)
        if job is not None and job.task is not None:
            job.task.cancel()

    async def _run_send(self, job: _SendJob, first: SendSpec) -> None:
        assert self.kv_cache is not None and self._exchange is not None
        assert self._backend is not None
        sender: KvSender | None = None
        reason = ""
        try:
            destination = first.destination
            if destination is None:
                destination = await self._exchange.wait(job.token, first.timeout_s)
            if destination is None:
                raise TimeoutError(f"no destination for {job.token} within {first.timeout_s} s")
            placement = self._check_destination(destination, first, job)
            sender = self._backend.create_sender(self.kv_cache)
            await sender.open(destination, job.token)
            src_ids = await self._push_layers(job, sender, destination, placement,
                                              first.timeout_s)
            crcs = block_crc32s(self.kv_cache, src_ids)
            result = await sender.finish(0, time.perf_counter() - job.started_s)
            timeline = LayerTimeline.of(job, done_s=time.perf_counter())
            # The handoff's own checksum where it has one (tcp frame versions 2 and 3: the one
            # DONE carried); else computed here, after DONE (the blocks stay ours until the job
            # ends), in the algorithm of the handoff's version, as the receiver does.
            crc = (result.kv_crc32 if result.kv_crc32 is not None else kv_checksum(
                self.kv_cache, src_ids, crc_kind_for(result.frame_version)))
            self._events.emit(ConnectorEvent(
                EventKind.SENT, req_id=job.req_id, token=str(job.token), crc32=crc,
                block_crc32s=crcs, num_blocks=len(src_ids), num_layers=result.num_layers,
                num_bytes=result.num_bytes, transfer_s=result.transfer_s,
                layer_computed_s=timeline.layer_computed_s, layer_sent_s=timeline.layer_sent_s,
                done_s=timeline.done_s, exposed_s=timeline.exposed_s))
        except asyncio.CancelledError:
            reason = "request aborted"
        except (PdserveError, TimeoutError, OSError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            if sender is not None:
                if reason:
                    await sender.abort(reason)
                else:
                    await sender.close()
            self._send_jobs.pop(job.req_id, None)
            with self._lock:
                self._ended_sending.add(job.req_id)
            self._transfer_ended.set()
            if reason:
                logger.warning("KV send of %s (%s) failed: %s", job.req_id, job.token, reason)
                self._events.emit(ConnectorEvent(EventKind.FAILED, req_id=job.req_id,
                                                 token=str(job.token), reason=reason))

    def _check_destination(self, destination: KvDestinationSpec, spec: SendSpec,
                           job: _SendJob) -> DestinationPlacement:
        """Refuse a destination that does not fit this prompt (it would land KV in the wrong
        blocks): the send fails and the agent retries the request."""
        placement = DestinationPlacement.decode(destination.metadata)
        if placement.num_prompt_tokens != spec.num_prompt_tokens:
            raise InvalidArgumentError(
                f"destination is for {placement.num_prompt_tokens} prompt tokens, this "
                f"prompt has {spec.num_prompt_tokens}", field="destination")
        num_expected = job.num_prompt_blocks - placement.first_block
        if len(destination.block_ids) != num_expected or num_expected <= 0:
            raise InvalidArgumentError(
                f"destination has {len(destination.block_ids)} blocks from block "
                f"{placement.first_block}, the prompt needs {num_expected}",
                field="destination.block_ids")
        if destination.transport != self._settings.transport:
            raise InvalidArgumentError(
                f"destination transport {destination.transport!r}; this connector speaks "
                f"{self._settings.transport}", field="destination.transport")
        return placement

    async def _push_layers(self, job: _SendJob, sender: KvSender,
                           destination: KvDestinationSpec, placement: DestinationPlacement,
                           timeout_s: float) -> list[int]:
        """Offer each (layer, ready blocks) as it is posted, until every layer has every block;
        returns the source block ids sent (sequence order)."""
        first_block = placement.first_block
        num_blocks = job.num_prompt_blocks
        src_ids: list[int] = []
        while min(job.sent_upto) < num_blocks:
            layer, spec, _ = await asyncio.wait_for(job.queue.get(), timeout_s)
            start = max(first_block, job.sent_upto[layer])
            end = spec.num_ready_blocks
            if end > start:
                await sender.offer_layer(
                    layer, spec.block_ids[start:end],
                    destination.block_ids[start - first_block:end - first_block])
                job.sent_upto[layer] = end
            if end >= num_blocks and not job.sent_s[layer]:
                job.sent_s[layer] = time.perf_counter()
            if end >= num_blocks:
                src_ids = list(spec.block_ids[first_block:num_blocks])
        return src_ids
