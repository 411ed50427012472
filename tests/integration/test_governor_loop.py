"""The governor's live loop on real Redis and Postgres: observe (worker records and the tickets
the router opened), decide, record in Postgres, actuate through a recorded "set target"; and the
autoscaler RPCs over real gRPC.

Redis keys carry a random prefix; Postgres gets a fresh schema per test, migrated to head. The
clock is injected (a ``ManualClock`` shared by the store and the governor): no sleeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np
import pytest
from helpers.private_schema import private_schema_repository

from pdserve.api.v1 import common_pb2, governor_pb2, governor_pb2_grpc
from pdserve.capacity.controls import AutoscalerControls
from pdserve.capacity.plan_inputs import Slo
from pdserve.capacity.sizing import InstanceProfile
from pdserve.common.clock import ManualClock
from pdserve.common.errors import InvalidArgumentError
from pdserve.common.grpc_client import error_from_rpc_error
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.types import TicketSpec, WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.db import Repository
from pdserve.db.records import ScalingAction
from pdserve.governor.autoscaling import (
    CONTROLS_KEY,
    CapacityGovernor,
    DeploymentSpec,
    GovernorConfig,
    LivePlanConfig,
)
from pdserve.governor.servicer import SERVICE_NAME, CapacityGovernorServicer
from pdserve.state.factory import StateOptions, open_backend
from pdserve.state.interfaces import StateBackend

DEPLOYMENT = "llama-3.1-70b"
INTERVAL_S = 60.0
START_S = 1_750_000_000.0  # the store and the governor share this wall clock
PROFILE = InstanceProfile.from_catalog(DEPLOYMENT, "h100-sxm-80gb", prefill_tp_size=4,
                                       decode_tp_size=4)


class TargetRecorder:
    """A ``TargetSetter`` that remembers every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, WorkerRole, int]] = []

    async def set_target(self, deployment: str, role: WorkerRole, num_workers: int) -> None:
        self.calls.append((deployment, role, num_workers))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_S)


@pytest.fixture
async def backend(redis_url: str, clock: ManualClock) -> AsyncIterator[StateBackend]:
    options = StateOptions(key_prefix=f"pdgov-{uuid.uuid4().hex[:12]}")
    store = open_backend(redis_url, clock, options)
    try:
        yield store
    finally:
        client = store.client  # type: ignore[attr-defined]
        async for key in client.scan_iter(match=f"{options.key_prefix}:*"):
            await client.delete(key)
        await store.close()


@pytest.fixture
def repository(database_url: str) -> Iterator[Repository]:
    with private_schema_repository(database_url, "pdserve_gov") as repo:
        yield repo


async def _add_workers(backend: StateBackend, num_prefill: int, num_decode: int,
                       num_loading: int = 0) -> None:
    for i in range(num_prefill):
        await backend.workers.upsert(WorkerRecord(
            worker_id=f"p{i}", deployment=DEPLOYMENT, role=WorkerRole.PREFILL,
            state=WorkerState.READY, address=f"127.0.0.1:{7000 + i}",
            load=WorkerLoad(num_queued_prefill_tokens=2048 if i == 0 else 0)), 3600.0)
    for i in range(num_decode):
        await backend.workers.upsert(WorkerRecord(
            worker_id=f"d{i}", deployment=DEPLOYMENT, role=WorkerRole.DECODE,
            state=WorkerState.READY, address=f"127.0.0.1:{8000 + i}",
            load=WorkerLoad(num_running_seqs=40, num_free_blocks=20_000,
                            num_total_blocks=29_688)), 3600.0)
        await backend.tickets.set_capacity(f"d{i}", 29_688)
    for i in range(num_loading):
        await backend.workers.upsert(WorkerRecord(
            worker_id=f"d-loading{i}", deployment=DEPLOYMENT, role=WorkerRole.DECODE,
            state=WorkerState.LOADING, address=f"127.0.0.1:{9000 + i}"), 3600.0)


async def _requests(backend: StateBackend, clock: ManualClock, num: int,
                    prompt_tokens: int = 1000) -> None:
    """``num`` requests over the next interval as the router opens them: a ticket each (one
    with a retry); the clock ends one interval later."""
    clock.advance(1.0)
    for i in range(num):
        request_id = uuid.uuid4().hex
        attempts = 2 if i == 0 else 1
        for _ in range(attempts):
            await backend.tickets.open(TicketSpec(
                deployment=DEPLOYMENT, decode_worker_id="d0", prefill_worker_id="p0",
                num_blocks=1, lease_s=600.0, request_id=request_id,
                num_prompt_tokens=prompt_tokens))
    clock.advance(INTERVAL_S - 1.0)


