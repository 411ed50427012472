"""gRPC adapter of the capacity governor. This first version answers capacity questions and
expert-placement what-ifs; the planner and autoscaler RPCs answer UNIMPLEMENTED until the
governor's planning loop exists (they are part of the v1 API so clients can be written now)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from pdserve.api.v1 import governor_pb2
from pdserve.api.v1 import governor_pb2_grpc
from pdserve.capacity.catalog import get_gpu, get_model
from pdserve.capacity.eplb import (
    PlacementPolicy,
    PlacementTopology,
    gpu_balancedness,
    plan_expert_placement,
)
from pdserve.capacity.experts import ExpertPlacementService
from pdserve.capacity.kv_budget import CapacityConfig, capacity_report
from pdserve.common.errors import InvalidArgumentError, UnavailableError

SERVICE_NAME = "pdserve.api.v1.CapacityGovernorService"

_POLICY = {
    governor_pb2.PLACEMENT_POLICY_UNSPECIFIED: PlacementPolicy.GLOBAL,
    governor_pb2.PLACEMENT_POLICY_GLOBAL: PlacementPolicy.GLOBAL,
    governor_pb2.PLACEMENT_POLICY_HIERARCHICAL: PlacementPolicy.HIERARCHICAL,
}


class CapacityGovernorServicer(governor_pb2_grpc.CapacityGovernorServiceServicer):
    experts: ExpertPlacementService | None = None
    """The expert-placement loop (``pdserve.capacity.experts``), set by the app."""

    async def GetCapacity(self, request: governor_pb2.GetCapacityRequest, context: grpc.aio.ServicerContext) -> governor_pb2.GetCapacityResponse:
        if not request.model:
            raise InvalidArgumentError("model: required", field="model")
        if not request.gpu:
            raise InvalidArgumentError("gpu: required", field="gpu")
        config = CapacityConfig(
            tp_size=request.tp_size or 1, block_size_tokens=request.block_size_tokens or 16,
            gpu_memory_utilization=request.gpu_memory_utilization or 0.9,
        )
        report = capacity_report(get_model(request.model), get_gpu(request.gpu), config)
        length = request.request_length_tokens or report.max_model_len
        return governor_pb2.GetCapacityResponse(
            kv_bytes_per_token=report.kv_bytes_per_token, num_blocks=report.num_blocks,
            num_tokens=report.num_tokens, max_concurrency=report.max_concurrency_at(length),
            kv_pool_bytes=report.kv_pool_bytes,
        )

    async def WhatIfExpertPlacement(self, request: governor_pb2.WhatIfExpertPlacementRequest, context: grpc.aio.ServicerContext) -> governor_pb2.WhatIfExpertPlacementResponse:
        num_layers, num_experts = request.num_layers, request.num_experts
        if num_layers < 1 or num_experts < 1:
            raise InvalidArgumentError("num_layers, num_experts: must be >= 1", field="num_layers")
        if len(request.expert_loads) != num_layers * num_experts:
            raise InvalidArgumentError(
                f"expert_loads: expected num_layers x num_experts = {num_layers * num_experts} "
                f"values, got {len(request.expert_loads)}", field="expert_loads")
        loads = np.asarray(request.expert_loads, dtype=np.float64).reshape(num_layers, num_experts)
        topology = PlacementTopology(
            num_slots=request.num_slots, num_gpus=request.num_gpus, num_nodes=request.num_nodes or 1,
            num_groups=request.num_groups or 1, policy=_POLICY[request.policy],
        )
        placement = await asyncio.to_thread(plan_expert_placement, loads, topology)
        return governor_pb2.WhatIfExpertPlacementResponse(placement=governor_pb2.ExpertPlacement(
            num_layers=num_layers, num_slots=topology.num_slots, num_gpus=topology.num_gpus,
            num_experts=num_experts,
            slot_to_expert=placement.slot_to_expert.reshape(-1).tolist(),
            balancedness=gpu_balancedness(placement, loads).tolist(),
        ))

    async def GetExpertPlacement(self, request: governor_pb2.GetExpertPlacementRequest, context: grpc.aio.ServicerContext) -> governor_pb2.GetExpertPlacementResponse:
        if self.experts is None:
            raise UnavailableError("expert placement is not running in this governor")
        return await self.experts.get_expert_placement(request)
