"""Routing decisions, pure: plain data in, a decision out, no I/O, no clock.

The live router and the simulator call the same functions. A decision picks a decode worker
(enough free KV blocks for the reservation, then least memory and batch pressure), decides local
or remote prefill, and for remote prefill picks a prefill worker by estimated time to finish the
prompt: its queued prompt tokens plus the prompt tokens it does not have cached.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.errors import CapacityError, UnavailableError
from pdserve.router.types import PrefillMode


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Knobs of the routing policy; the governor tunes ``local_prefill_threshold_tokens``."""

    local_prefill_threshold_tokens: int = 64
    """Uncached prompt tokens at or below which the decode worker prefills itself."""
    prefill_saturation_tokens: int = 65_536
    """When every prefill worker has more queued prompt tokens than this, prefill locally."""
    max_running_seqs: int = 256
    """Batch size at which a decode worker counts as fully pressured."""
    batch_pressure_weight: float = 0.5
    """Weight of batch pressure against KV-memory pressure in the decode score."""
    growth_policy_max_tokens: bool = True
    """Reserve for the worst case (prompt + max_tokens); otherwise prompt + expected output."""
    expected_output_tokens: int = 256
    """Growth allowance when ``growth_policy_max_tokens`` is False."""
    retry_after_s: float = 0.5
    """Retry hint when no decode worker has room."""


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    worker_id: str
    num_free_blocks: int
    num_total_blocks: int
    num_running_seqs: int
    block_size_tokens: int
    num_cached_prefix_tokens: int = 0
    num_pending_blocks: int = 0
    """Blocks this router reserved there that the last heartbeat may not show yet."""
    num_pending_seqs: int = 0
    """Requests this router sent there and still has in flight."""


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    worker_id: str
    num_queued_prefill_tokens: int
    num_cached_prefix_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    num_prompt_tokens: int
    max_tokens: int
    prefill_mode: PrefillMode = PrefillMode.AUTO


@dataclass(frozen=True, slots=True)
class RouteDecision:
    decode_worker_id: str
    prefill_worker_id: str  # "" means local prefill on the decode worker
    num_blocks: int
    """Blocks to reserve on the decode worker (prompt plus growth allowance)."""
    num_cached_prefix_tokens: int
    reason: str

    @property
    def is_local_prefill(self) -> bool:
        return not self.prefill_worker_id


def num_blocks_to_reserve(request: RouteRequest, block_size_tokens: int,
                          config: RoutingConfig) -> int:
    growth = request.max_tokens if config.growth_policy_max_tokens else min(
        request.max_tokens, config.expected_output_tokens
    )
    return math.ceil((request.num_prompt_tokens + growth) / block_size_tokens)


def _decode_score(candidate: DecodeCandidate, num_blocks: int, config: RoutingConfig) -> float:
    # Pending reservations count against a worker in the score (its heartbeat is up to one
    # period old, and a burst must not pile onto the worker that looked emptiest), but not in
    # the feasibility check: the ledger, not this estimate, has the last word on room.
    free = candidate.num_free_blocks - candidate.num_pending_blocks
    free_after = (free - num_blocks) / max(1, candidate.num_total_blocks)
    running = max(candidate.num_running_seqs, candidate.num_pending_seqs)
    batch_pressure = min(1.0, running / max(1, config.max_running_seqs))
    return free_after - config.batch_pressure_weight * batch_pressure


def choose_decode(
    request: RouteRequest,
    candidates: Sequence[DecodeCandidate],
    config: RoutingConfig,
    excluded: frozenset[str] = frozenset(),
) -> tuple[DecodeCandidate, int]:
    """The decode worker with the best score among those with room; raises if none has room."""
    usable = [c for c in candidates if c.worker_id not in excluded]
    if not usable:
        raise UnavailableError("no ready decode worker")
    best: tuple[float, str] | None = None
    chosen: tuple[DecodeCandidate, int] | None = None
    for candidate in usable:
        num_blocks = num_blocks_to_reserve(request, candidate.block_size_tokens, config)
        if num_blocks > candidate.num_free_blocks:
            continue
        key = (_decode_score(candidate, num_blocks, config), candidate.worker_id)
        if best is None or key > best:
            best, chosen = key, (candidate, num_blocks)
    if chosen is None:
        largest = max(c.num_total_blocks * c.block_size_tokens for c in usable)
        if request.num_prompt_tokens + request.max_tokens > largest:
            raise CapacityError(
                "request needs more KV memory than any decode worker has",
                retry_after_s=config.retry_after_s,
            )
        raise CapacityError("no decode worker has free KV blocks",
                            retry_after_s=config.retry_after_s)
    return chosen


def choose_prefill(
    request: RouteRequest,
    candidates: Sequence[PrefillCandidate],
    excluded: frozenset[str] = frozenset(),
) -> PrefillCandidate | None:
    """Least estimated work: queued tokens plus this prompt's uncached tokens."""
    best: tuple[int, str] | None = None
    chosen = None
    for candidate in candidates:
        if candidate.worker_id in excluded:
            continue
        uncached = max(0, request.num_prompt_tokens - candidate.num_cached_prefix_tokens)
        key = (candidate.num_queued_prefill_tokens + uncached, candidate.worker_id)
        if best is None or key < best:
            best, chosen = key, candidate
    return chosen


def route(
    request: RouteRequest,
    decode_candidates: Sequence[DecodeCandidate],
    prefill_candidates: Sequence[PrefillCandidate],
    config: RoutingConfig,
    excluded: frozenset[str] = frozenset(),
) -> RouteDecision:
    """Pick the decode worker, then local or remote prefill, then the prefill worker."""
    decode, num_blocks = choose_decode(request, decode_candidates, config, excluded)
    uncached_on_decode = request.num_prompt_tokens - decode.num_cached_prefix_tokens
    prefill = None
    reason = "forced local"
    if request.prefill_mode is not PrefillMode.LOCAL:
        prefill = choose_prefill(request, prefill_candidates, excluded)
        if prefill is None:
            if request.prefill_mode is PrefillMode.REMOTE:
                raise UnavailableError("no ready prefill worker")
            reason = "no prefill worker"
        elif request.prefill_mode is PrefillMode.REMOTE:
            reason = "forced remote"
        elif uncached_on_decode <= config.local_prefill_threshold_tokens:
            prefill, reason = None, "short prompt"
        elif prefill.num_queued_prefill_tokens > config.prefill_saturation_tokens:
            prefill, reason = None, "prefill pool saturated"
        else:
            reason = "remote"
    return RouteDecision(
        decode_worker_id=decode.worker_id,
        prefill_worker_id=prefill.worker_id if prefill else "",
        num_blocks=num_blocks,
        num_cached_prefix_tokens=(
            prefill.num_cached_prefix_tokens if prefill else decode.num_cached_prefix_tokens
        ),
        reason=reason,
    )
