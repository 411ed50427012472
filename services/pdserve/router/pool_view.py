"""The router's local view of every deployment's pools, following the shared change stream.

Routers read the pool state that pool managers write (the router is a control-plane service and
holds store credentials). A view starts from a snapshot, applies change events, and resyncs from a
new snapshot whenever the stream reports a gap (trimmed history or a store restart), so several
router replicas converge on the same picture without talking to each other.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.api.v1 import common_pb2 as pb
from pdserve.common.types import PoolEventKind, WorkerRecord, WorkerRole, WorkerState
from pdserve.state.interfaces import StateBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerView:
    record: WorkerRecord
    info: pb.WorkerInfo

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def block_size_tokens(self) -> int:
        return self.info.kv_layout.block_size_tokens or 16


def _view(record: WorkerRecord) -> WorkerView:
    info = pb.WorkerInfo()
    if record.spec:
        info.ParseFromString(record.spec)
    return WorkerView(record, info)


class PoolView:
    """Workers by deployment. Mutated only by ``PoolFollower``; read by the router.

    Listeners (``add_listener``) see every worker view as it enters or changes, e.g. so the
    tokenizer registry loads a new tokenizer before the first request needs it.
    """

    def __init__(self) -> None:
        self._workers: dict[str, dict[str, WorkerView]] = {}
        self._listeners: list[Callable[[WorkerView], None]] = []

    def add_listener(self, listener: Callable[[WorkerView], None]) -> None:
        self._listeners.append(listener)

    def deployments(self) -> list[str]:
        return sorted(self._workers)

    def replace(self, deployment: str, records: list[WorkerRecord]) -> None:
        views = [_view(r) for r in records]
        self._workers[deployment] = {v.worker_id: v for v in views}
        for view in views:
            self._notify(view)

    def upsert(self, record: WorkerRecord) -> None:
        view = _view(record)
        self._workers.setdefault(record.deployment, {})[record.worker_id] = view
        self._notify(view)

    def _notify(self, view: WorkerView) -> None:
        for listener in self._listeners:
            listener(view)

    def remove(self, deployment: str, worker_id: str) -> None:
        self._workers.get(deployment, {}).pop(worker_id, None)

    def ready(self, deployment: str, role: WorkerRole) -> list[WorkerView]:
        return [
            w for w in self._workers.get(deployment, {}).values()
            if w.record.role is role and w.record.state is WorkerState.READY
        ]

    def get(self, deployment: str, worker_id: str) -> WorkerView | None:
        return self._workers.get(deployment, {}).get(worker_id)

    def max_context_tokens(self, deployment: str) -> int:
        """Longest sequence (prompt + output, tokens) a request may have: what the largest ready
        decode worker's KV cache holds, and at most the model's context limit
        (``max_model_len``) where the workers report one; 0 = no ready decode worker."""
        decoders = self.ready(deployment, WorkerRole.DECODE)
        kv_tokens = max((w.info.kv_layout.num_blocks * w.block_size_tokens for w in decoders),
                        default=0)
        model_limits = [w.info.max_model_len for w in decoders if w.info.max_model_len > 0]
        return min(kv_tokens, *model_limits) if model_limits else kv_tokens

    def tokenizer_sha256(self, deployment: str) -> str:
        """Digest of the tokenizer the deployment's workers serve ("" = the byte tokenizer).

        One deployment is one model with one tokenizer; should its workers disagree (a tokenizer
        rolled out while old workers still run), the digest most ready workers advertise wins
        (ties: the smaller digest), or most workers of any state while none is ready."""
        workers = list(self._workers.get(deployment, {}).values())
        ready = [w for w in workers if w.record.state is WorkerState.READY]
        counts = collections.Counter(w.info.tokenizer_sha256 for w in (ready or workers))
        if not counts:
            return ""
        return min(counts, key=lambda sha256: (-counts[sha256], sha256))


class PoolFollower:
    """Keeps a ``PoolView`` in step with the store's change stream for each deployment."""

    def __init__(self, backend: StateBackend, view: PoolView, deployments: tuple[str, ...] = (),
                 discover_interval_s: float = 2.0) -> None:
        self._backend = backend
        self._view = view
        self._deployments = set(deployments)
        self._discover_interval_s = discover_interval_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._discover_task: asyncio.Task[None] | None = None
        self._synced: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        await self._discover()
        for deployment in list(self._deployments):
            self._follow(deployment)
        self._discover_task = asyncio.create_task(self._discover_loop())
        await asyncio.gather(*(e.wait() for e in self._synced.values()))

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *([self._discover_task] if self._discover_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _discover(self) -> None:
        for record in await self._backend.workers.list():
            self._deployments.add(record.deployment)

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self._discover_interval_s)
            try:
                await self._discover()
            except Exception:  # noqa: BLE001 - the store may be restarting
                logger.debug("pool discovery failed", exc_info=True)
                continue
            for deployment in list(self._deployments):
                if deployment not in self._tasks:
                    self._follow(deployment)

    def _follow(self, deployment: str) -> None:
        self._synced.setdefault(deployment, asyncio.Event())
        self._tasks[deployment] = asyncio.create_task(self._follow_loop(deployment))

    async def _follow_loop(self, deployment: str) -> None:
        cursor = ""
        while True:
            try:
                if not cursor:
                    snapshot = await self._backend.events.snapshot(deployment,
                                                                   self._backend.workers)
                    self._view.replace(deployment, list(snapshot.workers))
                    cursor = snapshot.cursor
                    self._synced[deployment].set()
                batch = await self._backend.events.read(deployment, cursor, timeout_s=1.0)
                if batch.is_gap:
                    logger.info("pool stream gap for %s: resyncing", deployment)
                    cursor = ""
                    continue
                for event in batch.events:
                    if event.kind is PoolEventKind.UPSERTED and event.worker is not None:
                        self._view.upsert(event.worker)
                    elif event.kind is PoolEventKind.REMOVED:
                        self._view.remove(deployment, event.worker_id)
                cursor = batch.cursor
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - store restart: back off and resync
                logger.warning("following pool %s failed; resyncing", deployment, exc_info=True)
                cursor = ""
                await asyncio.sleep(0.5)
