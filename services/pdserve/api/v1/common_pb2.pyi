from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_REGISTERING: _ClassVar[WorkerState]
    WORKER_STATE_LOADING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINED: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]

class TicketState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TICKET_STATE_UNSPECIFIED: _ClassVar[TicketState]
    TICKET_STATE_OPEN: _ClassVar[TicketState]
    TICKET_STATE_PREFILLING: _ClassVar[TicketState]
    TICKET_STATE_TRANSFERRING: _ClassVar[TicketState]
    TICKET_STATE_DONE: _ClassVar[TicketState]
    TICKET_STATE_ABORTED: _ClassVar[TicketState]
    TICKET_STATE_EXPIRED: _ClassVar[TicketState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_MODE_UNSPECIFIED: _ClassVar[PrefillMode]
    PREFILL_MODE_REMOTE: _ClassVar[PrefillMode]
    PREFILL_MODE_LOCAL: _ClassVar[PrefillMode]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_REGISTERING: WorkerState
WORKER_STATE_LOADING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_DRAINED: WorkerState
WORKER_STATE_FAILED: WorkerState
TICKET_STATE_UNSPECIFIED: TicketState
TICKET_STATE_OPEN: TicketState
TICKET_STATE_PREFILLING: TicketState
TICKET_STATE_TRANSFERRING: TicketState
TICKET_STATE_DONE: TicketState
TICKET_STATE_ABORTED: TicketState
TICKET_STATE_EXPIRED: TicketState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
PREFILL_MODE_UNSPECIFIED: PrefillMode
PREFILL_MODE_REMOTE: PrefillMode
PREFILL_MODE_LOCAL: PrefillMode

class FencingToken(_message.Message):
    __slots__ = ("ticket_id", "attempt")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    attempt: int
    def __init__(self, ticket_id: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_queued_prefill_tokens", "num_running_seqs", "num_free_blocks", "num_total_blocks", "num_waiting_seqs")
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_SEQS_FIELD_NUMBER: _ClassVar[int]
    num_queued_prefill_tokens: int
    num_running_seqs: int
    num_free_blocks: int
    num_total_blocks: int
    num_waiting_seqs: int
    def __init__(self, num_queued_prefill_tokens: _Optional[int] = ..., num_running_seqs: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_waiting_seqs: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_blocks", "block_size_tokens", "block_nbytes")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_blocks: int
    block_size_tokens: int
    block_nbytes: int
    def __init__(self, num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size_tokens: _Optional[int] = ..., block_nbytes: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "deployment", "role", "state", "address", "kv_address", "load", "last_heartbeat_unix_ms", "engine", "gpu", "tp_size", "kv_layout", "kv_transports", "model", "num_gpus", "prefill_tokens_per_s", "tokenizer_sha256", "max_model_len", "software_version", "kv_frame_versions", "admits_in_decode")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_FRAME_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ADMITS_IN_DECODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    deployment: str
    role: WorkerRole
    state: WorkerState
    address: str
    kv_address: str
    load: WorkerLoad
    last_heartbeat_unix_ms: int
    engine: str
    gpu: str
    tp_size: int
    kv_layout: KvLayout
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    model: str
    num_gpus: int
    prefill_tokens_per_s: float
    tokenizer_sha256: str
    max_model_len: int
    software_version: str
    kv_frame_versions: _containers.RepeatedScalarFieldContainer[int]
    admits_in_decode: bool
    def __init__(self, worker_id: _Optional[str] = ..., deployment: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., address: _Optional[str] = ..., kv_address: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., engine: _Optional[str] = ..., gpu: _Optional[str] = ..., tp_size: _Optional[int] = ..., kv_layout: _Optional[_Union[KvLayout, _Mapping]] = ..., kv_transports: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., num_gpus: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., tokenizer_sha256: _Optional[str] = ..., max_model_len: _Optional[int] = ..., software_version: _Optional[str] = ..., kv_frame_versions: _Optional[_Iterable[int]] = ..., admits_in_decode: _Optional[bool] = ...) -> None: ...

class TokenizerBundle(_message.Message):
    __slots__ = ("tokenizer_json", "chat_template", "bos_token", "eos_token", "pad_token", "max_model_len", "sha256")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: bytes
    chat_template: str
    bos_token: str
    eos_token: str
    pad_token: str
    max_model_len: int
    sha256: str
    def __init__(self, tokenizer_json: _Optional[bytes] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., pad_token: _Optional[str] = ..., max_model_len: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "ignore_eos", "stop")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("kv_address", "block_ids", "transport", "kv_layout", "transport_metadata", "decode_worker_id", "kv_frame_versions")
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_FRAME_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    kv_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    transport: str
    kv_layout: KvLayout
    transport_metadata: bytes
    decode_worker_id: str
    kv_frame_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kv_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., transport: _Optional[str] = ..., kv_layout: _Optional[_Union[KvLayout, _Mapping]] = ..., transport_metadata: _Optional[bytes] = ..., decode_worker_id: _Optional[str] = ..., kv_frame_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("num_bytes", "num_blocks", "prefill_compute_ms", "transfer_ms", "exposed_ms", "num_layers")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    num_blocks: int
    prefill_compute_ms: float
    transfer_ms: float
    exposed_ms: float
    num_layers: int
    def __init__(self, num_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., prefill_compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., exposed_ms: _Optional[float] = ..., num_layers: _Optional[int] = ...) -> None: ...
