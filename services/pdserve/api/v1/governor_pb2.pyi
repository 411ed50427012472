from pdserve.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScalingAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCALING_ACTION_UNSPECIFIED: _ClassVar[ScalingAction]
    SCALING_ACTION_HOLD: _ClassVar[ScalingAction]
    SCALING_ACTION_SCALE_UP: _ClassVar[ScalingAction]
    SCALING_ACTION_SCALE_DOWN: _ClassVar[ScalingAction]

class PlacementPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_POLICY_UNSPECIFIED: _ClassVar[PlacementPolicy]
    PLACEMENT_POLICY_HIERARCHICAL: _ClassVar[PlacementPolicy]
    PLACEMENT_POLICY_GLOBAL: _ClassVar[PlacementPolicy]

class ThresholdSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    THRESHOLD_SOURCE_UNSPECIFIED: _ClassVar[ThresholdSource]
    THRESHOLD_SOURCE_COMPUTED: _ClassVar[ThresholdSource]
    THRESHOLD_SOURCE_PINNED: _ClassVar[ThresholdSource]
SCALING_ACTION_UNSPECIFIED: ScalingAction
SCALING_ACTION_HOLD: ScalingAction
SCALING_ACTION_SCALE_UP: ScalingAction
SCALING_ACTION_SCALE_DOWN: ScalingAction
PLACEMENT_POLICY_UNSPECIFIED: PlacementPolicy
PLACEMENT_POLICY_HIERARCHICAL: PlacementPolicy
PLACEMENT_POLICY_GLOBAL: PlacementPolicy
THRESHOLD_SOURCE_UNSPECIFIED: ThresholdSource
THRESHOLD_SOURCE_COMPUTED: ThresholdSource
THRESHOLD_SOURCE_PINNED: ThresholdSource

