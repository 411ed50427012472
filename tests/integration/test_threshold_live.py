"""Conditional disaggregation, live, on real Redis and Postgres: the governor's pass computes the
local-prefill threshold from the interval's tickets and the pools, records the decision with its
inputs in Postgres and publishes it; a running router (its own store client, no restart) routes
by it after its next refresh; an operator's pin over gRPC (admin-only) and the unpin do the same.

Redis keys carry a random prefix; Postgres gets a fresh schema per test. The clock is injected;
the router's refresh is called, not waited for.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from helpers.private_schema import private_schema_repository

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import governor_pb2, governor_pb2_grpc
from pdserve.capacity.plan_inputs import Demand, Slo
from pdserve.capacity.sizing import InstanceProfile
from pdserve.common.clock import ManualClock
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.types import (
    ThresholdSource,
    TicketSpec,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)
from pdserve.db import Repository
from pdserve.governor.autoscaling import (
    CapacityGovernor,
    DeploymentSpec,
    GovernorConfig,
    deployment_ref,
)
from pdserve.governor.servicer import SERVICE_NAME, CapacityGovernorServicer
from pdserve.governor.thresholds import PIN_KEY, ThresholdConfig, ThresholdGovernor
from pdserve.router.core import Router, RouterConfig
from pdserve.router.policy import RoutingConfig
from pdserve.router.pool_view import PoolView
from pdserve.router.thresholds import PublishedThresholds
from pdserve.router.types import GenerationRequest
from pdserve.state.factory import StateOptions, open_backend
from pdserve.state.interfaces import StateBackend

DEPLOYMENT = "llama-3.1-8b"
GPU = "h100-sxm-80gb"
INTERVAL_S = 60.0
START_S = 1_750_000_000.0
SETTING_TOKENS = 1000
"""The router's own threshold: not a multiple of 16, so never one the planner computes."""
PIN_TOKENS = 3000


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_S)


@pytest.fixture
def options() -> StateOptions:
    return StateOptions(key_prefix=f"pdlpt-{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def backend(redis_url: str, clock: ManualClock,
                  options: StateOptions) -> AsyncIterator[StateBackend]:
    store = open_backend(redis_url, clock, options)
    try:
        yield store
    finally:
        client = store.client  # type: ignore[attr-defined]
        async for key in client.scan_iter(match=f"{options.key_prefix}:*"):
            await client.delete(key)
        await store.close()


@pytest.fixture
async def router_backend(redis_url: str, options: StateOptions) -> AsyncIterator[StateBackend]:
    """The router replica's own connection to the same store."""
    store = open_backend(redis_url, ManualClock(START_S), options)
    yield store
    await store.close()


@pytest.fixture
def repository(database_url: str) -> Iterator[Repository]:
    with private_schema_repository(database_url, "pdserve_lpt") as repo:
        yield repo


def _worker(worker_id: str, role: WorkerRole) -> WorkerRecord:
    info = pb.WorkerInfo(worker_id=worker_id, kv_layout=pb.KvLayout(
        num_layers=2, num_blocks=29_688, block_size_tokens=16, block_nbytes=64))
    return WorkerRecord(
        worker_id=worker_id, deployment=DEPLOYMENT, role=role, state=WorkerState.READY,
        address=f"{worker_id}:1", spec=info.SerializeToString(),
        load=WorkerLoad(num_running_seqs=8 if role is WorkerRole.DECODE else 0,
                        num_free_blocks=20_000, num_total_blocks=29_688))


