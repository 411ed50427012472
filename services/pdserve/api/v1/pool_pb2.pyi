from pdserve.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_EVENT_KIND_UNSPECIFIED: _ClassVar[PoolEventKind]
    POOL_EVENT_KIND_UPSERTED: _ClassVar[PoolEventKind]
    POOL_EVENT_KIND_REMOVED: _ClassVar[PoolEventKind]
    POOL_EVENT_KIND_GAP: _ClassVar[PoolEventKind]
    POOL_EVENT_KIND_TARGET: _ClassVar[PoolEventKind]
POOL_EVENT_KIND_UNSPECIFIED: PoolEventKind
POOL_EVENT_KIND_UPSERTED: PoolEventKind
POOL_EVENT_KIND_REMOVED: PoolEventKind
POOL_EVENT_KIND_GAP: PoolEventKind
POOL_EVENT_KIND_TARGET: PoolEventKind

class RegisterRequest(_message.Message):
    __slots__ = ("join_token", "worker", "expected_cold_start_s", "tokenizer")
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COLD_START_S_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    join_token: str
    worker: _common_pb2.WorkerInfo
    expected_cold_start_s: float
    tokenizer: _common_pb2.TokenizerBundle
    def __init__(self, join_token: _Optional[str] = ..., worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., expected_cold_start_s: _Optional[float] = ..., tokenizer: _Optional[_Union[_common_pb2.TokenizerBundle, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_ms", "heartbeat_ttl_ms", "worker_credential")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_ms: int
    heartbeat_ttl_ms: int
    worker_credential: str
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., heartbeat_ttl_ms: _Optional[int] = ..., worker_credential: _Optional[str] = ...) -> None: ...

class HeldBlocks(_message.Message):
    __slots__ = ("token", "num_blocks")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    num_blocks: int
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "state", "load", "held_blocks", "added_prefix_hashes", "removed_prefix_hashes", "expert_token_counts", "num_moe_layers", "join_token", "worker", "is_full_prefix_report", "tokenizer")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADDED_PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    IS_FULL_PREFIX_REPORT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: _common_pb2.WorkerState
    load: _common_pb2.WorkerLoad
    held_blocks: _containers.RepeatedCompositeFieldContainer[HeldBlocks]
    added_prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    removed_prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    expert_token_counts: _containers.RepeatedScalarFieldContainer[int]
    num_moe_layers: int
    join_token: str
    worker: _common_pb2.WorkerInfo
    is_full_prefix_report: bool
    tokenizer: _common_pb2.TokenizerBundle
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.WorkerState, str]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., held_blocks: _Optional[_Iterable[_Union[HeldBlocks, _Mapping]]] = ..., added_prefix_hashes: _Optional[_Iterable[int]] = ..., removed_prefix_hashes: _Optional[_Iterable[int]] = ..., expert_token_counts: _Optional[_Iterable[int]] = ..., num_moe_layers: _Optional[int] = ..., join_token: _Optional[str] = ..., worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., is_full_prefix_report: _Optional[bool] = ..., tokenizer: _Optional[_Union[_common_pb2.TokenizerBundle, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("should_drain", "was_readopted", "should_send_full_prefix_report", "should_send_tokenizer", "worker_credential", "drop_tokens", "drop_reasons")
    SHOULD_DRAIN_FIELD_NUMBER: _ClassVar[int]
    WAS_READOPTED_FIELD_NUMBER: _ClassVar[int]
    SHOULD_SEND_FULL_PREFIX_REPORT_FIELD_NUMBER: _ClassVar[int]
    SHOULD_SEND_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    WORKER_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    DROP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROP_REASONS_FIELD_NUMBER: _ClassVar[int]
    should_drain: bool
    was_readopted: bool
    should_send_full_prefix_report: bool
    should_send_tokenizer: bool
    worker_credential: str
    drop_tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.FencingToken]
    drop_reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, should_drain: _Optional[bool] = ..., was_readopted: _Optional[bool] = ..., should_send_full_prefix_report: _Optional[bool] = ..., should_send_tokenizer: _Optional[bool] = ..., worker_credential: _Optional[str] = ..., drop_tokens: _Optional[_Iterable[_Union[_common_pb2.FencingToken, _Mapping]]] = ..., drop_reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "join_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    join_token: str
    def __init__(self, worker_id: _Optional[str] = ..., join_token: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.WorkerState
    def __init__(self, state: _Optional[_Union[_common_pb2.WorkerState, str]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("deployment", "role")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    role: _common_pb2.WorkerRole
    def __init__(self, deployment: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "cursor", "target_size")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    TARGET_SIZE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerInfo]
    cursor: str
    target_size: int
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerInfo, _Mapping]]] = ..., cursor: _Optional[str] = ..., target_size: _Optional[int] = ...) -> None: ...

class WatchPoolRequest(_message.Message):
    __slots__ = ("deployment", "cursor")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    cursor: str
    def __init__(self, deployment: _Optional[str] = ..., cursor: _Optional[str] = ...) -> None: ...

class WatchPoolResponse(_message.Message):
    __slots__ = ("kind", "worker", "worker_id", "cursor")
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    kind: PoolEventKind
    worker: _common_pb2.WorkerInfo
    worker_id: str
    cursor: str
    def __init__(self, kind: _Optional[_Union[PoolEventKind, str]] = ..., worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., worker_id: _Optional[str] = ..., cursor: _Optional[str] = ...) -> None: ...

class SetTargetSizeRequest(_message.Message):
    __slots__ = ("deployment", "role", "num_workers", "set_by")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SET_BY_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    role: _common_pb2.WorkerRole
    num_workers: int
    set_by: str
    def __init__(self, deployment: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., num_workers: _Optional[int] = ..., set_by: _Optional[str] = ...) -> None: ...

class SetTargetSizeResponse(_message.Message):
    __slots__ = ("previous_num_workers",)
    PREVIOUS_NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    previous_num_workers: int
    def __init__(self, previous_num_workers: _Optional[int] = ...) -> None: ...
