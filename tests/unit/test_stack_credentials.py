"""A whole stack in this process, locked without mutual TLS: admin keys and a service token file
on the control plane, a verify-only (``sha256:``) copy on the workers' own servers, workers
that join by the join token alone and use the credential their pool hands them. Real gRPC
between every part. It serves requests; a worker credential acts only on tickets that name its
worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, pool_pb2_grpc
from pdserve.common.credentials import bearer_metadata, token_digest_line, worker_credential

MODEL = "llama-3.1-8b"
JOIN_TOKEN = "join-" + "j" * 27
SERVICE_TOKEN = "st-" + "s" * 29
ADMIN_KEY = "ak-" + "c" * 29


async def test_a_locked_stack_serves_and_binds_worker_credentials_to_their_tickets(
        tmp_path: Path) -> None:
    import aiohttp

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
    from pdserve.state.stores import open_stores
    from pdserve.worker.process import WorkerProcess
    from pdserve.worker.settings import WorkerSettings

    (tmp_path / "tokens").write_text(f"{SERVICE_TOKEN}\n")
    (tmp_path / "digests").write_text(token_digest_line(SERVICE_TOKEN) + "\n")
    (tmp_path / "admin").write_text(f"{ADMIN_KEY} ops\n")
    locked = {"service_tokens_path": tmp_path / "tokens", "admin_keys_path": tmp_path / "admin"}
    common = CommonSettings(metrics_port=-1, grace_period_s=0.0, **locked)
    stores = open_stores("memory://")
    server = GrpcServer.from_settings(common)
    coordinator = CoordinatorApp(stores.backend, time.time, CoordinatorPolicy(),
                                 MemoryRendezvous(), common)
    coordinator.register(server)
    pool_settings = {role: PoolSettings(role=role, join_token=JOIN_TOKEN, deployments=(MODEL,),
                                        **locked)
                     for role in WorkerRole}
    pools = {role: PoolApp(settings, stores.backend, stores.prefix_index, time.time)
             for role, settings in pool_settings.items()}
    server.add_servicer(POOL_SERVICE, pool_pb2_grpc.add_PoolServiceServicer_to_server,
                        PoolServicer({r: p.manager for r, p in pools.items()},
                                     stores.backend.workers, stores.backend.events,
                                     worker_credentials(pool_settings[WorkerRole.PREFILL])))
    router = RouterApp(RouterSettings(http_port=0, coordinator_address="127.0.0.1:1",
                                      metrics_port=-1, local_prefill_threshold_tokens=8,
                                      **locked),
                       stores.backend, stores.prefix_index,
                       LocalTicketClient(coordinator.coordinator))
    router.register(server)
    port = await server.start()
    address = f"127.0.0.1:{port}"
    coordinator.start()
    for pool in pools.values():
        await pool.start()
    await router.start()
    stop = asyncio.Event()
    workers, tasks = [], []
    try:
        for role, worker_id in ((WorkerRole.PREFILL, "p-1"), (WorkerRole.DECODE, "d-1")):
            worker = WorkerProcess(WorkerSettings(
                role=role, deployment=MODEL, model=MODEL, worker_id=worker_id,
                pool_address=address, coordinator_address=address, join_token=JOIN_TOKEN,
                speedup=1e4, max_num_blocks=512, num_kv_layers=4, metrics_port=-1,
                grace_period_s=0.0, service_tokens_path=tmp_path / "digests"))
            await worker.start()
            assert worker.credential == worker_credential(SERVICE_TOKEN, worker_id)
            workers.append(worker)
            tasks.append(asyncio.create_task(worker.run(stop)))
        deadline = time.monotonic() + 30
        while not all(router.view.ready(MODEL, role) for role in WorkerRole):
            assert time.monotonic() < deadline, "the workers never became ready"
            await asyncio.sleep(0.05)

        # Served end to end: router -> workers (service token, checked by digest), workers ->
        # pool and coordinator (their credentials), a remote prefill with a KV handoff.
        body = {"model": MODEL, "prompt": "a prompt long enough to prefill remotely",
                "max_tokens": 4}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                                    json=body) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["usage"]["completion_tokens"] == 4

        async with grpc.aio.insecure_channel(address) as channel:
            kv = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
            opened = await kv.OpenTicket(kv_transfer_pb2.OpenTicketRequest(
                deployment=MODEL, decode_worker_id="d-1", prefill_worker_id="p-1",
                num_blocks=4, lease_ms=5000, num_prompt_tokens=40),
                metadata=bearer_metadata(SERVICE_TOKEN), timeout=5)
            renew = kv_transfer_pb2.RenewLeaseRequest(token=opened.ticket.token, lease_ms=5000)
            for credential, code in (
                    (None, grpc.StatusCode.UNAUTHENTICATED),
                    (worker_credential(SERVICE_TOKEN, "intruder"),
                     grpc.StatusCode.PERMISSION_DENIED),
                    (worker_credential("another-token-0123456789", "p-1"),
                     grpc.StatusCode.UNAUTHENTICATED)):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await kv.RenewLease(renew, timeout=5, metadata=(
                        bearer_metadata(credential) if credential else None))
                assert caught.value.code() is code, credential
            await kv.RenewLease(renew, timeout=5, metadata=bearer_metadata(workers[0].credential))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await kv.AbortTicket(kv_transfer_pb2.AbortTicketRequest(
                    token=opened.ticket.token, reason="not mine"), timeout=5,
                    metadata=bearer_metadata(worker_credential(SERVICE_TOKEN, "p-2")))
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            await kv.AbortTicket(kv_transfer_pb2.AbortTicketRequest(
                token=opened.ticket.token, reason="test done"), timeout=5,
                metadata=bearer_metadata(ADMIN_KEY))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            await worker.close()
        await server.stop(0)
        await router.close()
        for pool in pools.values():
            await pool.close()
        await coordinator.close()
        await stores.close()
