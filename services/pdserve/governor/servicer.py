"""gRPC adapter of the capacity governor: capacity questions, expert-placement what-ifs, and
the autoscaler (the plan in force, decision history, operator controls). Protos in, core
calls, protos out; the policy lives in ``autoscaler`` and the loop in ``governor``.
``WhatIfPlan`` runs the SLO planner (``planner.plan``) on a hypothetical demand."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np

from pdserve.api.v1 import governor_pb2, governor_pb2_grpc
from pdserve.capacity import plan_inputs, planner
from pdserve.capacity.controls import AutoscalerControls, PoolBounds
from pdserve.capacity.eplb import plan_expert_placement
from pdserve.capacity.eplb_placement import PlacementPolicy, PlacementTopology, gpu_balancedness
from pdserve.common.convert import role_from_pb, role_to_pb
from pdserve.common.errors import InvalidArgumentError, UnavailableError
from pdserve.common.types import Clock, ThresholdSource, WorkerRole
from pdserve.db.records import CapacityPlanRecord, ScalingAction, ScalingDecisionRecord
from pdserve.governor.autoscaling import CapacityGovernor, DeploymentSpec, deployment_ref
from pdserve.governor.expert_convert import placement_to_pb
from pdserve.governor.expert_service import ExpertPlacementService
from pdserve.governor.thresholds import ThresholdState
from pdserve.perf.catalog import get_gpu, get_model
from pdserve.perf.kv_budget import CapacityConfig, capacity_report

SERVICE_NAME = "pdserve.api.v1.CapacityGovernorService"

_POLICY = {
    governor_pb2.PLACEMENT_POLICY_UNSPECIFIED: PlacementPolicy.GLOBAL,
    governor_pb2.PLACEMENT_POLICY_GLOBAL: PlacementPolicy.GLOBAL,
    governor_pb2.PLACEMENT_POLICY_HIERARCHICAL: PlacementPolicy.HIERARCHICAL,
}


_ACTION_TO_PB = {
    ScalingAction.HOLD: governor_pb2.SCALING_ACTION_HOLD,
    ScalingAction.SCALE_UP: governor_pb2.SCALING_ACTION_SCALE_UP,
    ScalingAction.SCALE_DOWN: governor_pb2.SCALING_ACTION_SCALE_DOWN,
}

DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 10_000
MAX_OVERRIDE_S = 7 * 86_400.0
"""Longest manual override accepted: an override is a temporary measure."""
MAX_PIN_TOKENS = 10_000_000
"""Largest pinned local-prefill threshold (the routers' setting's bound)."""
_SOURCE_TO_PB = {
    ThresholdSource.COMPUTED: governor_pb2.THRESHOLD_SOURCE_COMPUTED,
    ThresholdSource.PINNED: governor_pb2.THRESHOLD_SOURCE_PINNED,
}
UNBOUNDED_INSTANCES = PoolBounds().max_instances
"""``PoolBounds.max_instances`` 0 in a request means no maximum (this many)."""


def decision_to_pb(record: ScalingDecisionRecord) -> governor_pb2.ScalingDecision:
    """A stored decision; ``inputs_json`` is its inputs with the forecast under "forecast"."""
    inputs = {**record.inputs, "forecast": dict(record.forecast)}
    decided_ms = int(record.at.timestamp() * 1000) if record.at is not None else 0
    return governor_pb2.ScalingDecision(
        deployment=record.deployment, role=role_to_pb(record.role),
        current_instances=record.num_current_instances,
        target_instances=record.num_target_instances, action=_ACTION_TO_PB[record.action],
        reason=record.reason, is_dry_run=record.is_dry_run,
        inputs_json=json.dumps(inputs, sort_keys=True, allow_nan=False),
        decided_unix_ms=decided_ms,
    )


def threshold_to_pb(deployment: str, state: ThresholdState) -> governor_pb2.LocalPrefillThreshold:
    """The threshold in force and the latest decision (``inputs_json``: its inputs)."""
    message = governor_pb2.LocalPrefillThreshold(deployment=deployment)
    published, latest = state.published, state.latest
    if published is not None:
        message.is_published = True
        message.threshold_tokens = published.threshold_tokens
        message.source = _SOURCE_TO_PB[published.source]
        message.version = published.version
        message.published_unix_ms = int(published.published_s * 1000)
    if latest is not None:
        message.reason = latest.reason
        if latest.computed_tokens is not None:
            message.has_computed = True
            message.computed_threshold_tokens = latest.computed_tokens
        message.inputs_json = json.dumps(dict(latest.inputs), sort_keys=True, allow_nan=False)
        message.decided_unix_ms = int(latest.at.timestamp() * 1000) if latest.at else 0
    return message


def pin_from_pb(request: governor_pb2.SetLocalPrefillThresholdRequest) -> int | None:
    """The pin asked for (None: unpin); ``InvalidArgumentError`` names a bad field."""
    if not request.is_pinned:
        if request.pin_threshold_tokens:
            raise InvalidArgumentError(
                "pin_threshold_tokens: set without is_pinned (to unpin, leave it 0)",
                field="pin_threshold_tokens")
        return None
    if request.pin_threshold_tokens > MAX_PIN_TOKENS:
        raise InvalidArgumentError(
            f"pin_threshold_tokens: at most {MAX_PIN_TOKENS}, got "
            f"{request.pin_threshold_tokens}", field="pin_threshold_tokens")
    return int(request.pin_threshold_tokens)


def plan_to_pb(spec: DeploymentSpec, num_prefill: int, num_decode: int,
               inputs: Mapping[str, Any], at_s: float) -> governor_pb2.Plan:
    """The autoscaler's plan: instance counts for the demand it forecast (plus headroom).
    ``predicted_tpot_ms`` is the performance model's step time at the planned decode batch;
    the autoscaler does not predict TTFT percentiles (0)."""
    profile = spec.profile
    prompt = float(inputs.get("mean_prompt_tokens", 0.0))
    output = float(inputs.get("mean_output_tokens", 0.0))
    batch = max(1, math.ceil(float(inputs.get("decode_batch_size", 0.0))))
    step_s = profile.decode_perf.decode_step_time_s(
        batch, math.ceil(batch * (prompt + output / 2.0))) / profile.speedup
    return governor_pb2.Plan(
        deployment=spec.name, num_prefill_instances=num_prefill,
        num_decode_instances=num_decode,
        num_gpus=(num_prefill * profile.num_gpus_per_prefill
                  + num_decode * profile.num_gpus_per_decode),
        predicted_tpot_ms=step_s * 1000.0,
        prefill_tp_size=spec.tp_size, decode_tp_size=spec.tp_size,
        demand=governor_pb2.Demand(
            arrival_rate_per_s=float(inputs.get("demand_rate_per_s", 0.0)),
            prompt=governor_pb2.LengthDistribution(mean_tokens=prompt),
            output=governor_pb2.LengthDistribution(mean_tokens=output)),
        created_unix_ms=int(at_s * 1000),
    )


def replayed_plan_to_pb(record: CapacityPlanRecord) -> governor_pb2.Plan:
    """A plan by replay of the observed window (``governor.live_plan.plan_record``)."""
    inputs, outputs = record.inputs, record.outputs
    prefill, decode = outputs.get("prefill", {}), outputs.get("decode", {})
    created_ms = int(record.created_at.timestamp() * 1000) if record.created_at else 0
    return governor_pb2.Plan(
        deployment=record.deployment, num_prefill_instances=record.num_prefill_instances,
        num_decode_instances=record.num_decode_instances,
        num_gpus=int(outputs.get("num_gpus", 0)),
        predicted_ttft_ms=record.predicted_ttft_ms, predicted_tpot_ms=record.predicted_tpot_ms,
        local_prefill_threshold_tokens=record.local_prefill_threshold_tokens,
        demand=governor_pb2.Demand(
            arrival_rate_per_s=float(inputs.get("arrival_rate_per_s", 0.0)),
            prompt=governor_pb2.LengthDistribution(
                mean_tokens=float(inputs.get("prompt_tokens_mean", 0.0))),
            output=governor_pb2.LengthDistribution(
                mean_tokens=float(inputs.get("mean_output_tokens", 0.0)))),
        slo=governor_pb2.Slo(ttft_ms=float(inputs.get("slo_ttft_ms", 0.0)),
                             tpot_ms=float(inputs.get("slo_tpot_ms", 0.0)),
                             percentile=float(inputs.get("slo_percentile", 0.0))),
        created_unix_ms=created_ms,
        predicted_attainment=float(outputs.get("predicted_attainment") or 0.0),
        replayed_attainment=float(outputs.get("replayed_attainment") or 0.0),
        prefill_tp_size=int(prefill.get("tp", 0)), decode_tp_size=int(decode.get("tp", 0)),
        num_requests=int(inputs.get("num_requests", 0)),
        window_start_unix_ms=int(float(inputs.get("window_start_unix_s", 0.0)) * 1000),
    )


def _bounds_from_pb(request: governor_pb2.SetAutoscalerControlsRequest, name: str) -> PoolBounds:
    if not request.HasField(name):
        return PoolBounds()
    bounds = getattr(request, name)
    return PoolBounds(bounds.min_instances, bounds.max_instances or UNBOUNDED_INSTANCES)


def controls_from_pb(request: governor_pb2.SetAutoscalerControlsRequest,
                     now_s: float) -> AutoscalerControls:
    """Controls from a request, every field checked (``InvalidArgumentError`` names it).

    Absent bounds mean the defaults (at least 1, at most ``UNBOUNDED_INSTANCES``); a
    ``max_instances`` of 0 means no maximum. An override needs ``override_expires_in_s`` in
    (0, 7 days]; expiry without an override is refused as a likely mistake.
    """
    expires_in_s = request.override_expires_in_s
    has_override = bool(request.override_prefill_instances or request.override_decode_instances)
    if not math.isfinite(expires_in_s) or expires_in_s < 0 or expires_in_s > MAX_OVERRIDE_S:
        raise InvalidArgumentError(
            f"override_expires_in_s: must be in [0, {MAX_OVERRIDE_S:g}] seconds, got "
            f"{expires_in_s}", field="override_expires_in_s")
    if has_override and expires_in_s <= 0:
        raise InvalidArgumentError(
            "override_expires_in_s: required (> 0) with an override", field="override_expires_in_s")
    if not has_override and expires_in_s > 0:
        raise InvalidArgumentError(
            "override_expires_in_s: set without override_prefill_instances or "
            "override_decode_instances", field="override_expires_in_s")
    return AutoscalerControls(
        is_dry_run=request.is_dry_run, is_frozen=request.is_frozen,
        prefill_bounds=_bounds_from_pb(request, "prefill_bounds"),
        decode_bounds=_bounds_from_pb(request, "decode_bounds"),
        override_prefill_instances=request.override_prefill_instances or None,
        override_decode_instances=request.override_decode_instances or None,
        override_until_s=now_s + expires_in_s if has_override else 0.0,
        max_step_per_minute=request.max_step_per_minute, max_gpus=request.max_gpus,
    )


def _lengths_from_pb(lengths: governor_pb2.LengthDistribution,
                     name: str) -> tuple[float, tuple[int, ...]]:
    """(mean tokens, samples) of a length distribution; one of them must be given."""
    samples = tuple(int(x) for x in lengths.samples_tokens)
    if any(x < 1 for x in samples):
        raise InvalidArgumentError(f"{name}.samples_tokens: every length must be >= 1",
                                   field=f"{name}.samples_tokens")
    mean = lengths.mean_tokens or (sum(samples) / len(samples) if samples else 0.0)
    if not math.isfinite(mean) or mean < 1:
        raise InvalidArgumentError(
            f"{name}: give mean_tokens >= 1 or samples_tokens", field=f"{name}.mean_tokens")
    return mean, samples


def what_if_inputs(request: governor_pb2.WhatIfPlanRequest) -> tuple[
        plan_inputs.Demand, plan_inputs.Slo, plan_inputs.InstanceShape, plan_inputs.InstanceShape]:
    """The planner's inputs from a request, every field checked (``InvalidArgumentError``
    names it). Paired samples of equal length are used as they are; otherwise each length is
    taken from its mean (``plan_inputs.Demand.from_means``)."""
    for name in ("model", "gpu"):
        if not getattr(request, name):
            raise InvalidArgumentError(f"{name}: required", field=name)
    if not request.HasField("demand"):
        raise InvalidArgumentError("demand: required", field="demand")
    if not request.HasField("slo"):
        raise InvalidArgumentError("slo: required", field="slo")
    demand, slo = request.demand, request.slo
    rate = demand.arrival_rate_per_s
    if not (math.isfinite(rate) and rate > 0):
        raise InvalidArgumentError("demand.arrival_rate_per_s: must be > 0",
                                   field="demand.arrival_rate_per_s")
    if not 0.0 <= demand.prefix_hit_fraction < 1.0:
        raise InvalidArgumentError("demand.prefix_hit_fraction: must be in [0, 1)",
                                   field="demand.prefix_hit_fraction")
    prompt_mean, prompts = _lengths_from_pb(demand.prompt, "demand.prompt")
    output_mean, outputs = _lengths_from_pb(demand.output, "demand.output")
    for name in ("ttft_ms", "tpot_ms"):
        value = getattr(slo, name)
        if not (math.isfinite(value) and value > 0):
            raise InvalidArgumentError(f"slo.{name}: must be > 0", field=f"slo.{name}")
    percentile = slo.percentile or 90.0
    if not 0.0 < percentile < 100.0:
        raise InvalidArgumentError("slo.percentile: must be in (0, 100)", field="slo.percentile")
    if prompts and outputs and len(prompts) == len(outputs):
        plan_demand = plan_inputs.Demand(rate, prompts, outputs, demand.prefix_hit_fraction)
    else:
        plan_demand = plan_inputs.Demand.from_means(rate, prompt_mean, output_mean,
                                                demand.prefix_hit_fraction)
    shapes = [plan_inputs.InstanceShape(request.model, request.gpu, tp or 1)
              for tp in (request.prefill_tp_size, request.decode_tp_size)]
    return (plan_demand, plan_inputs.Slo(slo.ttft_ms / 1000.0, slo.tpot_ms / 1000.0, percentile),
            shapes[0], shapes[1])


class CapacityGovernorServicer(governor_pb2_grpc.CapacityGovernorServiceServicer):
    """``governor`` None serves the stateless RPCs only (the autoscaler RPCs then answer
    UNAVAILABLE). ``clock`` (wall seconds) dates override expiries."""

    def __init__(self, governor: CapacityGovernor | None = None, clock: Clock = time.time) -> None:
        self.governor = governor
        self._clock = clock

    def _governor(self) -> CapacityGovernor:
        if self.governor is None:
            raise UnavailableError("the autoscaler is not running in this governor")
        return self.governor

    async def GetPlan(self, request: governor_pb2.GetPlanRequest,
                      context: grpc.aio.ServicerContext
                      ) -> governor_pb2.GetPlanResponse:
        governor = self._governor()
        decision, at_s, stored = await governor.latest(request.deployment)
        spec = governor.spec(request.deployment)
        replayed = await governor.latest_replayed_plan(request.deployment)
        response = governor_pb2.GetPlanResponse()
        if replayed is not None:
            response.replayed_plan.CopyFrom(replayed_plan_to_pb(replayed))
        if decision is not None:
            response.plan.CopyFrom(plan_to_pb(
                spec, decision.num_prefill, decision.num_decode, decision.inputs, at_s))
            return response
        by_role = {record.role: record for record in stored}
        if len(by_role) < 2:
            return response
        prefill, decode = by_role[WorkerRole.PREFILL], by_role[WorkerRole.DECODE]
        at = max(r.at.timestamp() for r in stored if r.at is not None)
        response.plan.CopyFrom(plan_to_pb(
            spec, prefill.num_target_instances, decode.num_target_instances,
            {**prefill.inputs, **prefill.forecast}, at))
        return response

    async def WhatIfPlan(self, request: governor_pb2.WhatIfPlanRequest,
                         context: grpc.aio.ServicerContext
                         ) -> governor_pb2.WhatIfPlanResponse:
        demand, slo, prefill, decode = what_if_inputs(request)
        result = await asyncio.to_thread(planner.plan, demand, slo, [prefill], [decode])
        config, prediction = result.config, result.prediction
        return governor_pb2.WhatIfPlanResponse(plan=governor_pb2.Plan(
            num_prefill_instances=config.num_prefill, num_decode_instances=config.num_decode,
            num_gpus=config.num_gpus, predicted_ttft_ms=prediction.ttft_s * 1000.0,
            predicted_tpot_ms=prediction.tpot_s * 1000.0,
            local_prefill_threshold_tokens=config.local_prefill_threshold_tokens,
            goodput_per_gpu=result.goodput_per_gpu, demand=request.demand, slo=request.slo,
            created_unix_ms=int(self._clock() * 1000),
            predicted_attainment=prediction.attainment,
            prefill_tp_size=config.prefill.tp_size, decode_tp_size=config.decode.tp_size))

    async def ListDecisions(self, request: governor_pb2.ListDecisionsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> governor_pb2.ListDecisionsResponse:
        limit = request.limit or DEFAULT_LIST_LIMIT
        if limit > MAX_LIST_LIMIT:
            raise InvalidArgumentError(f"limit: at most {MAX_LIST_LIMIT}, got {limit}",
                                       field="limit")
        role = role_from_pb(request.role, allow_unspecified=True)
        records = await self._governor().list_decisions(request.deployment, role=role,
                                                        limit=limit)
        return governor_pb2.ListDecisionsResponse(
            decisions=[decision_to_pb(record) for record in records])

    async def SetAutoscalerControls(self, request: governor_pb2.SetAutoscalerControlsRequest,
                                    context: grpc.aio.ServicerContext
                                    ) -> governor_pb2.SetAutoscalerControlsResponse:
        governor = self._governor()
        governor.spec(request.deployment)  # NOT_FOUND / INVALID_ARGUMENT before anything else
        controls = controls_from_pb(request, self._clock())
        await governor.set_controls(request.deployment, controls)
        return governor_pb2.SetAutoscalerControlsResponse()

    def _thresholds(self, deployment: str) -> tuple[CapacityGovernor, DeploymentSpec]:
        governor = self._governor()
        spec = governor.spec(deployment)  # NOT_FOUND / INVALID_ARGUMENT first
        if governor.thresholds is None:
            raise UnavailableError("the local-prefill threshold is not governed here")
        return governor, spec

    async def GetLocalPrefillThreshold(
            self, request: governor_pb2.GetLocalPrefillThresholdRequest,
            context: grpc.aio.ServicerContext) -> governor_pb2.GetLocalPrefillThresholdResponse:
        governor, spec = self._thresholds(request.deployment)
        assert governor.thresholds is not None
        state = await governor.thresholds.current(spec.name)
        return governor_pb2.GetLocalPrefillThresholdResponse(
            threshold=threshold_to_pb(spec.name, state))

    async def SetLocalPrefillThreshold(
            self, request: governor_pb2.SetLocalPrefillThresholdRequest,
            context: grpc.aio.ServicerContext) -> governor_pb2.SetLocalPrefillThresholdResponse:
        governor, spec = self._thresholds(request.deployment)
        assert governor.thresholds is not None
        pin = pin_from_pb(request)
        state = await governor.thresholds.pin(deployment_ref(spec), pin)
        return governor_pb2.SetLocalPrefillThresholdResponse(
            threshold=threshold_to_pb(spec.name, state))

    experts: ExpertPlacementService | None = None
    """The expert-placement loop (``pdserve.governor.expert_service``), set by the app."""

    async def GetCapacity(self, request: governor_pb2.GetCapacityRequest,
                          context: grpc.aio.ServicerContext
                          ) -> governor_pb2.GetCapacityResponse:
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

    async def WhatIfExpertPlacement(self, request: governor_pb2.WhatIfExpertPlacementRequest,
                                    context: grpc.aio.ServicerContext
                                    ) -> governor_pb2.WhatIfExpertPlacementResponse:
        num_layers, num_experts = request.num_layers, request.num_experts
        if num_layers < 1 or num_experts < 1:
            raise InvalidArgumentError("num_layers, num_experts: must be >= 1", field="num_layers")
        if len(request.expert_loads) != num_layers * num_experts:
            raise InvalidArgumentError(
                f"expert_loads: expected num_layers x num_experts = {num_layers * num_experts} "
                f"values, got {len(request.expert_loads)}", field="expert_loads")
        loads = np.asarray(request.expert_loads, dtype=np.float64).reshape(num_layers, num_experts)
        if request.policy not in _POLICY:
            raise InvalidArgumentError(f"policy: unknown placement policy {request.policy}",
                                       field="policy")
        topology = PlacementTopology(
            num_slots=request.num_slots, num_gpus=request.num_gpus,
            num_nodes=request.num_nodes or 1,
            num_groups=request.num_groups or 1, policy=_POLICY[request.policy],
        )
        placement = await asyncio.to_thread(plan_expert_placement, loads, topology)
        return governor_pb2.WhatIfExpertPlacementResponse(
            placement=placement_to_pb(placement, gpu_balancedness(placement, loads)))

    async def GetExpertPlacement(self, request: governor_pb2.GetExpertPlacementRequest,
                                 context: grpc.aio.ServicerContext
                                 ) -> governor_pb2.GetExpertPlacementResponse:
        if self.experts is None:
            raise UnavailableError("expert placement is not running in this governor")
        return await self.experts.get_expert_placement(request)
