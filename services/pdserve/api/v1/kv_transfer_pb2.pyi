from pdserve.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Ticket(_message.Message):
    __slots__ = ("token", "state", "deployment", "decode_worker_id", "prefill_worker_id", "num_blocks", "is_held", "lease_remaining_ms", "request_id", "num_prompt_tokens", "reason", "created_unix_ms", "stats")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IS_HELD_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    state: _common_pb2.TicketState
    deployment: str
    decode_worker_id: str
    prefill_worker_id: str
    num_blocks: int
    is_held: bool
    lease_remaining_ms: int
    request_id: str
    num_prompt_tokens: int
    reason: str
    created_unix_ms: int
    stats: _common_pb2.TransferStats
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.TicketState, str]] = ..., deployment: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., is_held: _Optional[bool] = ..., lease_remaining_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.TransferStats, _Mapping]] = ...) -> None: ...

class OpenTicketRequest(_message.Message):
    __slots__ = ("deployment", "decode_worker_id", "prefill_worker_id", "num_blocks", "lease_ms", "request_id", "num_prompt_tokens")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    decode_worker_id: str
    prefill_worker_id: str
    num_blocks: int
    lease_ms: int
    request_id: str
    num_prompt_tokens: int
    def __init__(self, deployment: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., lease_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class OpenTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class UpdateProgressRequest(_message.Message):
    __slots__ = ("token", "state", "num_layers_done", "stats", "reporter_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    state: _common_pb2.TicketState
    num_layers_done: int
    stats: _common_pb2.TransferStats
    reporter_id: str
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.TicketState, str]] = ..., num_layers_done: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.TransferStats, _Mapping]] = ..., reporter_id: _Optional[str] = ...) -> None: ...

class UpdateProgressResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("token", "lease_ms")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    lease_ms: int
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class PublishDestinationRequest(_message.Message):
    __slots__ = ("token", "destination")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    destination: _common_pb2.KvDestination
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., destination: _Optional[_Union[_common_pb2.KvDestination, _Mapping]] = ...) -> None: ...

class PublishDestinationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AwaitDestinationRequest(_message.Message):
    __slots__ = ("token", "timeout_ms")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    timeout_ms: int
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class AwaitDestinationResponse(_message.Message):
    __slots__ = ("is_ready", "destination", "ticket")
    IS_READY_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    is_ready: bool
    destination: _common_pb2.KvDestination
    ticket: Ticket
    def __init__(self, is_ready: _Optional[bool] = ..., destination: _Optional[_Union[_common_pb2.KvDestination, _Mapping]] = ..., ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class AbortTicketRequest(_message.Message):
    __slots__ = ("token", "reason", "reporter_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    reason: str
    reporter_id: str
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ..., reason: _Optional[str] = ..., reporter_id: _Optional[str] = ...) -> None: ...

class AbortTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class ReleaseTicketRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.FencingToken
    def __init__(self, token: _Optional[_Union[_common_pb2.FencingToken, _Mapping]] = ...) -> None: ...

class ReleaseTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class GetTicketRequest(_message.Message):
    __slots__ = ("ticket_id",)
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    def __init__(self, ticket_id: _Optional[str] = ...) -> None: ...

class GetTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class ListTicketsRequest(_message.Message):
    __slots__ = ("decode_worker_id", "state", "limit")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    state: _common_pb2.TicketState
    limit: int
    def __init__(self, decode_worker_id: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.TicketState, str]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListTicketsResponse(_message.Message):
    __slots__ = ("tickets",)
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    tickets: _containers.RepeatedCompositeFieldContainer[Ticket]
    def __init__(self, tickets: _Optional[_Iterable[_Union[Ticket, _Mapping]]] = ...) -> None: ...

class WatchTicketsRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class WatchTicketsResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class GetLedgerRequest(_message.Message):
    __slots__ = ("decode_worker_id", "deployment")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    deployment: str
    def __init__(self, decode_worker_id: _Optional[str] = ..., deployment: _Optional[str] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("decode_worker_id", "num_total_blocks", "num_reserved_blocks", "num_held_blocks", "num_free_blocks")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    num_total_blocks: int
    num_reserved_blocks: int
    num_held_blocks: int
    num_free_blocks: int
    def __init__(self, decode_worker_id: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_reserved_blocks: _Optional[int] = ..., num_held_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ...) -> None: ...

class GetLedgerResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ...) -> None: ...

class TicketReport(_message.Message):
    __slots__ = ("progress", "release")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    progress: UpdateProgressRequest
    release: ReleaseTicketRequest
    def __init__(self, progress: _Optional[_Union[UpdateProgressRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseTicketRequest, _Mapping]] = ...) -> None: ...

class ReportTicketsRequest(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[TicketReport]
    def __init__(self, reports: _Optional[_Iterable[_Union[TicketReport, _Mapping]]] = ...) -> None: ...

class TicketReportResult(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReportTicketsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TicketReportResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TicketReportResult, _Mapping]]] = ...) -> None: ...
