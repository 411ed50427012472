"""What a simulation returns: per-request columns, instance counts over time, lifecycle events.

Per-request timing decomposition (seconds):

- ``ttft = queue + compute + transfer``: ``compute`` is the duration of the prefill batch that
  produced the request's first token (remote, or local on its decode instance), ``transfer`` the
  exposed KV transfer after it (0 for local prefill), ``queue`` everything else: waiting at the
  router for KV room, in the prefill queue, behind other work on the decode instance (local
  prefill), and time lost to attempts that failed.
- ``tpot = (finish - first token) / (output - 1)`` (0 for one-token outputs). ``slot_wait`` is
  the part of it spent waiting for a decode batch slot.

SLO miss reasons (``MissReason``), for a request that completed:

- TTFT: ``QUEUEING`` if ``ttft - queue <= slo`` (without queueing it would have met the SLO);
  else ``TRANSFER`` if ``ttft - transfer <= slo``; else ``COMPUTE`` (compute alone, or compute
  with both, misses: more instances would not have helped, faster ones would).
- TPOT: ``QUEUEING`` if ``(finish - first token - slot_wait) / (output - 1) <= slo``, else
  ``COMPUTE`` (decode steps too slow: a large batch, long contexts, or local prefills stalling
  the batch).

Requests that were rejected (``REJECTED``) or failed after their first token or after
``max_attempts`` (``FAILED``) miss both SLOs with that reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from pdserve.sim.config import SimConfig, SloSpec


class RequestStatus(enum.IntEnum):
    COMPLETED = 0
    REJECTED = 1
    FAILED = 2


class MissReason(enum.IntEnum):
    NONE = 0
    QUEUEING = 1
    TRANSFER = 2
    COMPUTE = 3
    REJECTED = 4
    FAILED = 5


@dataclass(frozen=True, slots=True)
class InstanceEvent:
    """A lifecycle step: ``launched``, ``ready``, ``draining``, ``left`` or ``failed``."""

    time_s: float
    instance_id: str
    role: str
    event: str


@dataclass(frozen=True, slots=True)
class ScalingRecord:
    """One call of the scaling policy: when, what it asked for, and why."""

    time_s: float
    num_prefill: int
    num_decode: int
    reason: str


@dataclass(frozen=True, slots=True, eq=False)
class SimResult:
    """Columns are numpy arrays indexed by request (trace row order); times in seconds.

    ``decode_instance`` / ``prefill_instance`` are instance numbers (``d<n>`` / ``p<n>``; -1
    for none or local prefill). ``timeline`` holds ``sample_interval_s`` samples: ``time_s`` and
    ``{prefill,decode}_{ready,starting,draining}`` counts, ``num_queued`` (router queue) and
    ``kv_used_fraction`` (reserved blocks / blocks of serving decode instances).
    ``ticket_transitions`` counts ticket moves ``(from, to) -> n``, each checked legal.
    Rejected and failed requests have ``finish_s`` (when they ended) and, if they had a first
    token, ``ttft_s``; their other timings are 0. ``admission_wait_s``: from arrival until the
    router placed the last attempt (a wait in the admission queue for decode KV room; part of
    ``queue_s``). ``extra`` holds whole-run figures:
    ``prefill_busy_fraction`` (prefill compute time / ready prefill instance time),
    ``decode_kv_used_fraction`` (reserved / serving decode blocks, time-weighted),
    ``decode_batch_slot_fraction`` and ``mean_running_per_decode`` (sequences past their
    first token per serving decode instance), ``prefill_busy_s``, ``decode_instance_s``,
    ``prefill_instance_s`` and ``cpu_s`` (the process's CPU time for the run); with the live
    admission policy (``SimConfig.admission``), ``admission_<outcome>`` counts its decisions.
    ``shed``: the outcome of each request the live admission policy refused, by trace row
    (empty without it).
    """

    config: SimConfig
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    status: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    finish_s: np.ndarray
    queue_s: np.ndarray
    compute_s: np.ndarray
    transfer_s: np.ndarray
    slot_wait_s: np.ndarray
    admission_wait_s: np.ndarray
    is_local_prefill: np.ndarray
    num_attempts: np.ndarray
    decode_instance: np.ndarray
    prefill_instance: np.ndarray
    cached_tokens: np.ndarray
    timeline: dict[str, np.ndarray]
    instance_events: tuple[InstanceEvent, ...]
    scaling: tuple[ScalingRecord, ...]
    ticket_transitions: dict[tuple[str, str], int]
    gpu_hours: float
    end_s: float
    num_events: int
    num_free_blocks_at_end: int
    num_total_blocks_at_end: int
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    shed: dict[int, str] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    def ttft_reasons(self, slo: SloSpec | None = None) -> np.ndarray:
        """``MissReason`` per request for the TTFT SLO (``NONE`` when met)."""
        slo = slo or self.config.slo
        limit = slo.ttft_ms / 1000.0
        reasons = np.full(self.num_requests, MissReason.NONE, dtype=np.int8)
        missed = self.ttft_s > limit
        reasons[missed] = MissReason.COMPUTE
        reasons[missed & (self.ttft_s - self.transfer_s <= limit)] = MissReason.TRANSFER
        reasons[missed & (self.ttft_s - self.queue_s <= limit)] = MissReason.QUEUEING
        self._mark_unfinished(reasons)
        return reasons

    def tpot_reasons(self, slo: SloSpec | None = None) -> np.ndarray:
        """``MissReason`` per request for the TPOT SLO (``NONE`` when met)."""
        slo = slo or self.config.slo
        limit = slo.tpot_ms / 1000.0
        reasons = np.full(self.num_requests, MissReason.NONE, dtype=np.int8)
        missed = self.tpot_s > limit
        reasons[missed] = MissReason.COMPUTE
        steps = np.maximum(self.output_tokens - 1, 1)
        without_wait = self.tpot_s - self.slot_wait_s / steps
        reasons[missed & (without_wait <= limit)] = MissReason.QUEUEING
        self._mark_unfinished(reasons)
        return reasons

    def _mark_unfinished(self, reasons: np.ndarray) -> None:
        reasons[self.status == RequestStatus.REJECTED] = MissReason.REJECTED
        reasons[self.status == RequestStatus.FAILED] = MissReason.FAILED

    def met_slo(self, slo: SloSpec | None = None) -> np.ndarray:
        """bool per request: completed and met both SLOs."""
        return (self.ttft_reasons(slo) == MissReason.NONE) & (
            self.tpot_reasons(slo) == MissReason.NONE)

    def miss_reasons(self, slo: SloSpec | None = None) -> np.ndarray:
        """One reason per request: the TTFT reason if TTFT missed, else the TPOT reason."""
        ttft = self.ttft_reasons(slo)
        return np.where(ttft != MissReason.NONE, ttft, self.tpot_reasons(slo)).astype(np.int8)

    def attainment(self, slo: SloSpec | None = None) -> float:
        """Fraction of all requests (rejected and failed included) that met both SLOs."""
        if self.num_requests == 0:
            return 1.0
        return float(np.mean(self.met_slo(slo)))
