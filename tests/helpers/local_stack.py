"""A whole stack in this process on memory state: the coordinator, both pool managers and the
router on one gRPC server, one prefill and one decode worker (sim engines, KV over a real
socket) on servers of their own, READY in the router's view. Real gRPC between every part."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.api.v1 import pool_pb2_grpc
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings
from pdserve.common.types import WorkerRole
from pdserve.kv_transfer.app import CoordinatorApp
from pdserve.kv_transfer.coordinator import CoordinatorPolicy
from pdserve.kv_transfer.local_client import LocalTicketClient
from pdserve.kv_transfer.rendezvous import MemoryRendezvous
from pdserve.pool.app import PoolApp, worker_credentials
from pdserve.pool.servicer import SERVICE_NAME as POOL_SERVICE
from pdserve.pool.servicer import PoolServicer
from pdserve.pool.settings import PoolSettings
from pdserve.router.app import RouterApp
from pdserve.router.settings import RouterSettings
from pdserve.state.stores import Stores, open_stores
from pdserve.worker.process import WorkerProcess
from pdserve.worker.settings import WorkerSettings

READY_TIMEOUT_S = 30.0


@dataclass
class LocalStack:
    address: str
    """The control plane's gRPC server (coordinator, pools, router)."""
    stores: Stores
    router: RouterApp
    workers: dict[WorkerRole, WorkerProcess]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.router.http_port}"


@contextlib.asynccontextmanager
async def local_stack(
    model: str, join_token: str, *, local_prefill_threshold_tokens: int,
    locked: Mapping[str, Any] | None = None, worker_settings: Mapping[str, Any] | None = None,
    prepare_worker: Callable[[WorkerProcess], None] | None = None,
) -> AsyncIterator[LocalStack]:
    """``locked``: the credential settings (service tokens, admin keys) of the control plane's
    parts; ``worker_settings``: more settings for both workers; ``prepare_worker``: called on
    each worker before it starts. Workers are named ``p-1`` and ``d-1``."""
    locked = dict(locked or {})
    common = CommonSettings(metrics_port=-1, grace_period_s=0.0, **locked)
    stores = open_stores("memory://")
    server = GrpcServer.from_settings(common)
    coordinator = CoordinatorApp(stores.backend, time.time, CoordinatorPolicy(),
                                 MemoryRendezvous(), common)
    coordinator.register(server)
    pool_settings = {role: PoolSettings(role=role, join_token=join_token, deployments=(model,),
                                        **locked)
                     for role in WorkerRole}
    pools = {role: PoolApp(settings, stores.backend, stores.prefix_index, time.time)
             for role, settings in pool_settings.items()}
    server.add_servicer(POOL_SERVICE, pool_pb2_grpc.add_PoolServiceServicer_to_server,
                        PoolServicer({r: p.manager for r, p in pools.items()},
                                     stores.backend.workers, stores.backend.events,
                                     worker_credentials(pool_settings[WorkerRole.PREFILL])))
    router = RouterApp(RouterSettings(
        http_port=0, coordinator_address="127.0.0.1:1", metrics_port=-1,
        local_prefill_threshold_tokens=local_prefill_threshold_tokens, **locked),
        stores.backend, stores.prefix_index, LocalTicketClient(coordinator.coordinator))
    router.register(server)
    address = f"127.0.0.1:{await server.start()}"
    coordinator.start()
    for pool in pools.values():
        await pool.start()
    await router.start()
    stop = asyncio.Event()
    workers: dict[WorkerRole, WorkerProcess] = {}
    tasks = []
    try:
        for role, worker_id in ((WorkerRole.PREFILL, "p-1"), (WorkerRole.DECODE, "d-1")):
            worker = WorkerProcess(WorkerSettings(
                role=role, deployment=model, model=model, worker_id=worker_id,
                pool_address=address, coordinator_address=address, join_token=join_token,
                speedup=1e4, max_num_blocks=512, num_kv_layers=4, metrics_port=-1,
                grace_period_s=0.0, **(worker_settings or {})))
            if prepare_worker is not None:
                prepare_worker(worker)
            await worker.start()
            workers[role] = worker
            tasks.append(asyncio.create_task(worker.run(stop)))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(router.view.ready(model, role) for role in WorkerRole):
            assert time.monotonic() < deadline, "the workers never became ready"
            await asyncio.sleep(0.05)
        yield LocalStack(address, stores, router, workers)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers.values():
            await worker.close()
        await server.stop(0)
        await router.close()
        for pool in pools.values():
            await pool.close()
        await coordinator.close()
        await stores.close()
