"""The expert-placement loop as the governor app runs it (``ExpertPlacementService``): the
policy from the governor's settings, the hot-state backend the loads come from, the durable
store of versions, gRPC to workers, and ``GetExpertPlacement``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdserve.api.v1 import governor_pb2
from pdserve.capacity.expert_policy import ExpertPolicy
from pdserve.capacity.expert_versions import parse_placement_key, placement_key
from pdserve.common.errors import PdserveError, UnavailableError
from pdserve.common.types import Clock
from pdserve.governor.expert_client import GrpcWorkerPlacementClient
from pdserve.governor.expert_convert import placement_to_pb
from pdserve.governor.expert_loop import ExpertPlacementGovernor, PlacementRepository
from pdserve.governor.settings import GovernorSettings
from pdserve.state.expert_loads import expert_load_store_for
from pdserve.state.interfaces import StateBackend


def expert_policy(settings: object) -> ExpertPolicy:
    """From ``GovernorSettings``; the defaults for any other settings object (the one-machine
    stack passes its own)."""
    if not isinstance(settings, GovernorSettings):
        return ExpertPolicy()
    return ExpertPolicy(
        half_life_s=settings.expert_half_life_s,
        replan_period_s=settings.expert_replan_period_s,
        min_balancedness=settings.expert_min_balancedness,
        min_replan_interval_s=settings.expert_min_replan_interval_s,
        min_tokens_per_layer=settings.expert_min_tokens_per_layer,
        balance_tolerance=settings.expert_balance_tolerance,
        slots_per_gpu=settings.expert_slots_per_gpu,
        gpus_per_node=settings.expert_gpus_per_node,
        num_groups=settings.expert_num_groups,
        tick_s=settings.expert_tick_s,
        rollout_timeout_s=settings.expert_rollout_timeout_s,
    )


class ExpertPlacementService:
    """The expert-placement loop as the governor app runs it: the hot-state backend (its own,
    from ``settings.redis_url``, unless one is shared in), the durable store, gRPC to workers."""

    def __init__(self, settings: Any, backend: StateBackend | None = None,
                 repository: PlacementRepository | None = None, clock: Clock = time.time) -> None:
        self.policy = expert_policy(settings)
        self._owns_backend = backend is None
        if backend is None:
            from pdserve.state.factory import open_backend

            backend = open_backend(getattr(settings, "redis_url", None), clock)
        self.backend = backend
        self.client = GrpcWorkerPlacementClient(settings, self.policy.rollout_timeout_s)
        self.governor = ExpertPlacementGovernor(
            self.policy, backend.workers, expert_load_store_for(backend), self.client, clock,
            repository)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.governor.run(self._stop),
                                             name="expert-placement")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.client.close()
        if self._owns_backend:
            await self.backend.close()

    async def get_expert_placement(
        self, request: governor_pb2.GetExpertPlacementRequest
    ) -> governor_pb2.GetExpertPlacementResponse:
        deployment, role = parse_placement_key(request.deployment)
        try:
            status = await self.governor.status(deployment, role)
        except PdserveError:
            raise
        except Exception as exc:  # noqa: BLE001 - the durable store is the likely cause
            raise UnavailableError(f"expert placement unavailable: {exc}") from None
        current = status.current
        if current is None:
            return governor_pb2.GetExpertPlacementResponse()
        return governor_pb2.GetExpertPlacementResponse(placement=placement_to_pb(
            current.placement, status.balancedness,
            deployment=placement_key(status.deployment, status.role), version=current.version))
