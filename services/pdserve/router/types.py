"""Types the router's front ends (gRPC Generate, OpenAI HTTP) share with its core."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


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


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Per-request timings as the router saw them, milliseconds."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    queue_ms: float = 0.0
    is_local_prefill: bool = False
    num_attempts: int = 1


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


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A model the router serves."""

    name: str
    max_context_tokens: int
    num_prefill_workers: int = 0
    num_decode_workers: int = 0
    created_unix_s: int = 0
    tags: tuple[str, ...] = field(default_factory=tuple)


class GenerationBackend(Protocol):
    """What a front end needs from the router core."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream chunks; raises ``PdserveError`` subclasses before the first chunk on bad
        input (InvalidArgumentError), no capacity (CapacityError) or no worker (UnavailableError).
        """
        ...

    async def cancel(self, request_id: str) -> bool: ...

    def list_models(self) -> list[ModelCard]: ...