async def _add_workers(backend: StateBackend) -> None:
    for worker_id, role in (("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)):
        await backend.workers.upsert(_worker(worker_id, role), 3600.0)
    await backend.tickets.set_capacity("d0", 29_688)


async def _interval_of_requests(backend: StateBackend, clock: ManualClock) -> list[int]:
    """5 requests per second for one interval, exponential prompts of mean 2,000 tokens: a
    busy prefill instance, where some local prefill pays (``test_local_prefill_threshold``)."""
    prompts = list(Demand.from_means(5.0, 2000.0, 8.0, num_points=int(5 * INTERVAL_S))
                   .prompt_tokens)
    clock.advance(1.0)
    for prompt in prompts:
        await backend.tickets.open(TicketSpec(
            deployment=DEPLOYMENT, decode_worker_id="d0", prefill_worker_id="p0", num_blocks=1,
            lease_s=600.0, request_id=uuid.uuid4().hex, num_prompt_tokens=prompt))
    clock.advance(INTERVAL_S - 1.0)
    return prompts


def _governor(backend: StateBackend, repository: Repository,
              clock: ManualClock) -> CapacityGovernor:
    profile = InstanceProfile.from_catalog(DEPLOYMENT, GPU, prefill_tp_size=1, decode_tp_size=1)
    spec = DeploymentSpec(name=DEPLOYMENT, model=DEPLOYMENT, gpu=GPU, profile=profile,
                          cold_start_s=600.0)
    thresholds = ThresholdGovernor(backend, ThresholdConfig(Slo(2.0, 0.1)), clock=clock,
                                   repository=repository)
    return CapacityGovernor([spec], backend, clock=clock, repository=repository,
                            config=GovernorConfig(interval_s=INTERVAL_S), thresholds=thresholds)


def _router(router_backend: StateBackend) -> Router:
    view = PoolView()
    view.replace(DEPLOYMENT, [_worker("d0", WorkerRole.DECODE), _worker("p0", WorkerRole.PREFILL)])
    config = RouterConfig(routing=RoutingConfig(local_prefill_threshold_tokens=SETTING_TOKENS))
    return Router(config, view, tickets=None, workers=None,  # type: ignore[arg-type]
                  thresholds=PublishedThresholds(router_backend.thresholds, config.routing))


async def _is_local(router: Router, num_prompt_tokens: int) -> bool:
    """The live router's decision for a prompt (the decode worker has nothing cached)."""
    request = GenerationRequest(request_id=uuid.uuid4().hex, model=DEPLOYMENT,
                                prompt_token_ids=tuple(range(num_prompt_tokens)), max_tokens=8)
    return (await router._route(request, frozenset())).is_local_prefill


def _telling_lengths(threshold: int) -> list[int]:
    """Prompt lengths the published threshold and the router's setting decide differently."""
    low, high = sorted((threshold, SETTING_TOKENS))
    return [low + 1, high]


async def _decisions_follow(router: Router, threshold: int) -> None:
    for length in _telling_lengths(threshold):
        assert await _is_local(router, length) is (length <= threshold), (length, threshold)


async def test_a_published_threshold_changes_the_live_routers_decisions(
        backend: StateBackend, router_backend: StateBackend, repository: Repository,
        clock: ManualClock) -> None:
    await _add_workers(backend)
    router = _router(router_backend)
    assert router.thresholds is not None
    await router.thresholds.start()
    try:
        for length in _telling_lengths(0):  # nothing published: the setting decides
            assert await _is_local(router, length) is (length <= SETTING_TOKENS)

        governor = _governor(backend, repository, clock)
        prompts = await _interval_of_requests(backend, clock)
        await governor.step()

        # Recorded in Postgres with its inputs, and published.
        [record] = repository.list_threshold_decisions(DEPLOYMENT)
        assert record.source is ThresholdSource.COMPUTED and record.is_published
        assert record.computed_tokens == record.threshold_tokens and record.version == 1
        assert record.threshold_tokens % 16 == 0 and record.threshold_tokens != SETTING_TOKENS
        inputs = record.inputs
        assert inputs["arrival_rate_per_s"] == pytest.approx(len(prompts) / INTERVAL_S)
        assert inputs["num_requests"] == len(prompts)
        assert inputs["prompt_tokens_p50"] == sorted(prompts)[len(prompts) // 2]
        assert inputs["mean_prompt_tokens"] == pytest.approx(sum(prompts) / len(prompts))
        assert (inputs["num_prefill_ready"], inputs["num_decode_ready"]) == (1, 1)
        assert inputs["slo_ttft_ms"] == 2000.0 and inputs["mean_output_tokens"] > 0
        assert record.at is not None and record.at.timestamp() == pytest.approx(clock())
        published = await backend.thresholds.get(DEPLOYMENT)
        assert published is not None and published.threshold_tokens == record.threshold_tokens

        # The running router follows it on its next refresh.
        computed = record.threshold_tokens
        await router.thresholds.refresh()
        await _decisions_follow(router, computed)

        # The same demand again: recorded again; published only if the value moved (the
        # output-length estimate is smoothed over passes).
        await _interval_of_requests(backend, clock)
        await governor.step()
        second = repository.list_threshold_decisions(DEPLOYMENT, 1)[0]
        assert len(repository.list_threshold_decisions(DEPLOYMENT)) == 2
        again = await backend.thresholds.get(DEPLOYMENT)
        assert again is not None and again.threshold_tokens == second.threshold_tokens
        assert again.version == (1 if second.threshold_tokens == computed else 2)
        assert second.is_published is (second.threshold_tokens != computed)

        # An operator pins it over gRPC; then unpins it.
        server = GrpcServer(host="127.0.0.1", port=0)
        server.add_servicer(SERVICE_NAME,
                            governor_pb2_grpc.add_CapacityGovernorServiceServicer_to_server,
                            CapacityGovernorServicer(governor, clock))
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
            pinned = (await stub.SetLocalPrefillThreshold(
                governor_pb2.SetLocalPrefillThresholdRequest(
                    deployment=DEPLOYMENT, is_pinned=True, pin_threshold_tokens=PIN_TOKENS),
                timeout=10)).threshold
            assert (pinned.threshold_tokens, pinned.source, pinned.version) == (
                PIN_TOKENS, governor_pb2.THRESHOLD_SOURCE_PINNED, again.version + 1)
            stored = repository.get_deployment(DEPLOYMENT)
            assert stored is not None and stored.config[PIN_KEY] == {"threshold_tokens": PIN_TOKENS}
            await router.thresholds.refresh()
            assert await _is_local(router, PIN_TOKENS)
            assert not await _is_local(router, PIN_TOKENS + 1)

            # A pass while pinned keeps the pin and records what it would have computed.
            await _interval_of_requests(backend, clock)
            await governor.step()
            latest = repository.list_threshold_decisions(DEPLOYMENT, 1)[0]
            assert latest.source is ThresholdSource.PINNED and latest.threshold_tokens == PIN_TOKENS
            assert latest.computed_tokens is not None and not latest.is_published

            shown = (await stub.GetLocalPrefillThreshold(
                governor_pb2.GetLocalPrefillThresholdRequest(deployment=DEPLOYMENT),
                timeout=10)).threshold
            assert shown.is_published and shown.threshold_tokens == PIN_TOKENS
            assert shown.has_computed and json.loads(shown.inputs_json)["num_requests"] > 0

            unpinned = (await stub.SetLocalPrefillThreshold(
                governor_pb2.SetLocalPrefillThresholdRequest(deployment=DEPLOYMENT),
                timeout=10)).threshold
            assert unpinned.source == governor_pb2.THRESHOLD_SOURCE_COMPUTED
            assert unpinned.threshold_tokens == latest.computed_tokens
            stored = repository.get_deployment(DEPLOYMENT)
            assert stored is not None and PIN_KEY not in stored.config
            await router.thresholds.refresh()
            await _decisions_follow(router, unpinned.threshold_tokens)

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SetLocalPrefillThreshold(governor_pb2.SetLocalPrefillThresholdRequest(
                    deployment=DEPLOYMENT, pin_threshold_tokens=5), timeout=10)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "pin_threshold_tokens" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetLocalPrefillThreshold(
                    governor_pb2.GetLocalPrefillThresholdRequest(deployment="nope"), timeout=10)
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
        finally:
            await channel.close()
            await server.stop(0)
        sources = [r.source for r in repository.list_threshold_decisions(DEPLOYMENT)]
        assert sources == [ThresholdSource.COMPUTED, ThresholdSource.PINNED,
                           ThresholdSource.PINNED, ThresholdSource.COMPUTED,
                           ThresholdSource.COMPUTED]
    finally:
        await router.thresholds.close()


async def test_a_pin_survives_a_store_loss(backend: StateBackend, repository: Repository,
                                           clock: ManualClock, options: StateOptions) -> None:
    await _add_workers(backend)
    governor = _governor(backend, repository, clock)
    assert governor.thresholds is not None
    await governor.thresholds.pin(deployment_ref(governor.spec(DEPLOYMENT)), 128)
    client = backend.client  # type: ignore[attr-defined]
    await client.delete(f"{options.key_prefix}:threshold:published")  # the store lost it
    await _interval_of_requests(backend, clock)
    await governor.step()
    published = await backend.thresholds.get(DEPLOYMENT)
    assert published is not None
    assert (published.threshold_tokens, published.source) == (128, ThresholdSource.PINNED)
