"""Values that services hand to and get back from the durable store (``pdserve.db.Repository``).

Services build these and never see ORM classes. Each record is checked on construction and raises
``InvalidArgumentError`` naming the bad field. Times are timezone-aware datetimes; the repository
stores and returns them in UTC. A time left as ``None`` is filled from the repository's injected
clock, and the record the repository returns has it set. JSON fields (``config``, ``inputs``,
``outputs``, ``forecast``, ``placement``, ``num_misses_by_reason``) must be JSON objects of finite
numbers, strings, booleans, lists and objects; treat them as read-only.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import ThresholdSource, TicketState, WorkerRole, WorkerState

JsonObject = Mapping[str, Any]
"""A JSON object as decoded by ``json.loads``."""


class ScalingAction(enum.StrEnum):
    """What an autoscaler decision does to a pool."""

    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    HOLD = "hold"


class MissReason(enum.StrEnum):
    """Why a request missed its TTFT or TPOT SLO: where its time went."""

    QUEUEING = "queueing"
    TRANSFER = "transfer"
    COMPUTE = "compute"


def _require(is_ok: bool, field_name: str, message: str) -> None:
    if not is_ok:
        raise InvalidArgumentError(f"{field_name} {message}", field=field_name)


def _check_name(value: str, field_name: str, *, max_len: int = 128) -> None:
    _require(isinstance(value, str) and 0 < len(value) <= max_len, field_name,
             f"must be a non-empty string of at most {max_len} characters")


def _check_count(value: int, field_name: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, field_name,
             "must be a non-negative integer")


def _check_seconds(value: float, field_name: str) -> None:
    _require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, field_name,
             "must be a finite number of seconds >= 0")


def _check_ms(value: float | None, field_name: str, *, is_optional: bool = False) -> None:
    if value is None and is_optional:
        return
    _require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
             field_name, "must be a finite number of milliseconds >= 0")


def _check_time(value: datetime | None, field_name: str) -> None:
    if value is not None:
        _require(isinstance(value, datetime) and value.utcoffset() is not None, field_name,
                 "must be a timezone-aware datetime")


def _check_json_object(value: Any, field_name: str) -> None:
    _require(isinstance(value, Mapping), field_name, "must be a JSON object (a mapping)")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{field_name} is not valid JSON: {error}",
                                   field=field_name) from None


@dataclass(frozen=True, slots=True)
class DeploymentRecord:
    """One deployment: one model served by its own prefill and decode pools.

    ``name`` is the routing key (unique). ``gpu`` is a GPU catalog name, ``tp_size`` the
    tensor-parallel degree of one instance, ``config`` the rest of the deployment settings.
    ``created_at`` survives upserts; ``updated_at`` is the time of the latest one.
    """

    name: str
    model: str
    gpu: str
    tp_size: int = 1
    config: JsonObject = field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None

    def __post_init__(self) -> None:
        _check_name(self.name, "name")
        _check_name(self.model, "model", max_len=256)
        _check_name(self.gpu, "gpu", max_len=64)
        _require(isinstance(self.tp_size, int) and self.tp_size >= 1, "tp_size",
                 "must be an integer >= 1")
        _check_json_object(self.config, "config")
        _check_time(self.created_at, "created_at")
        _check_time(self.updated_at, "updated_at")


@dataclass(frozen=True, slots=True)
class WorkerEventRecord:
    """A worker moved between lifecycle states. ``from_state`` is None for its first state."""

    worker_id: str
    deployment: str
    role: WorkerRole
    to_state: WorkerState
    from_state: WorkerState | None = None
    reason: str = ""
    at: datetime | None = None

    def __post_init__(self) -> None:
        _check_name(self.worker_id, "worker_id")
        _check_name(self.deployment, "deployment")
        _require(isinstance(self.role, WorkerRole), "role", "must be a WorkerRole")
        _require(isinstance(self.to_state, WorkerState), "to_state", "must be a WorkerState")
        _require(self.from_state is None or isinstance(self.from_state, WorkerState),
                 "from_state", "must be None or a WorkerState")
        _check_time(self.at, "at")


@dataclass(frozen=True, slots=True)
class CapacityPlanRecord:
    """A planner result with everything it was computed from.

    The headline outputs are columns (queryable); ``outputs`` holds the rest of the plan
    (per-pool detail, queueing estimates). ``local_prefill_threshold_tokens``: prompts with at
    most this many uncached tokens prefill on the decode worker; 0 means always remote.
    """

    deployment: str
    num_prefill_instances: int
    num_decode_instances: int
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    local_prefill_threshold_tokens: int
    inputs: JsonObject
    outputs: JsonObject = field(default_factory=dict)
    created_at: datetime | None = None

    def __post_init__(self) -> None:
        _check_name(self.deployment, "deployment")
        _check_count(self.num_prefill_instances, "num_prefill_instances")
        _check_count(self.num_decode_instances, "num_decode_instances")
        _check_ms(self.predicted_ttft_ms, "predicted_ttft_ms")
        _check_ms(self.predicted_tpot_ms, "predicted_tpot_ms")
        _check_count(self.local_prefill_threshold_tokens, "local_prefill_threshold_tokens")
        _check_json_object(self.inputs, "inputs")
        _check_json_object(self.outputs, "outputs")
        _check_time(self.created_at, "created_at")


@dataclass(frozen=True, slots=True)
class ScalingDecisionRecord:
    """One autoscaler decision for one pool, with the inputs and forecast it saw.

    ``is_dry_run`` decisions were computed and kept but not actuated.
    """

    deployment: str
    role: WorkerRole
    num_current_instances: int
    num_target_instances: int
    action: ScalingAction
    reason: str
    is_dry_run: bool = False
    inputs: JsonObject = field(default_factory=dict)
    forecast: JsonObject = field(default_factory=dict)
    at: datetime | None = None

    def __post_init__(self) -> None:
        _check_name(self.deployment, "deployment")
        _require(isinstance(self.role, WorkerRole), "role", "must be a WorkerRole")
        _check_count(self.num_current_instances, "num_current_instances")
        _check_count(self.num_target_instances, "num_target_instances")
        _require(isinstance(self.action, ScalingAction), "action", "must be a ScalingAction")
        _require(isinstance(self.is_dry_run, bool), "is_dry_run", "must be a bool")
        _check_json_object(self.inputs, "inputs")
        _check_json_object(self.forecast, "forecast")
        _check_time(self.at, "at")


@dataclass(frozen=True, slots=True)
class ThresholdDecisionRecord:
    """One local-prefill threshold decision of the governor for one deployment, with what it
    was computed from.

    ``threshold_tokens`` is what it put in force (``source``: the planner's value or an
    operator's pin); ``computed_tokens`` what the planner computed (None: it had nothing to
    compute from, e.g. an operator's pin or unpin between passes). ``is_published``: the
    routers were sent it (False when it was already in force, or in a dry run); ``version``:
    the hot state's version of that publication.
    """

    deployment: str
    threshold_tokens: int
    source: ThresholdSource
    reason: str
    computed_tokens: int | None = None
    is_published: bool = False
    version: int | None = None
    inputs: JsonObject = field(default_factory=dict)
    at: datetime | None = None

    def __post_init__(self) -> None:
        _check_name(self.deployment, "deployment")
        _check_count(self.threshold_tokens, "threshold_tokens")
        _require(isinstance(self.source, ThresholdSource), "source", "must be a ThresholdSource")
        if self.computed_tokens is not None:
            _check_count(self.computed_tokens, "computed_tokens")
        _require(isinstance(self.is_published, bool), "is_published", "must be a bool")
        _require(self.version is None or (isinstance(self.version, int) and self.version >= 1),
                 "version", "must be None or an integer >= 1")
        _check_json_object(self.inputs, "inputs")
        _check_time(self.at, "at")


@dataclass(frozen=True, slots=True)
class RequestWindowRecord:
    """Outcomes of the requests that finished in ``[window_start, window_start + window_s)``.

    ``num_ok`` finished without error; ``num_errors`` failed; the rest of ``num_requests`` were
    cancelled. The SLO miss counts are subsets of ``num_ok``, and one request may miss both.
    ``goodput_rps``: requests that met both SLOs, per second of window. Percentiles are None for
    a window without finished requests. ``num_misses_by_reason`` counts misses by ``MissReason``
    value (where the time went). A window is identified by (deployment, window_start, window_s,
    source): recording it again replaces it, so a retried write is harmless.
    """

    deployment: str
    window_start: datetime
    window_s: float
    num_requests: int
    num_ok: int
    num_ttft_slo_misses: int
    num_tpot_slo_misses: int
    num_errors: int
    goodput_rps: float
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p90_ms: float | None = None
    tpot_p99_ms: float | None = None
    num_misses_by_reason: Mapping[str, int] = field(default_factory=dict)
    source: str = ""
    """The router replica that counted these requests; windows of different sources add up."""

    def __post_init__(self) -> None:
        _check_name(self.deployment, "deployment")
        _require(isinstance(self.window_start, datetime), "window_start", "must be a datetime")
        _check_time(self.window_start, "window_start")
        _require(isinstance(self.window_s, (int, float)) and math.isfinite(self.window_s)
                 and self.window_s > 0, "window_s", "must be a finite number of seconds > 0")
        for name in ("num_requests", "num_ok", "num_ttft_slo_misses", "num_tpot_slo_misses",
                     "num_errors"):
            _check_count(getattr(self, name), name)
        _require(self.num_ok + self.num_errors <= self.num_requests, "num_requests",
                 "must be at least num_ok + num_errors")
        _require(self.num_ttft_slo_misses <= self.num_ok, "num_ttft_slo_misses",
                 "must be at most num_ok")
        _require(self.num_tpot_slo_misses <= self.num_ok, "num_tpot_slo_misses",
                 "must be at most num_ok")
        _check_seconds(self.goodput_rps, "goodput_rps")
        for name in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                     "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms"):
            _check_ms(getattr(self, name), name, is_optional=True)
        _require(isinstance(self.source, str) and len(self.source) <= 128, "source",
                 "must be a string of at most 128 characters")
        _check_json_object(self.num_misses_by_reason, "num_misses_by_reason")
        for reason, count in self.num_misses_by_reason.items():
            _check_count(count, f"num_misses_by_reason[{reason!r}]")


@dataclass(frozen=True, slots=True)
class TransferStatsRecord:
    """How one ticket's KV handoff went. (ticket_id, attempt) is its fencing token: recording
    the same token again is ignored, so a retried batch is harmless.

    ``transfer_s`` is first byte to last byte; ``exposed_s`` the part of it not hidden behind
    prefill compute (what the handoff added to TTFT); ``prefill_compute_s`` the prefill itself.
    ``outcome`` is the ticket's terminal state. ``prefill_worker_id`` is "" for local prefill.
    """

    ticket_id: str
    attempt: int
    deployment: str
    prefill_worker_id: str
    decode_worker_id: str
    num_blocks: int
    num_bytes: int
    transfer_s: float
    exposed_s: float
    prefill_compute_s: float
    outcome: TicketState
    at: datetime | None = None

    def __post_init__(self) -> None:
        _check_name(self.ticket_id, "ticket_id", max_len=64)
        _require(isinstance(self.attempt, int) and self.attempt >= 1, "attempt",
                 "must be an integer >= 1")
        _check_name(self.deployment, "deployment")
        _require(isinstance(self.prefill_worker_id, str) and len(self.prefill_worker_id) <= 128,
                 "prefill_worker_id", "must be a string of at most 128 characters")
        _check_name(self.decode_worker_id, "decode_worker_id")
        _check_count(self.num_blocks, "num_blocks")
        _check_count(self.num_bytes, "num_bytes")
        for name in ("transfer_s", "exposed_s", "prefill_compute_s"):
            _check_seconds(getattr(self, name), name)
        _require(isinstance(self.outcome, TicketState) and self.outcome.is_terminal, "outcome",
                 "must be a terminal TicketState (done, aborted, expired)")
        _check_time(self.at, "at")


@dataclass(frozen=True, slots=True)
class ExpertPlacementRecord:
    """An MoE expert placement (EPLB output) for one deployment.

    ``placement`` is the EPLB result as a JSON object (for example the physical-slot to
    logical-expert map per layer and the number of ranks). ``balancedness`` is mean over max GPU
    load under the placement, in (0, 1]; 1 is perfect balance. ``version`` counts up per
    deployment; None asks the repository for the next one.
    """

    deployment: str
    placement: JsonObject
    balancedness: float
    version: int | None = None
    created_at: datetime | None = None

    def __post_init__(self) -> None:
        _check_name(self.deployment, "deployment")
        _check_json_object(self.placement, "placement")
        _require(isinstance(self.balancedness, (int, float)) and 0 < self.balancedness <= 1,
                 "balancedness", "must be in (0, 1]")
        _require(self.version is None or (isinstance(self.version, int) and self.version >= 1),
                 "version", "must be None or an integer >= 1")
        _check_time(self.created_at, "created_at")
