from pdserve.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmitTicketRequest(_message.Message):
    __slots__ = ("token", "num_prompt_tokens", "num_blocks", "lease_ms", "transport")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    num_prompt_tokens: int
    num_blocks: int
    lease_ms: int
    transport: str
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., lease_ms: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class AdmitTicketResponse(_message.Message):
    __slots__ = ("destination",)
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    destination: _common_pb2.KvDestination
    def __init__(self, destination: _Optional[_Union[_common_pb2.KvDestination, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("token", "prompt_token_ids", "destination", "lease_ms", "request_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    destination: _common_pb2.KvDestination
    lease_ms: int
    request_id: str
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., destination: _Optional[_Union[_common_pb2.KvDestination, _Mapping]] = ..., lease_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "stats", "num_cached_prompt_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    stats: _common_pb2.TransferStats
    num_cached_prompt_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.TransferStats, _Mapping]] = ..., num_cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("token", "prompt_token_ids", "sampling", "is_local_prefill", "kv_wait_timeout_ms", "request_id", "num_blocks", "admit", "transport")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    IS_LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    is_local_prefill: bool
    kv_wait_timeout_ms: int
    request_id: str
    num_blocks: int
    admit: bool
    transport: str
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., is_local_prefill: _Optional[bool] = ..., kv_wait_timeout_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., admit: _Optional[bool] = ..., transport: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "stats", "is_admitted", "destination")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    IS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.TransferStats
    is_admitted: bool
    destination: _common_pb2.KvDestination
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.TransferStats, _Mapping]] = ..., is_admitted: _Optional[bool] = ..., destination: _Optional[_Union[_common_pb2.KvDestination, _Mapping]] = ...) -> None: ...

class DropTicketRequest(_message.Message):
    __slots__ = ("token", "reason")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    reason: str
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class DropTicketResponse(_message.Message):
    __slots__ = ("is_found", "num_blocks_freed")
    IS_FOUND_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    is_found: bool
    num_blocks_freed: int
    def __init__(self, is_found: _Optional[bool] = ..., num_blocks_freed: _Optional[int] = ...) -> None: ...

class ApplyExpertPlacementRequest(_message.Message):
    __slots__ = ("version", "num_layers", "num_slots", "slot_to_expert")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_TO_EXPERT_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_layers: int
    num_slots: int
    slot_to_expert: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_slots: _Optional[int] = ..., slot_to_expert: _Optional[_Iterable[int]] = ...) -> None: ...

class ApplyExpertPlacementResponse(_message.Message):
    __slots__ = ("version", "num_experts_moved")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_experts_moved: int
    def __init__(self, version: _Optional[int] = ..., num_experts_moved: _Optional[int] = ...) -> None: ...

class GetPerformanceProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfilePoint(_message.Message):
    __slots__ = ("num_tokens", "batch_size", "seconds", "is_prefill")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    IS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    batch_size: int
    seconds: float
    is_prefill: bool
    def __init__(self, num_tokens: _Optional[int] = ..., batch_size: _Optional[int] = ..., seconds: _Optional[float] = ..., is_prefill: _Optional[bool] = ...) -> None: ...

class GetPerformanceProfileResponse(_message.Message):
    __slots__ = ("points", "model", "gpu", "tp_size")
    POINTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[ProfilePoint]
    model: str
    gpu: str
    tp_size: int
    def __init__(self, points: _Optional[_Iterable[_Union[ProfilePoint, _Mapping]]] = ..., model: _Optional[str] = ..., gpu: _Optional[str] = ..., tp_size: _Optional[int] = ...) -> None: ...

class BeginDrainRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class BeginDrainResponse(_message.Message):
    __slots__ = ("num_in_flight",)
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_in_flight: int
    def __init__(self, num_in_flight: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerTicket(_message.Message):
    __slots__ = ("token", "num_blocks", "phase")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    num_blocks: int
    phase: str
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., num_blocks: _Optional[int] = ..., phase: _Optional[str] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("worker", "tickets", "expert_placement_version", "num_used_blocks", "num_total_blocks", "kv_checksums", "num_refused_frames", "num_late_writes_accepted", "prompt_tokens_by_source")
    class PromptTokensBySourceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_LATE_WRITES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_BY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    tickets: _containers.RepeatedCompositeFieldContainer[WorkerTicket]
    expert_placement_version: int
    num_used_blocks: int
    num_total_blocks: int
    kv_checksums: _containers.RepeatedCompositeFieldContainer[KvChecksum]
    num_refused_frames: int
    num_late_writes_accepted: int
    prompt_tokens_by_source: _containers.ScalarMap[str, int]
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., tickets: _Optional[_Iterable[_Union[WorkerTicket, _Mapping]]] = ..., expert_placement_version: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_checksums: _Optional[_Iterable[_Union[KvChecksum, _Mapping]]] = ..., num_refused_frames: _Optional[int] = ..., num_late_writes_accepted: _Optional[int] = ..., prompt_tokens_by_source: _Optional[_Mapping[str, int]] = ...) -> None: ...

class KvChecksum(_message.Message):
    __slots__ = ("token", "crc32", "num_blocks", "num_layers", "block_crc32s", "kv_frame_version")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRC32S_FIELD_NUMBER: _ClassVar[int]
    KV_FRAME_VERSION_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    crc32: int
    num_blocks: int
    num_layers: int
    block_crc32s: _containers.RepeatedScalarFieldContainer[int]
    kv_frame_version: int
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., crc32: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_layers: _Optional[int] = ..., block_crc32s: _Optional[_Iterable[int]] = ..., kv_frame_version: _Optional[int] = ...) -> None: ...
