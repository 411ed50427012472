"""Wiring of the capacity governor service: the gRPC servicer, the expert-placement loop and
the autoscaler's live loop (``governor.CapacityGovernor``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from pdserve.api.v1 import governor_pb2_grpc
from pdserve.capacity.controls import AutoscalerConfig, AutoscalerControls
from pdserve.capacity.plan_inputs import Slo
from pdserve.capacity.sizing import InstanceProfile, SizingConfig
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.leadership import LeaderElector, Lease, holder_id, open_lease
from pdserve.common.service import GrpcService
from pdserve.common.types import Clock, WorkerRole
from pdserve.db.durable import DurableWriter, open_durable
from pdserve.db.repository import Repository
from pdserve.governor.autoscaling import (
    CapacityGovernor,
    DeploymentSpec,
    GovernorConfig,
    GrpcTargetSetter,
    LivePlanConfig,
    TargetSetter,
)
from pdserve.governor.expert_service import ExpertPlacementService
from pdserve.governor.servicer import SERVICE_NAME, CapacityGovernorServicer
from pdserve.governor.settings import GovernorSettings
from pdserve.governor.thresholds import ThresholdConfig, ThresholdGovernor
from pdserve.state.interfaces import StateBackend
from pdserve.state.stores import open_stores

logger = logging.getLogger(__name__)


def deployment_specs(settings: GovernorSettings,
                     repository: Repository | None) -> list[DeploymentSpec]:
    """What the autoscaler sizes: each of ``autoscale_deployments`` with the model, GPU and TP of
    its durable record, or (without one) the deployment name as the catalog model and the
    settings' GPU and TP. An unknown model or GPU fails here, naming it."""
    specs = []
    for name in settings.autoscale_deployments:
        record = None
        if repository is not None:
            try:
                record = repository.get_deployment(name)
            except Exception:  # the settings still describe it
                logger.warning("could not read deployment %s from the durable store", name,
                               exc_info=True)
        model = record.model if record else name
        gpu = record.gpu if record else settings.autoscale_gpu
        tp_size = record.tp_size if record else settings.autoscale_tp_size
        profile = InstanceProfile.from_catalog(
            model, gpu, prefill_tp_size=tp_size, decode_tp_size=tp_size,
            max_num_blocks=settings.autoscale_max_num_blocks, speedup=settings.autoscale_speedup)
        specs.append(DeploymentSpec(name=name, model=model, gpu=gpu, profile=profile,
                                    cold_start_s=settings.autoscale_cold_start_s,
                                    tp_size=tp_size))
    return specs


