"""Types the router's parts share: its front ends (gRPC Generate, OpenAI HTTP) with its core, and
the core with the sink of its request outcomes."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.api.v1 import common_pb2 as pb


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


PB_TO_FINISH_REASON: Mapping[pb.FinishReason, FinishReason] = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
    pb.FINISH_REASON_ERROR: FinishReason.ERROR,
}
"""Finish reasons on the wire (decode workers report them, ``Generate`` answers with them);
``FINISH_REASON_UNSPECIFIED`` is absent: not finished yet."""
FINISH_REASON_TO_PB: Mapping[FinishReason, pb.FinishReason] = {
    reason: value for value, reason in PB_TO_FINISH_REASON.items()}


class PrefillMode(enum.StrEnum):
    AUTO = "auto"
    REMOTE = "remote"
    LOCAL = "local"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request: the prompt is already tokenized by the model's tokenizer."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = True
    stop: tuple[str, ...] = ()
    prefill_mode: PrefillMode = PrefillMode.AUTO
    tenant: str = ""
    resume_token_ids: tuple[int, ...] = ()
    """A stream resumed by its client (its router died): the tokens it already received, which
    ``max_tokens`` counts; the router streams only what follows (``router.failover``)."""


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Per-request timings as the router saw them, milliseconds."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    queue_ms: float = 0.0
    is_local_prefill: bool = False
    num_attempts: int = 1
    num_failovers: int = 0
    """Times the stream moved to another decode worker after its first token."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """New tokens; the last chunk has ``finish_reason``, ``usage`` and ``timing`` set."""

    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timing: RequestTiming | None = None
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    num_cached_prompt_tokens: int = 0
    """Set in an attempt's last chunk: prompt tokens the prefill engine found in its own prefix
    cache (as the prefill worker reported them; 0 for a local prefill)."""


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A model the router serves."""

    name: str
    max_context_tokens: int
    num_prefill_workers: int = 0
    num_decode_workers: int = 0
    created_unix_s: int = 0
    tags: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One finished request, for metrics and the per-window durable aggregate."""

    request_id: str
    deployment: str
    ttft_s: float
    tpot_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    is_ok: bool
    is_local_prefill: bool
    num_attempts: int
    error_code: str = ""
    exposed_transfer_s: float = 0.0
    queue_s: float = 0.0


class OutcomeSink(Protocol):
    """Where the core reports each finished request (``router.outcomes.OutcomeAggregator``)."""

    def record(self, outcome: RequestOutcome) -> None: ...


class GenerationBackend(Protocol):
    """What a front end needs from the router core."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream chunks; raises ``PdserveError`` subclasses before the first chunk on bad
        input (InvalidArgumentError), no capacity (CapacityError) or no worker (UnavailableError).
        """
        ...

    async def cancel(self, request_id: str) -> bool: ...

    def list_models(self) -> list[ModelCard]: ...
