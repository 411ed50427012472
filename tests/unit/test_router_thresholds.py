"""The router applies the local-prefill threshold the governor publishes (``router.thresholds``):
read from the store on refresh, never per request; the setting when nothing is published."""

from __future__ import annotations

from pdserve.api.v1 import common_pb2 as pb
from pdserve.common.clock import ManualClock
from pdserve.common.types import ThresholdSource, WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.router.core import Router, RouterConfig
from pdserve.router.policy import RoutingConfig
from pdserve.router.pool_view import PoolView
from pdserve.router.thresholds import PublishedThresholds
from pdserve.router.types import GenerationRequest
from pdserve.state.memory.backend import MemoryStateBackend

SETTING_TOKENS = 64


def _record(worker_id: str, role: WorkerRole) -> WorkerRecord:
    info = pb.WorkerInfo(worker_id=worker_id, kv_layout=pb.KvLayout(
        num_layers=2, num_blocks=1024, block_size_tokens=16, block_nbytes=64))
    return WorkerRecord(worker_id=worker_id, deployment="m", role=role, state=WorkerState.READY,
                        address=worker_id, spec=info.SerializeToString(),
                        load=WorkerLoad(num_free_blocks=1024, num_total_blocks=1024))


def _router(store: object) -> Router:
    view = PoolView()
    view.replace("m", [_record("d0", WorkerRole.DECODE), _record("p0", WorkerRole.PREFILL)])
    config = RouterConfig(routing=RoutingConfig(local_prefill_threshold_tokens=SETTING_TOKENS))
    thresholds = PublishedThresholds(store, config.routing)  # type: ignore[arg-type]
    return Router(config, view, tickets=None, workers=None,  # type: ignore[arg-type]
                  thresholds=thresholds)


async def _is_local(router: Router, num_prompt_tokens: int) -> bool:
    request = GenerationRequest(request_id="r", model="m",
                                prompt_token_ids=tuple(range(num_prompt_tokens)), max_tokens=4)
    decision = await router._route(request, frozenset())
    return decision.is_local_prefill


class _CountingStore:
    """A threshold store that counts its reads."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.num_reads = 0

    async def list(self) -> object:
        self.num_reads += 1
        return await self.inner.list()  # type: ignore[attr-defined]


async def test_published_thresholds_change_decisions_after_a_refresh_only() -> None:
    backend = MemoryStateBackend(ManualClock(0.0))
    store = _CountingStore(backend.thresholds)
    router = _router(store)
    assert router.thresholds is not None
    assert await _is_local(router, 40) and not await _is_local(router, 200)  # the setting

    await backend.thresholds.publish("m", 0, ThresholdSource.COMPUTED)
    assert await _is_local(router, 40), "applied before a refresh"
    await router.thresholds.refresh()
    assert not await _is_local(router, 40) and not await _is_local(router, 200)

    await backend.thresholds.publish("m", 256, ThresholdSource.PINNED)
    await router.thresholds.refresh()
    assert await _is_local(router, 40) and await _is_local(router, 200)
    assert not await _is_local(router, 300)
    published = router.thresholds.published("m")
    assert published is not None and published.version == 2

    await backend.thresholds.publish("other", 0, ThresholdSource.COMPUTED)
    await backend.thresholds.clear("m")
    await router.thresholds.refresh()
    assert await _is_local(router, 40) and not await _is_local(router, 200)  # the setting again
    assert router.routing_for("other").local_prefill_threshold_tokens == 0
    assert store.num_reads == 3  # routing never read the store


async def test_a_failed_read_keeps_the_last_copy() -> None:
    backend = MemoryStateBackend(ManualClock(0.0))
    router = _router(backend.thresholds)
    assert router.thresholds is not None
    await backend.thresholds.publish("m", 512, ThresholdSource.PINNED)
    await router.thresholds.start()
    try:
        assert await _is_local(router, 300)

        async def failing() -> None:
            raise ConnectionError("store restarting")

        backend.thresholds.list = failing  # type: ignore[method-assign]
        await router.thresholds._refresh_logged()
        assert await _is_local(router, 300)
    finally:
        await router.thresholds.close()