class LengthDistribution(_message.Message):
    __slots__ = ("mean_tokens", "samples_tokens")
    MEAN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mean_tokens: float
    samples_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, mean_tokens: _Optional[float] = ..., samples_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Demand(_message.Message):
    __slots__ = ("arrival_rate_per_s", "prompt", "output", "prefix_hit_fraction")
    ARRIVAL_RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    arrival_rate_per_s: float
    prompt: LengthDistribution
    output: LengthDistribution
    prefix_hit_fraction: float
    def __init__(self, arrival_rate_per_s: _Optional[float] = ..., prompt: _Optional[_Union[LengthDistribution, _Mapping]] = ..., output: _Optional[_Union[LengthDistribution, _Mapping]] = ..., prefix_hit_fraction: _Optional[float] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("ttft_ms", "tpot_ms", "percentile")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    PERCENTILE_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tpot_ms: float
    percentile: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., percentile: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("deployment", "num_prefill_instances", "num_decode_instances", "num_gpus", "predicted_ttft_ms", "predicted_tpot_ms", "local_prefill_threshold_tokens", "goodput_per_gpu", "demand", "slo", "created_unix_ms", "predicted_attainment", "replayed_attainment", "prefill_tp_size", "decode_tp_size", "num_requests", "window_start_unix_ms")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_START_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    num_prefill_instances: int
    num_decode_instances: int
    num_gpus: int
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    local_prefill_threshold_tokens: int
    goodput_per_gpu: float
    demand: Demand
    slo: Slo
    created_unix_ms: int
    predicted_attainment: float
    replayed_attainment: float
    prefill_tp_size: int
    decode_tp_size: int
    num_requests: int
    window_start_unix_ms: int
    def __init__(self, deployment: _Optional[str] = ..., num_prefill_instances: _Optional[int] = ..., num_decode_instances: _Optional[int] = ..., num_gpus: _Optional[int] = ..., predicted_ttft_ms: _Optional[float] = ..., predicted_tpot_ms: _Optional[float] = ..., local_prefill_threshold_tokens: _Optional[int] = ..., goodput_per_gpu: _Optional[float] = ..., demand: _Optional[_Union[Demand, _Mapping]] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., created_unix_ms: _Optional[int] = ..., predicted_attainment: _Optional[float] = ..., replayed_attainment: _Optional[float] = ..., prefill_tp_size: _Optional[int] = ..., decode_tp_size: _Optional[int] = ..., num_requests: _Optional[int] = ..., window_start_unix_ms: _Optional[int] = ...) -> None: ...

class GetCapacityRequest(_message.Message):
    __slots__ = ("model", "gpu", "tp_size", "gpu_memory_utilization", "block_size_tokens", "request_length_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_LENGTH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    gpu: str
    tp_size: int
    gpu_memory_utilization: float
    block_size_tokens: int
    request_length_tokens: int
    def __init__(self, model: _Optional[str] = ..., gpu: _Optional[str] = ..., tp_size: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ..., block_size_tokens: _Optional[int] = ..., request_length_tokens: _Optional[int] = ...) -> None: ...

class GetCapacityResponse(_message.Message):
    __slots__ = ("kv_bytes_per_token", "num_blocks", "num_tokens", "max_concurrency", "kv_pool_bytes")
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    kv_bytes_per_token: int
    num_blocks: int
    num_tokens: int
    max_concurrency: float
    kv_pool_bytes: int
    def __init__(self, kv_bytes_per_token: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., max_concurrency: _Optional[float] = ..., kv_pool_bytes: _Optional[int] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    def __init__(self, deployment: _Optional[str] = ...) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("plan", "replayed_plan")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    replayed_plan: Plan
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., replayed_plan: _Optional[_Union[Plan, _Mapping]] = ...) -> None: ...

class WhatIfPlanRequest(_message.Message):
    __slots__ = ("model", "gpu", "prefill_tp_size", "decode_tp_size", "demand", "slo")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    model: str
    gpu: str
    prefill_tp_size: int
    decode_tp_size: int
    demand: Demand
    slo: Slo
    def __init__(self, model: _Optional[str] = ..., gpu: _Optional[str] = ..., prefill_tp_size: _Optional[int] = ..., decode_tp_size: _Optional[int] = ..., demand: _Optional[_Union[Demand, _Mapping]] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ...) -> None: ...

class WhatIfPlanResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ...) -> None: ...

class ScalingDecision(_message.Message):
    __slots__ = ("deployment", "role", "current_instances", "target_instances", "action", "reason", "is_dry_run", "inputs_json", "decided_unix_ms")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    TARGET_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    IS_DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    INPUTS_JSON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    role: _common_pb2.WorkerRole
    current_instances: int
    target_instances: int
    action: ScalingAction
    reason: str
    is_dry_run: bool
    inputs_json: str
    decided_unix_ms: int
    def __init__(self, deployment: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., current_instances: _Optional[int] = ..., target_instances: _Optional[int] = ..., action: _Optional[_Union[ScalingAction, str]] = ..., reason: _Optional[str] = ..., is_dry_run: _Optional[bool] = ..., inputs_json: _Optional[str] = ..., decided_unix_ms: _Optional[int] = ...) -> None: ...

class ListDecisionsRequest(_message.Message):
    __slots__ = ("deployment", "role", "limit")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    role: _common_pb2.WorkerRole
    limit: int
    def __init__(self, deployment: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListDecisionsResponse(_message.Message):
    __slots__ = ("decisions",)
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[ScalingDecision]
    def __init__(self, decisions: _Optional[_Iterable[_Union[ScalingDecision, _Mapping]]] = ...) -> None: ...

class PoolBounds(_message.Message):
    __slots__ = ("min_instances", "max_instances")
    MIN_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    MAX_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    min_instances: int
    max_instances: int
    def __init__(self, min_instances: _Optional[int] = ..., max_instances: _Optional[int] = ...) -> None: ...

class SetAutoscalerControlsRequest(_message.Message):
    __slots__ = ("deployment", "is_dry_run", "is_frozen", "prefill_bounds", "decode_bounds", "override_prefill_instances", "override_decode_instances", "override_expires_in_s", "max_step_per_minute", "max_gpus")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    IS_DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    IS_FROZEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_PREFILL_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_DECODE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_GPUS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    is_dry_run: bool
    is_frozen: bool
    prefill_bounds: PoolBounds
    decode_bounds: PoolBounds
    override_prefill_instances: int
    override_decode_instances: int
    override_expires_in_s: float
    max_step_per_minute: int
    max_gpus: int
    def __init__(self, deployment: _Optional[str] = ..., is_dry_run: _Optional[bool] = ..., is_frozen: _Optional[bool] = ..., prefill_bounds: _Optional[_Union[PoolBounds, _Mapping]] = ..., decode_bounds: _Optional[_Union[PoolBounds, _Mapping]] = ..., override_prefill_instances: _Optional[int] = ..., override_decode_instances: _Optional[int] = ..., override_expires_in_s: _Optional[float] = ..., max_step_per_minute: _Optional[int] = ..., max_gpus: _Optional[int] = ...) -> None: ...

class SetAutoscalerControlsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertPlacement(_message.Message):
    __slots__ = ("deployment", "version", "num_layers", "num_slots", "slot_to_expert", "balancedness", "num_gpus", "num_experts")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_TO_EXPERT_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    version: int
    num_layers: int
    num_slots: int
    slot_to_expert: _containers.RepeatedScalarFieldContainer[int]
    balancedness: _containers.RepeatedScalarFieldContainer[float]
    num_gpus: int
    num_experts: int
    def __init__(self, deployment: _Optional[str] = ..., version: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_slots: _Optional[int] = ..., slot_to_expert: _Optional[_Iterable[int]] = ..., balancedness: _Optional[_Iterable[float]] = ..., num_gpus: _Optional[int] = ..., num_experts: _Optional[int] = ...) -> None: ...

class GetExpertPlacementRequest(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    def __init__(self, deployment: _Optional[str] = ...) -> None: ...

class GetExpertPlacementResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: ExpertPlacement
    def __init__(self, placement: _Optional[_Union[ExpertPlacement, _Mapping]] = ...) -> None: ...

class WhatIfExpertPlacementRequest(_message.Message):
    __slots__ = ("expert_loads", "num_layers", "num_experts", "num_slots", "num_groups", "num_nodes", "num_gpus", "policy")
    EXPERT_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    expert_loads: _containers.RepeatedScalarFieldContainer[float]
    num_layers: int
    num_experts: int
    num_slots: int
    num_groups: int
    num_nodes: int
    num_gpus: int
    policy: PlacementPolicy
    def __init__(self, expert_loads: _Optional[_Iterable[float]] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_groups: _Optional[int] = ..., num_nodes: _Optional[int] = ..., num_gpus: _Optional[int] = ..., policy: _Optional[_Union[PlacementPolicy, str]] = ...) -> None: ...

class WhatIfExpertPlacementResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: ExpertPlacement
    def __init__(self, placement: _Optional[_Union[ExpertPlacement, _Mapping]] = ...) -> None: ...

class LocalPrefillThreshold(_message.Message):
    __slots__ = ("deployment", "is_published", "threshold_tokens", "source", "version", "published_unix_ms", "reason", "has_computed", "computed_threshold_tokens", "inputs_json", "decided_unix_ms")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HAS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_JSON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    is_published: bool
    threshold_tokens: int
    source: ThresholdSource
    version: int
    published_unix_ms: int
    reason: str
    has_computed: bool
    computed_threshold_tokens: int
    inputs_json: str
    decided_unix_ms: int
    def __init__(self, deployment: _Optional[str] = ..., is_published: _Optional[bool] = ..., threshold_tokens: _Optional[int] = ..., source: _Optional[_Union[ThresholdSource, str]] = ..., version: _Optional[int] = ..., published_unix_ms: _Optional[int] = ..., reason: _Optional[str] = ..., has_computed: _Optional[bool] = ..., computed_threshold_tokens: _Optional[int] = ..., inputs_json: _Optional[str] = ..., decided_unix_ms: _Optional[int] = ...) -> None: ...

class GetLocalPrefillThresholdRequest(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    def __init__(self, deployment: _Optional[str] = ...) -> None: ...

class GetLocalPrefillThresholdResponse(_message.Message):
    __slots__ = ("threshold",)
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    threshold: LocalPrefillThreshold
    def __init__(self, threshold: _Optional[_Union[LocalPrefillThreshold, _Mapping]] = ...) -> None: ...

class SetLocalPrefillThresholdRequest(_message.Message):
    __slots__ = ("deployment", "is_pinned", "pin_threshold_tokens")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    IS_PINNED_FIELD_NUMBER: _ClassVar[int]
    PIN_THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    is_pinned: bool
    pin_threshold_tokens: int
    def __init__(self, deployment: _Optional[str] = ..., is_pinned: _Optional[bool] = ..., pin_threshold_tokens: _Optional[int] = ...) -> None: ...

class SetLocalPrefillThresholdResponse(_message.Message):
    __slots__ = ("threshold",)
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    threshold: LocalPrefillThreshold
    def __init__(self, threshold: _Optional[_Union[LocalPrefillThreshold, _Mapping]] = ...) -> None: ...