def _governor(backend: StateBackend, repository: Repository, clock: ManualClock,
              setter: TargetRecorder | None, controls: AutoscalerControls | None = None,
              live_plan: LivePlanConfig | None = None) -> CapacityGovernor:
    spec = DeploymentSpec(name=DEPLOYMENT, model=DEPLOYMENT, gpu="h100-sxm-80gb",
                          profile=PROFILE, cold_start_s=600.0, tp_size=4)
    return CapacityGovernor([spec], backend, clock=clock, target_setter=setter,
                            repository=repository, config=GovernorConfig(interval_s=INTERVAL_S),
                            controls=controls, live_plan=live_plan)


async def test_decisions_are_recorded_with_inputs_and_actuated(
        backend: StateBackend, repository: Repository, clock: ManualClock) -> None:
    await _add_workers(backend, num_prefill=1, num_decode=1, num_loading=1)
    setter = TargetRecorder()
    governor = _governor(backend, repository, clock, setter)
    await _requests(backend, clock, 90, prompt_tokens=8000)  # the retry is the same request
    decisions = await governor.step()
    decision = decisions[DEPLOYMENT]

    stored = repository.list_scaling_decisions(DEPLOYMENT)
    assert {r.role for r in stored} == {WorkerRole.PREFILL, WorkerRole.DECODE}
    by_role = {r.role: r for r in stored}
    prefill, decode = by_role[WorkerRole.PREFILL], by_role[WorkerRole.DECODE]
    assert prefill.num_target_instances == decision.num_prefill
    assert decode.num_target_instances == decision.num_decode
    assert prefill.num_current_instances == 1 and decode.num_current_instances == 2
    assert not prefill.is_dry_run
    assert prefill.inputs["observed_rate_per_s"] == pytest.approx(90 / INTERVAL_S)
    assert prefill.inputs["mean_prompt_tokens"] == pytest.approx(8000)
    assert prefill.inputs["prefill_queued_tokens"] == 2048
    assert prefill.inputs["decode_utilization"] == pytest.approx(1 - 20_000 / 29_688)
    assert prefill.forecast["forecast_lead_s"] == 660.0
    assert prefill.forecast["forecast_rate_per_s"] >= 90 / INTERVAL_S
    assert "headroom_per_s" in prefill.forecast
    assert prefill.at is not None and prefill.at.timestamp() == pytest.approx(START_S + INTERVAL_S)
    # 1.5 req/s of 8,000-token prompts needs more than the one prefill instance.
    assert decision.num_prefill > 1 and prefill.action is ScalingAction.SCALE_UP
    assert sorted(setter.calls) == sorted([
        (DEPLOYMENT, WorkerRole.PREFILL, decision.num_prefill),
        (DEPLOYMENT, WorkerRole.DECODE, decision.num_decode)])

    # Next interval: only the new tickets count.
    await _requests(backend, clock, 30)
    await governor.step()
    latest = repository.list_scaling_decisions(DEPLOYMENT, 1, role=WorkerRole.PREFILL)[0]
    assert latest.inputs["observed_rate_per_s"] == pytest.approx(30 / INTERVAL_S)


async def test_the_prompt_lengths_moments_come_from_the_tickets(
        backend: StateBackend, repository: Repository, clock: ManualClock) -> None:
    await _add_workers(backend, num_prefill=1, num_decode=1)
    governor = _governor(backend, repository, clock, None)
    prompts = [1_000, 4_000, 16_000] * 10
    clock.advance(1.0)
    for prompt in prompts:
        await backend.tickets.open(TicketSpec(
            deployment=DEPLOYMENT, decode_worker_id="d0", prefill_worker_id="p0", num_blocks=1,
            lease_s=600.0, request_id=uuid.uuid4().hex, num_prompt_tokens=prompt))
    clock.advance(INTERVAL_S - 1.0)
    await governor.step()
    (decode,) = repository.list_scaling_decisions(DEPLOYMENT, 1, role=WorkerRole.DECODE)
    lengths = np.asarray(prompts, dtype=np.float64)
    assert decode.inputs["mean_prompt_tokens"] == pytest.approx(lengths.mean())
    assert decode.inputs["mean_squared_prompt_tokens"] == pytest.approx(np.mean(lengths ** 2))
    assert decode.inputs["mean_cubed_prompt_tokens"] == pytest.approx(np.mean(lengths ** 3))
    # Output lengths are not in the store: their spread is unknown (0), not made up.
    assert decode.inputs["mean_squared_output_tokens"] == 0.0
    assert decode.inputs["mean_prompt_output_tokens"] == 0.0