class GovernorApp:
    def __init__(self, settings: GovernorSettings, durable: DurableWriter | None = None,
                 backend: StateBackend | None = None, *,
                 target_setter: TargetSetter | None = None, clock: Clock = time.time,
                 lease: Lease | None = None, lease_ttl_s: float = 5.0) -> None:
        """``backend``: the hot state shared with the pool managers (``pdserve up``); by
        default the governor opens its own from ``settings.redis_url``. ``target_setter``:
        how the autoscaler sets pool targets (the in-process managers of ``pdserve up``); by
        default the pool managers' gRPC at ``prefill_pool_address``/``decode_pool_address``,
        and recommend-only when those are not set. ``lease``: the autoscaler runs only while
        this replica holds it (active/standby; ``pdserve.common.leadership``); None = always."""
        self.settings = settings
        self.elector = LeaderElector(lease, lease_ttl_s) if lease is not None else None
        self.servicer = CapacityGovernorServicer(clock=clock)
        repository = durable.repository if durable is not None else None
        # Expert placement (EPLB): loads from the pools' hot state, versions in the durable store.
        self.experts = ExpertPlacementService(settings, backend, repository)
        self.servicer.experts = self.experts
        # Autoscaler: one policy per deployment, decisions in the durable store; and the
        # local-prefill threshold it publishes to the routers.
        hot = backend if backend is not None else self.experts.backend
        slo = Slo(settings.autoscale_slo_ttft_ms / 1000.0, settings.autoscale_slo_tpot_ms / 1000.0)
        self.thresholds = ThresholdGovernor(
            hot, ThresholdConfig(slo, is_dry_run=settings.is_threshold_dry_run), clock=clock,
            repository=repository)
        self.governor = CapacityGovernor(
            deployment_specs(settings, repository), hot,
            clock=clock, target_setter=target_setter, repository=repository,
            thresholds=self.thresholds,
            live_plan=(LivePlanConfig(
                Slo(slo.ttft_s, slo.tpot_s, settings.autoscale_slo_percentile),
                interval_s=settings.live_plan_interval_s, window_s=settings.live_plan_window_s,
                time_budget_s=settings.live_plan_budget_s)
                if settings.live_plan_interval_s > 0 else None),
            config=GovernorConfig(interval_s=settings.autoscale_interval_s),
            controls=AutoscalerControls(is_dry_run=settings.is_autoscaler_dry_run,
                                        max_gpus=settings.autoscale_max_gpus),
            autoscaler_config=AutoscalerConfig(
                sizing=SizingConfig(tpot_slo_s=settings.autoscale_slo_tpot_ms / 1000.0)))
        self.servicer.governor = self.governor
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._channels: list[Any] = []

    def register(self, server: GrpcServer) -> None:
        server.add_servicer(SERVICE_NAME,
                            governor_pb2_grpc.add_CapacityGovernorServiceServicer_to_server,
                            self.servicer)

    def start(self) -> None:
        self.experts.start()
        if not self.governor.deployments:
            return
        settings = self.settings
        if (self.governor.target_setter is None and settings.prefill_pool_address
                and settings.decode_pool_address):
            from pdserve.common.grpc_client import open_channel

            channels = {WorkerRole.PREFILL: open_channel(settings.prefill_pool_address, settings),
                        WorkerRole.DECODE: open_channel(settings.decode_pool_address, settings)}
            self._channels = list(channels.values())
            self.governor.target_setter = GrpcTargetSetter(channels)
        if self.elector is None:
            self._task = asyncio.create_task(self.governor.run(self._stop))
        else:
            self._task = asyncio.create_task(self._run_while_leader(self.elector))

    async def _run_while_leader(self, elector: LeaderElector) -> None:
        """Active/standby: the autoscaling loop runs while this replica holds the lease, and
        stops at once when it loses it (a standby takes over after the lease lapses)."""
        loop_stop: asyncio.Event | None = None
        loop_task: asyncio.Task[None] | None = None
        while not self._stop.is_set():
            is_leader = await elector.step()
            if is_leader and loop_task is None:
                loop_stop = asyncio.Event()
                loop_task = asyncio.create_task(self.governor.run(loop_stop))
            elif not is_leader and loop_task is not None:
                assert loop_stop is not None
                loop_stop.set()
                await loop_task
                loop_task = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), elector.ttl_s / 3)
        if loop_task is not None and loop_stop is not None:
            loop_stop.set()
            await loop_task
        if elector.token is not None:
            with contextlib.suppress(Exception):
                await elector.lease.release(elector.token)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        for channel in self._channels:
            await channel.close()
        await self.experts.close()


def build(settings: GovernorSettings) -> GrpcService:
    """The governor as its own process. Its replicas share a lease (active/standby): only the
    holder autoscales. It reads the pools' hot state through its own backend."""
    stores = open_stores(settings.redis_url)
    durable = open_durable(settings.database_url, settings.durable_spool_dir,
                           settings.service_name, migrate=False)
    app = GovernorApp(settings, durable, lease=open_lease(stores.redis_client, "governor",
                                                          holder_id()),
                      lease_ttl_s=settings.leader_lease_s)
    return GrpcService(settings.service_name, settings, app,
                       [stores.close, *([durable.close] if durable else [])])
