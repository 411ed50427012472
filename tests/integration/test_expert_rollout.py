"""Expert placement end to end on real Redis and Postgres, over real gRPC: MoE sim workers report
per-expert token counts in heartbeats, the pool manager queues them in Redis, the governor's
placement loop plans, stores each version in Postgres and rolls it out to every worker while
requests stream through the router; a restarted governor carries on from the stored version.

Everything runs in this process (one gRPC server for pool manager, coordinator and router; one
per worker), with a manual clock for the governor so that re-plans happen when the test says.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np
import pytest
import sqlalchemy as sa

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.capacity.expert_policy import ExpertPolicy, ReplanReason
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings
from pdserve.common.types import WorkerRole, WorkerState
from pdserve.db import Repository, make_engine, normalize_url, upgrade
from pdserve.governor.expert_client import GrpcWorkerPlacementClient
from pdserve.governor.expert_loop import ExpertPlacementGovernor
from pdserve.kv_transfer.app import CoordinatorApp
from pdserve.kv_transfer.coordinator import CoordinatorPolicy
from pdserve.kv_transfer.local_client import LocalTicketClient
from pdserve.kv_transfer.rendezvous import MemoryRendezvous
from pdserve.pool.app import PoolApp
from pdserve.pool.settings import PoolSettings
from pdserve.router.app import RouterApp
from pdserve.router.settings import RouterSettings
from pdserve.state.expert_loads import ExpertLoadReport, expert_load_store_for
from pdserve.state.factory import StateOptions
from pdserve.state.prefix_index import MemoryPrefixIndex
from pdserve.state.redis.backend import RedisStateBackend
from pdserve.worker.engines.sim import expert_popularity
from pdserve.worker.process import WorkerProcess
from pdserve.worker.settings import WorkerSettings

MODEL = "mixtral-8x7b"
NUM_MOE_LAYERS = 4
NUM_EXPERTS = 8
NUM_WORKERS = 2
MAX_TOKENS = 24
JOIN_TOKEN = "expert-rollout-test"


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def repository_url(database_url: str) -> Iterator[sa.URL]:
    """A URL whose connections see only a private, freshly created schema."""
    schema = f"pdserve_experts_{secrets.token_hex(5)}"
    admin = make_engine(database_url)
    with admin.begin() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    yield normalize_url(database_url).update_query_dict({"options": f"-csearch_path={schema}"})
    with admin.begin() as connection:
        connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    admin.dispose()


def open_repository(url: sa.URL) -> Repository:
    repository = Repository(make_engine(url))
    upgrade(repository.engine)
    return repository


class Stack:
    """Pool manager, coordinator and router on one gRPC server, plus MoE sim workers."""

    def __init__(self, redis_url: str) -> None:
        self.prefix = f"pdtest{secrets.token_hex(4)}"
        self.backend = RedisStateBackend.from_url(redis_url, time.time,
                                                  StateOptions(key_prefix=self.prefix))
        self.server = GrpcServer()
        prefix_index = MemoryPrefixIndex()
        self.coordinator = CoordinatorApp(self.backend, time.time, CoordinatorPolicy(),
                                          MemoryRendezvous(), CommonSettings())
        self.pool = PoolApp(PoolSettings(role=WorkerRole.DECODE, join_token=JOIN_TOKEN,
                                         heartbeat_interval_s=0.1, heartbeat_timeout_s=30.0),
                            self.backend, prefix_index, time.time)
        self.router = RouterApp(
            RouterSettings(http_port=-1, coordinator_address="127.0.0.1:1",
                           local_prefill_threshold_tokens=100_000, transport="tcp"),
            self.backend, prefix_index, LocalTicketClient(self.coordinator.coordinator))
        for app in (self.coordinator, self.pool, self.router):
            app.register(self.server)
        self.address = ""
        self.workers: list[WorkerProcess] = []
        self._stop = asyncio.Event()
        self._runs: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        port = await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.coordinator.start()
        await self.pool.start()
        for index in range(NUM_WORKERS):
            worker = WorkerProcess(WorkerSettings(
                role=WorkerRole.DECODE, deployment=MODEL, model=MODEL, tp_size=2,
                pool_address=self.address, coordinator_address=self.address,
                join_token=JOIN_TOKEN, speedup=5.0, max_num_blocks=512, num_kv_layers=2,
                num_moe_layers=NUM_MOE_LAYERS, expert_skew=1.2, expert_seed=11,
                expert_report_interval_s=0.1, transport="tcp", metrics_port=-1,
                worker_id=f"moe-{index}"))
            await worker.start()
            self.workers.append(worker)
            self._runs.append(asyncio.create_task(worker.run(self._stop)))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            records = await self.backend.workers.list(MODEL, WorkerRole.DECODE)
            if sum(r.state is WorkerState.READY for r in records) == NUM_WORKERS:
                await self.router.start()  # discovers the deployment and syncs its view
                return
            await asyncio.sleep(0.05)
        raise AssertionError("workers did not become READY")

    async def close(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._runs, return_exceptions=True)
        await self.server.stop(0)
        for worker in self.workers:
            await worker.close()
        await self.router.close()
        await self.pool.close()
        await self.coordinator.close()
        keys = [key async for key in self.backend.client.scan_iter(match=f"{self.prefix}:*")]
        if keys:
            await self.backend.client.delete(*keys)
        await self.backend.close()


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    stack = Stack(redis_url)
    try:
        await stack.start()
        yield stack
    finally:
        await stack.close()


async def generate(stub: router_pb2_grpc.RouterServiceStub, seed: int) -> int:
    """One request through the router; returns the number of tokens streamed back."""
    request = router_pb2.GenerateRequest(
        model=MODEL, prompt_token_ids=[32 + (seed + i) % 90 for i in range(40)],
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS))
    num_tokens = 0
    async for chunk in stub.Generate(request, timeout=30):
        num_tokens += len(chunk.token_ids)
    return num_tokens


def shifted_profile(seed: int) -> np.ndarray:
    """A strong load profile with other hot experts (the traffic mix changed)."""
    popularity = expert_popularity(NUM_MOE_LAYERS, NUM_EXPERTS, 2.0, seed)
    return np.random.default_rng(seed).multinomial(2_000_000, popularity)


async def test_placements_roll_out_to_every_worker_while_requests_stream(
        stack: Stack, repository_url: sa.URL) -> None:
    clock = ManualClock()
    policy = ExpertPolicy(half_life_s=10.0, replan_period_s=60.0, min_tokens_per_layer=100.0,
                          rollout_timeout_s=5.0)
    loads = expert_load_store_for(stack.backend)
    client = GrpcWorkerPlacementClient(None, policy.rollout_timeout_s)
    repository = open_repository(repository_url)
    governor = ExpertPlacementGovernor(policy, stack.backend.workers, loads, client, clock,
                                       repository)
    channel = grpc.aio.insecure_channel(stack.address)
    router = router_pb2_grpc.RouterServiceStub(channel)
    try:
        # Real traffic: workers count routed tokens and report them in heartbeats, through the
        # pool manager into Redis, where the governor drains them.
        assert await asyncio.gather(*(generate(router, i) for i in range(6))) == [MAX_TOKENS] * 6
        for _ in range(100):
            await asyncio.sleep(0.05)
            await governor.tick()
            if (await governor.status(MODEL, WorkerRole.DECODE)).version:
                break
        first = await governor.status(MODEL, WorkerRole.DECODE)
        estimate = governor.estimate(MODEL, WorkerRole.DECODE)
        assert estimate is not None and estimate.shape == (NUM_MOE_LAYERS, NUM_EXPERTS)
        assert first.version >= 1 and first.current is not None
        assert first.current.reason == ReplanReason.INITIAL
        assert first.is_rolled_out and first.num_workers == NUM_WORKERS

        # Steady traffic while the hot experts move three times: each move is a new version,
        # rolled out to both workers in the middle of their decode batches.
        results: list[int | BaseException] = []
        stop_load = asyncio.Event()

        async def client_loop(index: int) -> None:
            round_ = 0
            while not stop_load.is_set():
                try:
                    results.append(await generate(router, index * 1000 + round_))
                except grpc.aio.AioRpcError as exc:
                    results.append(exc)
                round_ += 1

        clients = [asyncio.create_task(client_loop(i)) for i in range(6)]
        versions, rolled_out_mid_batch = [first.version], 0
        for shift in range(3):
            await asyncio.sleep(0.2)
            clock.now_s += 30 * policy.half_life_s  # the earlier loads are forgotten
            await loads.append(MODEL, WorkerRole.DECODE, ExpertLoadReport(
                "traffic-shift", NUM_MOE_LAYERS, shifted_profile(100 + shift).reshape(-1)))
            is_mid_batch = any(w.agent.load().num_running_seqs for w in stack.workers)
            await governor.tick()
            status = await governor.status(MODEL, WorkerRole.DECODE)
            versions.append(status.version)
            assert status.is_rolled_out, status.errors
            assert status.current is not None and status.current.num_experts_moved > 0
            rolled_out_mid_batch += is_mid_batch
        await asyncio.sleep(0.2)
        stop_load.set()
        await asyncio.gather(*clients)

        assert versions == sorted(set(versions)) and len(versions) == 4  # strictly increasing
        assert rolled_out_mid_batch >= 1, "no roll-out met a running batch"
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, failures[:3]
        assert len(results) >= 6 and all(r == MAX_TOKENS for r in results)

        # Every worker runs the final version, as it says itself over gRPC.
        final = await governor.status(MODEL, WorkerRole.DECODE)
        assert final.current is not None
        for worker in stack.workers:
            async with grpc.aio.insecure_channel(worker.address) as worker_channel:
                status = await worker_pb2_grpc.WorkerAgentServiceStub(worker_channel).GetStatus(
                    worker_pb2.GetStatusRequest(), timeout=5)
            assert status.expert_placement_version == final.version
        assert repository.latest_expert_placement(MODEL).version == final.version

        # A governor restarted over the same database carries on from the stored version.
        await client.close()
        repository.close()
        repository = open_repository(repository_url)
        client = GrpcWorkerPlacementClient(None, policy.rollout_timeout_s)
        governor = ExpertPlacementGovernor(policy, stack.backend.workers, loads, client, clock,
                                           repository)
        restored = await governor.status(MODEL, WorkerRole.DECODE)
        assert restored.version == final.version and restored.current is not None
        assert np.array_equal(restored.current.placement.slot_to_expert,
                              final.current.placement.slot_to_expert)
        clock.now_s += 30 * policy.half_life_s
        await loads.append(MODEL, WorkerRole.DECODE, ExpertLoadReport(
            "traffic-shift", NUM_MOE_LAYERS, shifted_profile(200).reshape(-1)))
        await governor.tick()
        after = await governor.status(MODEL, WorkerRole.DECODE)
        assert after.version == final.version + 1 and after.is_rolled_out
        assert all(w.agent.expert_placement_version == after.version for w in stack.workers)
    finally:
        await channel.close()
        await client.close()
        repository.close()


async def test_redis_expert_load_queue_keeps_the_newest_reports_and_drains_once(
        redis_url: str) -> None:
    import redis.asyncio as aioredis

    from pdserve.state.expert_loads import RedisExpertLoadStore

    prefix = f"pdtest{secrets.token_hex(4)}"
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    store = RedisExpertLoadStore(client, prefix, max_reports=3)
    try:
        for index in range(5):
            await store.append("m", WorkerRole.DECODE, ExpertLoadReport(f"w{index}", 1, [index, 1]))
        await store.append("m", WorkerRole.PREFILL, ExpertLoadReport("p", 2, [1, 2, 3, 4]))
        assert await store.pools() == [("m", WorkerRole.DECODE), ("m", WorkerRole.PREFILL)]
        drained = await store.drain("m", WorkerRole.DECODE)
        assert [r.worker_id for r in drained] == ["w2", "w3", "w4"]  # the oldest were dropped
        assert [r.matrix().tolist() for r in drained] == [[[2, 1]], [[3, 1]], [[4, 1]]]
        assert await store.drain("m", WorkerRole.DECODE) == []
        [prefill] = await store.drain("m", WorkerRole.PREFILL)
        assert prefill.matrix().tolist() == [[1, 2], [3, 4]]
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