async def test_dry_run_records_but_does_not_actuate(
        backend: StateBackend, repository: Repository, clock: ManualClock) -> None:
    await _add_workers(backend, num_prefill=1, num_decode=1)
    setter = TargetRecorder()
    governor = _governor(backend, repository, clock, setter,
                         AutoscalerControls(is_dry_run=True))
    for _ in range(3):
        await _requests(backend, clock, 120, prompt_tokens=8000)
        await governor.step()
    assert setter.calls == []
    stored = repository.list_scaling_decisions(DEPLOYMENT)
    assert len(stored) == 6
    assert all(r.is_dry_run for r in stored)
    assert any(r.action is ScalingAction.SCALE_UP for r in stored)  # a recommendation, unacted
    assert await backend.targets.get_target(DEPLOYMENT, WorkerRole.PREFILL) is None


@pytest.fixture
async def served(backend: StateBackend, repository: Repository,
                 clock: ManualClock) -> AsyncIterator[tuple[CapacityGovernor, grpc.aio.Channel]]:
    await _add_workers(backend, num_prefill=2, num_decode=2)
    governor = _governor(backend, repository, clock, TargetRecorder())
    server = GrpcServer(host="127.0.0.1", port=0)
    server.add_servicer(SERVICE_NAME,
                        governor_pb2_grpc.add_CapacityGovernorServiceServicer_to_server,
                        CapacityGovernorServicer(governor, clock))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield governor, channel
    finally:
        await channel.close()
        await server.stop(0)


