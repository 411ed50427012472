"""The governor's expert-placement loop: the decayed load estimate, re-plan triggers, versions
that survive a restart, roll-out to every worker, the service's errors, and the sim engine's
straggler effect (placement quality shows up in decode step time)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import governor_pb2, governor_pb2_grpc, worker_pb2
from pdserve.capacity.eplb import plan_expert_placement
from pdserve.capacity.eplb_placement import (
    ExpertPlacement,
    PlacementPolicy,
    PlacementTopology,
    gpu_balancedness,
)
from pdserve.capacity.expert_policy import (
    ExpertPolicy,
    LoadEstimate,
    ReplanInputs,
    ReplanReason,
    decay_factor,
    default_slots_per_gpu,
    fold_reports,
    pool_topology,
    replan_reason,
)
from pdserve.capacity.expert_versions import parse_placement_key, placement_key
from pdserve.common.errors import InvalidArgumentError, UnavailableError
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.types import WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.db import Repository, upgrade
from pdserve.governor.app import GovernorApp
from pdserve.governor.expert_convert import WorkerInstance
from pdserve.governor.expert_loop import ExpertPlacementGovernor
from pdserve.governor.settings import GovernorSettings
from pdserve.pool.manager import Heartbeat, PoolManager, PoolPolicy, Registration
from pdserve.state.expert_loads import (
    ExpertLoadReport,
    MemoryExpertLoadStore,
    decode_report,
    encode_report,
    expert_load_store_for,
)
from pdserve.state.factory import open_backend
from pdserve.state.prefix_index import MemoryPrefixIndex
from pdserve.worker.agent import AgentConfig
from pdserve.worker.engine import Sequence
from pdserve.worker.engines.sim import SimConfig, SimEngine, expert_popularity
from pdserve.worker.scheduler.agents import create_agent
from pdserve.worker.transports.registry import get_backend

DECODE = WorkerRole.DECODE
NUM_LAYERS, NUM_EXPERTS = 4, 8
MIXTRAL_SPEC = pb.WorkerInfo(num_gpus=2, tp_size=2, model="mixtral-8x7b").SerializeToString()


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class FakeWorkers:
    """Worker side of ``WorkerPlacementClient``: per address the version in force; addresses in
    ``failing`` refuse calls until removed."""

    def __init__(self) -> None:
        self.versions: dict[str, int] = {}
        self.slot_maps: dict[str, list[int]] = {}
        self.failing: set[str] = set()
        self.num_calls = 0

    async def apply(self, address: str, request: worker_pb2.ApplyExpertPlacementRequest) -> int:
        self.num_calls += 1
        if address in self.failing:
            raise UnavailableError(f"{address} unreachable")
        if request.version > self.versions.get(address, 0):
            self.versions[address] = request.version
            self.slot_maps[address] = list(request.slot_to_expert)
        return request.version

    async def status(self, address: str) -> WorkerInstance:
        if address in self.failing:
            raise UnavailableError(f"{address} unreachable")
        return WorkerInstance(2, "mixtral-8x7b", self.versions.get(address, 0))

    async def retain(self, addresses: object) -> None:
        return None

    async def close(self) -> None:
        return None


def profile_counts(seed: int, num_tokens: int = 50_000, skew: float = 1.2) -> np.ndarray:
    """``[NUM_LAYERS, NUM_EXPERTS]`` token counts drawn from a seeded Zipf profile."""
    popularity = expert_popularity(NUM_LAYERS, NUM_EXPERTS, skew, seed)
    return np.random.default_rng(seed).multinomial(num_tokens, popularity)


async def add_workers(backend, count: int, spec: bytes = MIXTRAL_SPEC, start: int = 0) -> None:  # type: ignore[no-untyped-def]
    for index in range(start, start + count):
        await backend.workers.upsert(WorkerRecord(
            f"d{index}", "m", DECODE, WorkerState.READY, f"addr{index}", spec=spec,
            registered_s=1.0), 1e9)


class Harness:
    """A governor over the in-process backend, fake workers, a manual clock and SQLite."""

    def __init__(self, db_path: Path | None, policy: ExpertPolicy | None = None) -> None:
        self.clock = ManualClock()
        self.backend = open_backend(None, self.clock)
        self.loads = expert_load_store_for(self.backend)
        self.workers = FakeWorkers()
        self.policy = policy or ExpertPolicy(min_tokens_per_layer=1000, replan_period_s=600,
                                             min_replan_interval_s=60, half_life_s=300)
        self.db_path = db_path
        self.repository = self.open_repository() if db_path is not None else None
        self.governor = self.new_governor()

    def open_repository(self) -> Repository:
        assert self.db_path is not None
        repository = Repository.from_url(f"sqlite:///{self.db_path}")
        upgrade(repository.engine)
        return repository

    def new_governor(self) -> ExpertPlacementGovernor:
        return ExpertPlacementGovernor(self.policy, self.backend.workers, self.loads, self.workers,
                                       self.clock, self.repository)

    async def report(self, counts: np.ndarray, worker_id: str = "d0") -> None:
        await self.loads.append("m", DECODE, ExpertLoadReport(worker_id, counts.shape[0],
                                                              counts.reshape(-1)))

    async def status(self):  # type: ignore[no-untyped-def]
        return await self.governor.status("m", DECODE)


# -- the decayed estimate ---------------------------------------------------------------------


def test_decay_halves_the_weight_every_half_life() -> None:
    counts = np.full((2, 3), 800.0)
    estimate = LoadEstimate(counts, as_of_s=10.0)
    assert np.allclose(estimate.at(10.0 + 60.0, 60.0).token_loads, 400.0)
    assert np.allclose(estimate.at(10.0 + 180.0, 60.0).token_loads, 100.0)
    # A count added one half-life later weighs twice the older one from then on.
    later = estimate.add(np.full((2, 3), 800.0), 70.0, 60.0)
    assert np.allclose(later.at(130.0, 60.0).token_loads, 800.0 / 4 + 800.0 / 2)
    assert decay_factor(-5.0, 60.0) == 1.0  # a clock that stepped back never amplifies
    assert math.isclose(decay_factor(30.0, 60.0), 2 ** -0.5)


def test_folding_reports_sums_them_and_restarts_on_a_new_shape() -> None:
    first = ExpertLoadReport("w1", 2, [1, 2, 3, 4])
    second = ExpertLoadReport("w2", 2, [10, 20, 30, 40])
    estimate, ignored = fold_reports(None, [first, second], 5.0, 60.0)
    assert estimate is not None and ignored == 0
    assert estimate.token_loads.tolist() == [[11, 22], [33, 44]]
    other_shape = ExpertLoadReport("w1", 1, [7, 7, 7])
    restarted, ignored = fold_reports(estimate, [first, other_shape], 65.0, 60.0)
    assert restarted is not None and ignored == 1
    assert restarted.token_loads.tolist() == [[7, 7, 7]]


def test_expert_load_reports_round_trip_and_refuse_bad_shapes() -> None:
    report = ExpertLoadReport("w", 2, [0, 5, 2**40, 1])
    again = decode_report(encode_report(report))
    assert again.worker_id == "w" and again.matrix().tolist() == report.matrix().tolist()
    with pytest.raises(InvalidArgumentError, match="multiple of num_moe_layers"):
        ExpertLoadReport("w", 3, [1, 2, 3, 4])
    with pytest.raises(InvalidArgumentError, match="num_moe_layers"):
        ExpertLoadReport("w", 0, [1])
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        ExpertLoadReport("w", 1, [1, -2])


# -- re-plan triggers -------------------------------------------------------------------------

POLICY = ExpertPolicy(replan_period_s=600, min_balancedness=0.8, min_replan_interval_s=60,
                      min_tokens_per_layer=100)


def inputs(**changes: object) -> ReplanInputs:
    base = {"now_s": 1000.0, "num_tokens_per_layer": 500.0, "has_placement": True,
                "is_topology_current": True, "last_plan_s": 900.0, "balancedness": 0.95}
    base.update(changes)
    return ReplanInputs(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "expected"), [
    ({}, None),
    ({"has_placement": False}, ReplanReason.INITIAL),
    ({"has_placement": False, "num_tokens_per_layer": 99.0}, None),
    ({"is_topology_current": False}, ReplanReason.TOPOLOGY),
    ({"last_plan_s": 400.0}, ReplanReason.PERIOD),
    ({"last_plan_s": 400.0, "num_tokens_per_layer": 10.0}, None),
    ({"balancedness": 0.7}, ReplanReason.IMBALANCE),
    ({"balancedness": 0.7, "last_plan_s": 950.0}, None),  # imbalance, but within the cooldown
    ({"balancedness": 0.8}, None),
])
def test_replan_reason(changes: dict[str, object], expected: ReplanReason | None) -> None:
    assert replan_reason(inputs(**changes), POLICY) == expected


def test_pool_topology_matches_deepseek_deployments() -> None:
    policy = ExpertPolicy(gpus_per_node=8, num_groups=8)
    ep320 = pool_topology(320, 256, WorkerRole.DECODE, policy)
    ep144 = pool_topology(144, 256, WorkerRole.DECODE, policy)
    ep32 = pool_topology(32, 256, WorkerRole.PREFILL, policy)
    assert (ep320.num_slots, ep320.num_nodes, ep320.policy) == (320, 40, PlacementPolicy.GLOBAL)
    assert (ep144.num_slots, ep144.num_nodes, ep144.policy) == (288, 18, PlacementPolicy.GLOBAL)
    assert (ep32.num_slots, ep32.num_nodes, ep32.num_groups, ep32.policy) == (
        288, 4, 8, PlacementPolicy.HIERARCHICAL)
    assert default_slots_per_gpu(8, 2) == 5 and default_slots_per_gpu(8, 1) == 8
    assert parse_placement_key(placement_key("m", WorkerRole.PREFILL)) == ("m", WorkerRole.PREFILL)
    assert parse_placement_key("m") == ("m", WorkerRole.DECODE)


# -- the loop ---------------------------------------------------------------------------------


async def test_first_plan_waits_for_enough_tokens_then_reaches_every_worker(tmp_path: Path) -> None:
    h = Harness(tmp_path / "g.db")
    await add_workers(h.backend, 3)
    await h.report(profile_counts(1, num_tokens=500))  # under min_tokens_per_layer
    await h.governor.tick()
    assert (await h.status()).current is None and h.workers.num_calls == 0
    await h.report(profile_counts(1))
    await h.governor.tick()
    status = await h.status()
    assert status.version == 1 and status.current is not None
    assert status.current.reason == ReplanReason.INITIAL
    assert status.is_rolled_out and status.acknowledged == {"d0": 1, "d1": 1, "d2": 1}
    labels = {"deployment": "m", "role": "decode"}
    assert REGISTRY.get_sample_value(
        "pdserve_governor_expert_placement_acknowledged_workers", labels) == 3
    assert 0.0 < REGISTRY.get_sample_value("pdserve_governor_expert_balancedness_ratio",
                                           labels) <= 1.0
    assert set(h.workers.versions.values()) == {1}
    slot_map = status.current.placement.slot_to_expert.reshape(-1).tolist()
    assert all(m == slot_map for m in h.workers.slot_maps.values())
    # Under the skewed loads the plan beats experts in contiguous blocks without copies.
    estimate = h.governor.estimate("m", DECODE)
    assert estimate is not None
    contiguous = ExpertPlacement.from_slot_map(
        np.tile(np.arange(NUM_EXPERTS), (NUM_LAYERS, 1)), NUM_EXPERTS,
        PlacementTopology(NUM_EXPERTS, 2, 1, 1, PlacementPolicy.GLOBAL))
    assert status.balancedness.mean() > gpu_balancedness(contiguous,
                                                         estimate.token_loads).mean()
    # Nothing new: a tick within the period neither re-plans nor calls the workers again.
    num_calls = h.workers.num_calls
    await h.governor.tick()
    assert (await h.status()).version == 1 and h.workers.num_calls == num_calls


async def test_versions_increase_persist_and_survive_a_restart(tmp_path: Path) -> None:
    h = Harness(tmp_path / "g.db")
    await add_workers(h.backend, 2)
    await h.report(profile_counts(1))
    await h.governor.tick()
    assert (await h.status()).version == 1
    # The hot experts change; after the period the migration-aware re-plan issues version 2.
    h.clock.now_s += 3000  # ten half-lives: the old loads are all but forgotten
    await h.report(profile_counts(2))
    await h.governor.tick()
    second = await h.status()
    assert second.version == 2 and second.current is not None
    assert second.current.reason == ReplanReason.PERIOD
    assert 0 < second.current.num_experts_moved < second.current.placement.slot_to_expert.size
    assert second.current.bytes_moved > 0
    assert h.repository is not None
    assert h.repository.latest_expert_placement("m").version == 2
    # A new governor over the same database knows version 2 without any report or tick.
    h.repository = h.open_repository()
    h.governor = h.new_governor()
    restored = await h.status()
    assert restored.version == 2 and restored.current is not None
    assert np.array_equal(restored.current.placement.slot_to_expert,
                          second.current.placement.slot_to_expert)
    # ... and its next version is 3, never a reused one.
    h.clock.now_s += 3000
    await h.report(profile_counts(3))
    await h.governor.tick()
    assert (await h.status()).version == 3
    assert set(h.workers.versions.values()) == {3}


async def test_versions_never_go_below_what_workers_hold(tmp_path: Path) -> None:
    """A lost database must not make the governor re-issue versions workers would ignore."""
    h = Harness(tmp_path / "g.db")
    await add_workers(h.backend, 2)
    h.workers.versions = {"addr0": 7, "addr1": 4}
    await h.report(profile_counts(1))
    await h.governor.tick()
    assert (await h.status()).version == 8
    assert h.workers.versions == {"addr0": 8, "addr1": 8}


async def test_imbalance_triggers_a_replan_before_the_period(tmp_path: Path) -> None:
    h = Harness(tmp_path / "g.db", ExpertPolicy(
        min_tokens_per_layer=1000, replan_period_s=10_000, min_replan_interval_s=60,
        half_life_s=10, min_balancedness=0.9))
    await add_workers(h.backend, 2)
    await h.report(profile_counts(1))
    await h.governor.tick()
    h.clock.now_s += 30  # within the cooldown: no re-plan even though the loads change
    await h.report(profile_counts(5))
    await h.governor.tick()
    status = await h.status()
    assert status.version == 1 and status.balancedness.mean() < 0.9
    h.clock.now_s += 60
    await h.report(profile_counts(5))
    await h.governor.tick()
    status = await h.status()
    assert status.version == 2 and status.current is not None
    assert status.current.reason == ReplanReason.IMBALANCE
    assert status.balancedness.mean() >= 0.9


async def test_rollout_retries_failed_workers_and_reaches_late_and_restarted_ones() -> None:
    h = Harness(None)
    await add_workers(h.backend, 2)
    h.workers.failing = {"addr1"}
    await h.report(profile_counts(1))
    await h.governor.tick()
    status = await h.status()
    assert status.version == 1 and not status.is_rolled_out
    assert status.acknowledged == {"d0": 1} and "unreachable" in status.errors["d1"]
    h.workers.failing.clear()
    await add_workers(h.backend, 1, start=2)  # joins after the plan
    await h.governor.tick()
    status = await h.status()
    assert status.is_rolled_out and status.num_workers == 3 and not status.errors
    assert h.workers.versions == {"addr0": 1, "addr1": 1, "addr2": 1}
    # d0 restarts (registers again, holding nothing): it gets the placement again.
    h.workers.versions.pop("addr0")
    await h.backend.workers.upsert(WorkerRecord("d0", "m", DECODE, WorkerState.READY, "addr0",
                                                spec=MIXTRAL_SPEC, registered_s=2.0), 1e9)
    await h.governor.tick()
    assert h.workers.versions["addr0"] == 1
    # Failed and drained workers are not waited for.
    await h.backend.workers.set_state("d2", WorkerState.DRAINING)
    await h.backend.workers.set_state("d2", WorkerState.DRAINED)
    await h.governor.tick()
    status = await h.status()
    assert status.num_workers == 2 and status.is_rolled_out


async def test_workers_without_a_stored_description_are_asked_for_their_shape() -> None:
    """A store that keeps no description: the shape (2 GPUs of Mixtral) comes from GetStatus."""
    h = Harness(None)
    await add_workers(h.backend, 2, spec=b"")
    await h.report(profile_counts(1))
    await h.governor.tick()
    status = await h.status()
    assert status.is_rolled_out and status.current is not None
    topology = status.current.placement.topology
    assert (topology.num_gpus, topology.num_slots) == (2, 10)


async def test_settings_that_break_a_constraint_are_reported_not_rolled_out() -> None:
    h = Harness(None, ExpertPolicy(min_tokens_per_layer=1000, slots_per_gpu=3))  # 6 < 8 experts
    await add_workers(h.backend, 1)
    await h.report(profile_counts(1))
    await h.governor.tick()
    status = await h.status()
    assert status.current is None and h.workers.num_calls == 0
    assert "num_slots must be >= num_experts" in status.last_error


# -- the pool manager forwards heartbeat counts -----------------------------------------------


async def test_pool_manager_queues_heartbeat_counts_for_the_governor() -> None:
    clock = ManualClock()
    backend = open_backend(None, clock)
    store = MemoryExpertLoadStore()
    manager = PoolManager(PoolPolicy(role=DECODE, join_token="t"), backend, MemoryPrefixIndex(),
                          clock, expert_loads=store)
    await manager.register(Registration("d1", "m", "addr", num_total_blocks=64), "t")
    load = WorkerLoad(num_free_blocks=64, num_total_blocks=64)
    await manager.heartbeat(Heartbeat("d1", WorkerState.LOADING, load,
                                      expert_token_counts=(1, 2, 3, 4), num_moe_layers=2))
    with pytest.raises(InvalidArgumentError, match="multiple of num_moe_layers"):
        await manager.heartbeat(Heartbeat("d1", WorkerState.READY, load,
                                          expert_token_counts=(1, 2, 3), num_moe_layers=2))
    assert (await backend.workers.get("d1")).state is WorkerState.LOADING  # refused whole
    assert await store.pools() == [("m", DECODE)]
    [report] = await store.drain("m", DECODE)
    assert report.worker_id == "d1" and report.matrix().tolist() == [[1, 2], [3, 4]]
    assert await store.drain("m", DECODE) == []
    # By default the manager uses the store beside its backend, which the governor reads too.
    shared = PoolManager(PoolPolicy(role=DECODE, join_token="t"), backend, MemoryPrefixIndex(),
                         clock)
    await shared.heartbeat(Heartbeat("d1", WorkerState.READY, load,
                                     expert_token_counts=(5, 6), num_moe_layers=1))
    assert len(await expert_load_store_for(backend).drain("m", DECODE)) == 1


# -- the service ------------------------------------------------------------------------------


async def test_service_answers_placement_and_refuses_bad_input_naming_the_constraint() -> None:
    clock = ManualClock()
    backend = open_backend(None, clock)
    app = GovernorApp(GovernorSettings(expert_min_tokens_per_layer=1000), backend=backend)
    server = GrpcServer()
    app.register(server)
    port = await server.start()
    await add_workers(backend, 2)
    counts = profile_counts(1)
    await expert_load_store_for(backend).append("m", DECODE, ExpertLoadReport(
        "d0", NUM_LAYERS, counts.reshape(-1)))
    app.experts.client = app.experts.governor._client = FakeWorkers()  # type: ignore[assignment]
    await app.experts.governor.tick()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
            response = await stub.GetExpertPlacement(
                governor_pb2.GetExpertPlacementRequest(deployment="m"), timeout=10)
            placement = response.placement
            assert (placement.version, placement.num_layers, placement.num_experts) == (
                1, NUM_LAYERS, NUM_EXPERTS)
            assert len(placement.slot_to_expert) == NUM_LAYERS * placement.num_slots
            assert placement.num_slots % placement.num_gpus == 0
            assert len(placement.balancedness) == NUM_LAYERS
            none = await stub.GetExpertPlacement(
                governor_pb2.GetExpertPlacementRequest(deployment="m:prefill"), timeout=10)
            assert not none.HasField("placement")
            bad_requests = {
                "deployment: required": governor_pb2.GetExpertPlacementRequest(),
            }
            for message, request in bad_requests.items():
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.GetExpertPlacement(request, timeout=10)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert message in (caught.value.details() or "")
            loads = counts.reshape(-1).astype(float).tolist()
            what_ifs = {
                "num_slots must be a multiple of num_gpus": {"num_slots": 10, "num_gpus": 3},
                "num_gpus must be a multiple of num_nodes": {"num_slots": 12, "num_gpus": 3,
                                                             "num_nodes": 2},
                "num_groups divisible by num_nodes": {
                    "num_slots": 16, "num_gpus": 4, "num_nodes": 2, "num_groups": 3,
                    "policy": governor_pb2.PLACEMENT_POLICY_HIERARCHICAL},
                "num_slots must be >= num_experts": {"num_slots": 6, "num_gpus": 2},
                "unknown placement policy 7": {"num_slots": 10, "num_gpus": 2, "policy": 7},
                "expert_loads must be >= 0": {"num_slots": 10, "num_gpus": 2,
                                              "expert_loads": [-1.0] + loads[1:]},
                "expected num_layers x num_experts": {"num_slots": 10, "num_gpus": 2,
                                                      "expert_loads": loads[:-1]},
            }
            for message, fields in what_ifs.items():
                request = governor_pb2.WhatIfExpertPlacementRequest(
                    num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS,
                    expert_loads=fields.pop("expert_loads", loads), **fields)  # type: ignore[arg-type]
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.WhatIfExpertPlacement(request, timeout=10)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, message
                assert message in (caught.value.details() or ""), caught.value.details()
    finally:
        await server.stop(0)
        await app.close()


# -- the worker side --------------------------------------------------------------------------

MOE_SIM = SimConfig(model="mixtral-8x7b", tp_size=2, max_num_blocks=512, num_kv_layers=2,
                    num_moe_layers=NUM_LAYERS, expert_skew=1.2, expert_seed=3, speedup=1e12)


def clustered_slot_map(popularity: np.ndarray, num_slots: int) -> np.ndarray:
    """A bad placement: per layer the hottest experts together on GPU 0 (no copies of them)."""
    slot_maps = []
    for row in popularity:
        order = np.argsort(-row)
        spare = order[::-1][: num_slots - len(row)]  # extra copies of the coldest experts
        slot_maps.append(np.concatenate([order, spare]))
    return np.array(slot_maps)


def mean_step_s(engine: SimEngine, num_steps: int = 20, batch: int = 64) -> float:
    seqs = [Sequence(str(i), [7] * 200, 10_000) for i in range(batch)]
    total = 0.0
    for _ in range(num_steps):
        engine.decode_step(seqs)
        total += engine.last_step_s
    return total / num_steps


def test_sim_decode_step_is_slower_under_a_worse_placement() -> None:
    popularity = expert_popularity(NUM_LAYERS, NUM_EXPERTS, MOE_SIM.expert_skew,
                                   MOE_SIM.expert_seed)
    topology = PlacementTopology(10, 2, 1, 1, PlacementPolicy.GLOBAL)
    good = plan_expert_placement(popularity, topology).slot_to_expert
    bad = clustered_slot_map(popularity, 10)
    times = {}
    for name, slot_map in (("good", good), ("bad", bad)):
        engine = SimEngine(MOE_SIM)  # same seed: the same routing draws for both
        engine.install_expert_placement(slot_map)
        times[name] = mean_step_s(engine)
        counts = engine.take_expert_token_counts()
        # Every token picks num_experts_per_token experts in every MoE layer, every step.
        assert (counts.sum(axis=1) == 20 * 64 * engine.model.num_experts_per_token).all()
    dense_s = SimEngine(MOE_SIM).perf.decode_step_time_s(64, 64 * 201)
    assert times["bad"] > times["good"] >= dense_s


async def test_agent_validates_and_installs_placements_and_reports_counts() -> None:
    engine = SimEngine(MOE_SIM)
    agent = create_agent(AgentConfig("d1", "m", WorkerRole.DECODE, transport="inproc"), engine,
                         get_backend("inproc"))
    slot_map = plan_expert_placement(np.ones((NUM_LAYERS, NUM_EXPERTS)),
                                     PlacementTopology(10, 2, 1, 1, PlacementPolicy.GLOBAL))
    flat = slot_map.slot_to_expert.reshape(-1).tolist()
    with pytest.raises(InvalidArgumentError, match="MoE layers"):
        agent.apply_expert_placement(1, NUM_LAYERS - 1, 10, flat[:-10])
    with pytest.raises(InvalidArgumentError, match="multiple of the instance's 2 GPUs"):
        agent.apply_expert_placement(1, NUM_LAYERS, 9, flat[: NUM_LAYERS * 9])
    no_expert_7 = [e if e != 7 else 0 for e in flat]
    with pytest.raises(InvalidArgumentError, match="leaves an expert without a slot"):
        agent.apply_expert_placement(1, NUM_LAYERS, 10, no_expert_7)
    assert agent.expert_placement_version == 0
    before = engine._gpu_share
    assert agent.apply_expert_placement(1, NUM_LAYERS, 10, flat) == len(flat)
    assert agent.expert_placement_version == 1 and engine._gpu_share is not before
    assert agent.apply_expert_placement(1, NUM_LAYERS, 10, flat) == 0  # a retry changes nothing
    assert agent.take_expert_token_counts() == (0, [])  # nothing routed yet
    engine.decode_step([Sequence("s", [1, 2, 3], 5)])
    num_layers, counts = agent.take_expert_token_counts()
    assert num_layers == NUM_LAYERS and sum(counts) == NUM_LAYERS * 2
    await agent.close()


def test_dense_sim_engine_has_no_experts() -> None:
    engine = SimEngine(SimConfig(max_num_blocks=64, num_kv_layers=2, speedup=1e12))
    engine.decode_step([Sequence("s", [1, 2, 3], 5)])
    assert engine.num_moe_layers == 0 and engine.take_expert_token_counts().size == 0
    assert engine.last_step_s == engine.perf.decode_step_time_s(1, 3)


# -- pdserve experts --------------------------------------------------------------------------


def experts_args(*words: str):  # type: ignore[no-untyped-def]
    import argparse

    from pdserve.cli import experts as experts_cli

    parser = argparse.ArgumentParser()
    experts_cli.add_arguments(parser)
    return parser.parse_args(list(words))


def write_loads(path: Path, matrices: dict[str, np.ndarray]) -> Path:
    import gzip
    import json

    with gzip.open(path, "wt") as handle:
        json.dump({key: m.tolist() for key, m in matrices.items()}, handle)
    return path


def balancedness_line(output: str, label: str) -> float:
    line = next(x for x in output.splitlines() if x.strip().startswith(f"{label}:"))
    return float(line.split("balancedness mean ")[1].split(",")[0])


def test_experts_cli_compares_baseline_and_ours_from_a_load_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli import experts as experts_cli

    counts = np.random.default_rng(0).multinomial(
        100_000, expert_popularity(4, 256, 1.0, seed=0))
    loads = write_loads(tmp_path / "loads.json.gz", {"small": counts})
    png = tmp_path / "heat.png"
    assert experts_cli.run(experts_args("--loads", str(loads), "--key", "small", "--config",
                                        "ep32", "--png", str(png), "--max-rows", "5")) == 0
    output = capsys.readouterr().out
    assert "small on ep32 (hierarchical, 288 slots on 32 GPUs, 4 nodes)" in output
    assert balancedness_line(output, "ours") >= balancedness_line(output, "baseline")
    table = output.split("baseline_mean")[1].splitlines()[2:7]
    assert len(table) == 5 and "27 lighter GPUs not shown" in output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(InvalidArgumentError, match="holds small"):
        experts_cli.run(experts_args("--loads", str(loads), "--key", "other", "--png", "-"))
    with pytest.raises(InvalidArgumentError, match="no such file"):
        experts_cli.run(experts_args("--loads", str(tmp_path / "missing.json"), "--png", "-"))


async def test_experts_cli_live_shows_the_placement_in_force_and_a_proposal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli import experts as experts_cli

    backend = open_backend(None, ManualClock())
    app = GovernorApp(GovernorSettings(expert_min_tokens_per_layer=1000), backend=backend)
    app.experts.governor._client = FakeWorkers()  # type: ignore[assignment]
    server = GrpcServer()
    app.register(server)
    port = await server.start()
    try:
        await add_workers(backend, 2)
        await expert_load_store_for(backend).append("m", DECODE, ExpertLoadReport(
            "d0", NUM_LAYERS, profile_counts(1).reshape(-1)))
        await app.experts.governor.tick()
        loads = write_loads(tmp_path / "now.json.gz", {"now": profile_counts(9)})
        png = tmp_path / "live.png"
        address = f"127.0.0.1:{port}"
        code = await asyncio.to_thread(experts_cli.run, experts_args(
            "live", "--address", address, "--deployment", "m", "--loads", str(loads), "--key",
            "now", "--png", str(png)))
        output = capsys.readouterr().out
        assert code == 0
        assert "m: expert placement v1, 4 MoE layers x 10 slots on 2 GPUs" in output
        # The placement in force was made for other loads; the governor's proposal for these
        # loads balances them at least as well.
        assert balancedness_line(output, "proposed") >= balancedness_line(output, "v1")
        assert png.is_file()
        code = await asyncio.to_thread(experts_cli.run, experts_args(
            "live", "--address", address, "--deployment", "m:prefill"))
        assert code == 0 and "no expert placement yet" in capsys.readouterr().out
    finally:
        await server.stop(0)
        await app.close()