async def test_list_decisions_over_grpc_newest_first(
        served: tuple[CapacityGovernor, grpc.aio.Channel], backend: StateBackend,
        clock: ManualClock) -> None:
    governor, channel = served
    stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
    for num in (10, 60, 200):
        await _requests(backend, clock, num)
        await governor.step()
    response = await stub.ListDecisions(
        governor_pb2.ListDecisionsRequest(deployment=DEPLOYMENT), timeout=10)
    times = [d.decided_unix_ms for d in response.decisions]
    assert len(times) == 6 and times == sorted(times, reverse=True)
    newest = response.decisions[0]
    inputs = json.loads(newest.inputs_json)
    assert inputs["observed_rate_per_s"] == pytest.approx(200 / INTERVAL_S)
    assert "forecast_rate_per_s" in inputs["forecast"]
    assert newest.decided_unix_ms == int((START_S + 3 * INTERVAL_S) * 1000)
    only_decode = await stub.ListDecisions(governor_pb2.ListDecisionsRequest(
        deployment=DEPLOYMENT, role=common_pb2.WORKER_ROLE_DECODE, limit=2), timeout=10)
    assert [d.role for d in only_decode.decisions] == [common_pb2.WORKER_ROLE_DECODE] * 2
    plan = (await stub.GetPlan(governor_pb2.GetPlanRequest(deployment=DEPLOYMENT),
                               timeout=10)).plan
    assert (
        plan.num_prefill_instances
        == [d for d in response.decisions if d.role == common_pb2.WORKER_ROLE_PREFILL][
            0
        ].target_instances
    )
    assert plan.num_gpus == 4 * (plan.num_prefill_instances + plan.num_decode_instances)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ListDecisions(governor_pb2.ListDecisionsRequest(deployment="nope"), timeout=10)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("request_kwargs, field_name", [
    ({"prefill_bounds": governor_pb2.PoolBounds(min_instances=5, max_instances=3)},
     "prefill_bounds.max_instances"),
    ({"override_decode_instances": 3}, "override_expires_in_s"),
    ({"override_expires_in_s": 60.0}, "override_expires_in_s"),
    ({"override_prefill_instances": 50, "override_expires_in_s": 60.0,
      "prefill_bounds": governor_pb2.PoolBounds(min_instances=1, max_instances=10)},
     "override_prefill_instances"),
    ({"max_gpus": 4}, "max_gpus"),  # below the 2 x TP4 the pools' minimums need
    ({"deployment": ""}, "deployment"),
])
async def test_set_controls_names_the_bad_field(
        served: tuple[CapacityGovernor, grpc.aio.Channel], request_kwargs: dict[str, object],
        field_name: str) -> None:
    _, channel = served
    stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
    request = governor_pb2.SetAutoscalerControlsRequest(**{"deployment": DEPLOYMENT,
                                                           **request_kwargs})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SetAutoscalerControls(request, timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    error = error_from_rpc_error(info.value)
    assert isinstance(error, InvalidArgumentError) and error.field == field_name


async def test_set_controls_applies_and_persists(
        served: tuple[CapacityGovernor, grpc.aio.Channel], repository: Repository,
        backend: StateBackend, clock: ManualClock) -> None:
    governor, channel = served
    stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
    await stub.SetAutoscalerControls(governor_pb2.SetAutoscalerControlsRequest(
        deployment=DEPLOYMENT, is_frozen=True, override_decode_instances=6,
        override_expires_in_s=120.0, max_step_per_minute=2,
        prefill_bounds=governor_pb2.PoolBounds(min_instances=2)), timeout=10)
    controls = governor.controls(DEPLOYMENT)
    assert controls.is_frozen and controls.max_step_per_minute == 2
    assert controls.prefill_bounds.min_instances == 2
    assert controls.override_until_s == START_S + 120.0
    record = repository.get_deployment(DEPLOYMENT)
    assert record is not None
    assert AutoscalerControls.from_dict(record.config[CONTROLS_KEY]) == controls

    await _requests(backend, clock, 300)
    decision = (await governor.step())[DEPLOYMENT]
    assert decision.num_decode == 6  # the override
    assert decision.num_prefill == 2  # frozen where it was (2 ready)

    # A fresh governor (a restart) takes the stored controls up.
    restarted = _governor(backend, repository, clock, TargetRecorder())
    await restarted.load_controls()
    assert restarted.controls(DEPLOYMENT) == controls


async def test_what_if_plan_runs_the_planner(
        served: tuple[CapacityGovernor, grpc.aio.Channel]) -> None:
    _, channel = served
    stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
    demand = governor_pb2.Demand(
        arrival_rate_per_s=20.0, prompt=governor_pb2.LengthDistribution(mean_tokens=1155),
        output=governor_pb2.LengthDistribution(mean_tokens=211))
    slo = governor_pb2.Slo(ttft_ms=2000, tpot_ms=100, percentile=90)
    request = governor_pb2.WhatIfPlanRequest(model=DEPLOYMENT, gpu="h100-sxm-80gb",
                                             prefill_tp_size=4, decode_tp_size=4,
                                             demand=demand, slo=slo)
    plan = (await stub.WhatIfPlan(request, timeout=60)).plan
    assert plan.num_prefill_instances >= 1 and plan.num_decode_instances >= 1
    assert plan.num_gpus == 4 * (plan.num_prefill_instances + plan.num_decode_instances)
    assert 0 < plan.predicted_ttft_ms <= 2000 and 0 < plan.predicted_tpot_ms <= 100
    assert plan.goodput_per_gpu > 0 and plan.demand == demand
    doubled = governor_pb2.WhatIfPlanRequest()
    doubled.CopyFrom(request)
    doubled.demand.arrival_rate_per_s = 40.0
    bigger = (await stub.WhatIfPlan(doubled, timeout=60)).plan
    assert bigger.num_gpus > plan.num_gpus
    for field_name, broken in (("slo", {"slo": None}),
                               ("demand.arrival_rate_per_s", {"rate": 0.0}),
                               ("slo.tpot_ms", {"tpot": 0.0})):
        bad = governor_pb2.WhatIfPlanRequest()
        bad.CopyFrom(request)
        if "slo" in broken:
            bad.ClearField("slo")
        if "rate" in broken:
            bad.demand.arrival_rate_per_s = broken["rate"]
        if "tpot" in broken:
            bad.slo.tpot_ms = broken["tpot"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.WhatIfPlan(bad, timeout=60)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert error_from_rpc_error(info.value).field == field_name


async def _bursty_requests(backend: StateBackend, clock: ManualClock, duration_s: float,
                           base_rate_per_s: float, seed: int = 0) -> int:
    """Requests as the router opens them, Poisson at ``base_rate_per_s`` and four times that
    for the first 20 s of every 120 s, each at its own time on the clock (the first one
    retried); returns the number of requests."""
    rng = np.random.default_rng(seed)
    gaps: list[float] = []
    at_s = 0.0
    while at_s < duration_s:
        rate = (4.0 if at_s % 120.0 < 20.0 else 1.0) * base_rate_per_s
        gap = float(rng.exponential(1.0 / rate))
        gaps.append(gap)
        at_s += gap
    for i, gap in enumerate(gaps):
        clock.advance(gap)
        request_id = uuid.uuid4().hex
        for _ in range(2 if i == 0 else 1):
            await backend.tickets.open(TicketSpec(
                deployment=DEPLOYMENT, decode_worker_id="d0", prefill_worker_id="p0",
                num_blocks=1, lease_s=600.0, request_id=request_id,
                num_prompt_tokens=int(rng.integers(500, 3000))))
    return len(gaps)


async def test_the_governor_plans_its_observed_window_by_replay(
        backend: StateBackend, repository: Repository, clock: ManualClock,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The live loop's plan by replay: the requests of the window, planned and replayed,
    recorded in Postgres, reported by GetPlan beside the autoscaler's plan (also after a
    restart, from the durable store) and printed by ``pdserve governor plan``."""
    await _add_workers(backend, num_prefill=2, num_decode=2)
    live = LivePlanConfig(Slo(2.0, 0.1, 90.0), window_s=300.0)
    assert await _governor(backend, repository, clock, None).plan_step() == {}
    governor = _governor(backend, repository, clock, TargetRecorder(), live_plan=live)
    assert await governor.plan_step() == {}  # nothing observed yet
    started_s = clock()
    num_requests = await _bursty_requests(backend, clock, 240.0, base_rate_per_s=2.0)
    await governor.step()
    record = (await governor.plan_step())[DEPLOYMENT]
    assert record.outputs["is_met"] is True
    assert record.outputs["replayed_attainment"] >= 0.9
    assert record.inputs["num_requests"] == num_requests  # the retry is the same request
    assert record.inputs["window_start_unix_s"] == pytest.approx(clock() - 300.0)
    assert record.inputs["arrival_rate_per_s"] == pytest.approx(
        num_requests / (clock() - started_s), rel=0.05)
    stored = repository.latest_capacity_plan(DEPLOYMENT)
    assert stored is not None and stored.outputs == record.outputs

    server = GrpcServer(host="127.0.0.1", port=0)
    server.add_servicer(SERVICE_NAME,
                        governor_pb2_grpc.add_CapacityGovernorServiceServicer_to_server,
                        CapacityGovernorServicer(governor, clock))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
            response = await stub.GetPlan(governor_pb2.GetPlanRequest(deployment=DEPLOYMENT),
                                          timeout=10)
        assert response.HasField("plan") and response.HasField("replayed_plan")
        replayed = response.replayed_plan
        assert (replayed.num_prefill_instances, replayed.num_decode_instances) == (
            record.num_prefill_instances, record.num_decode_instances)
        assert replayed.num_gpus == 4 * (replayed.num_prefill_instances
                                         + replayed.num_decode_instances)
        assert replayed.prefill_tp_size == replayed.decode_tp_size == 4
        assert replayed.replayed_attainment == pytest.approx(
            record.outputs["replayed_attainment"])
        assert replayed.predicted_attainment == pytest.approx(
            record.outputs["predicted_attainment"])
        assert replayed.num_requests == num_requests
        assert replayed.slo.ttft_ms == 2000.0 and replayed.slo.percentile == 90.0
        assert response.plan.prefill_tp_size == 4 and response.plan.replayed_attainment == 0.0

        from pdserve.cli.main import main as cli_main

        code = await asyncio.to_thread(cli_main, [
            "governor", "plan", "--address", f"127.0.0.1:{port}", "--deployment", DEPLOYMENT,
            "--json"])
        shown = json.loads(capsys.readouterr().out)
        assert code == 0 and shown["replayed"]["num_requests"] == num_requests
        assert shown["replayed"]["replayed_attainment"] == replayed.replayed_attainment
        assert shown["autoscaler"]["prefill"]["instances"] == response.plan.num_prefill_instances
    finally:
        await server.stop(0)

    # A restarted governor reports the stored plan until it makes its own.
    restarted = _governor(backend, repository, clock, None, live_plan=live)
    again = await restarted.latest_replayed_plan(DEPLOYMENT)
    assert again is not None and again.outputs == record.outputs
    # The live loop makes them on its own period (the autoscaling passes' is an hour here).
    looping = CapacityGovernor([restarted.spec(DEPLOYMENT)], backend, clock=clock,
                               config=GovernorConfig(interval_s=3600.0),
                               live_plan=dataclasses.replace(live, interval_s=0.01))
    stop = asyncio.Event()
    task = asyncio.create_task(looping.run(stop))
    try:
        async with asyncio.timeout(120):
            while (made := await looping.latest_replayed_plan(DEPLOYMENT)) is None:
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    assert made.inputs["num_requests"] == num_requests
    # A window with too few requests makes no plan; the last one stands.
    clock.advance(400.0)
    assert await governor.plan_step() == {}
    assert await governor.latest_replayed_plan(DEPLOYMENT) == record
