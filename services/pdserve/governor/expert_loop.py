"""The governor's expert-placement loop: EPLB as a service for MoE prefill and decode pools.

Data path. MoE workers count the tokens routed to every (layer, expert) and send the counts in
heartbeats (``HeartbeatRequest.expert_token_counts``, every ``expert_report_interval_s``); the pool
manager appends each report to its pool's queue in the hot-state store beside the worker records
(``pdserve.state.expert_loads``); this loop drains the queues. The governor never talks to the pool
manager for loads and every pool-manager replica can take heartbeats.

Per pool (one deployment's prefill or decode workers) the loop, every ``tick_s``, folds the new
counts into the decayed load estimate, decides whether to re-plan and plans (the pure policy:
``pdserve.capacity.expert_policy``; a re-plan that changes nothing issues no version), then:

1. **versions** the placement: one more than the highest of the repository's latest and what the
   workers report in force, stored in the durable store *before* anything is rolled out, so a
   restarted governor (or its standby) never issues a version twice;
2. **rolls it out** to every worker of the pool that has not acknowledged it:
   ``ApplyExpertPlacement`` to each worker on its own, concurrently, each call under a
   deadline. Routing does not pause: a worker swaps the new map in between two forward passes
   and keeps serving, and workers that fail (or join later, or restart) are retried on the next
   tick until each acknowledges.

Pools are keyed by deployment and role (``placement_key``). The instance's GPUs
(``WorkerInfo.num_gpus``) are the expert-parallel group a placement spreads over; every worker
of a pool gets the same placement (they serve the same traffic mix); a pool whose workers differ
in shape is placed for the most common one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pdserve.api.v1 import worker_pb2
from pdserve.capacity.eplb_placement import ExpertPlacement, gpu_balancedness
from pdserve.capacity.expert_policy import (
    ExpertPolicy,
    LoadEstimate,
    ReplanInputs,
    fold_reports,
    plan_pool,
    pool_topology,
    replan_reason,
)
from pdserve.capacity.expert_versions import PlacementVersion, placement_key
from pdserve.common.errors import AlreadyExistsError, InvalidArgumentError, PdserveError
from pdserve.common.metrics import counter, gauge
from pdserve.common.types import Clock, WorkerRecord, WorkerRole, WorkerState
from pdserve.governor.expert_client import WorkerPlacementClient
from pdserve.governor.expert_convert import WorkerInstance, apply_request, instance_from_spec
from pdserve.perf.catalog import get_model
from pdserve.state.expert_loads import ExpertLoadStore
from pdserve.state.interfaces import WorkerStore

logger = logging.getLogger(__name__)

_BALANCEDNESS = gauge(
    "governor", "expert_balancedness", "ratio",
    "Mean over MoE layers of mean/max GPU load of the expert placement in force, under the "
    "governor's load estimate", ["deployment", "role"])
_MOVED = counter(
    "governor", "expert_copies_moved", "experts",
    "Expert weight copies the issued placements moved (slots whose expert changed)",
    ["deployment", "role"])
_ACKNOWLEDGED = gauge(
    "governor", "expert_placement_acknowledged", "workers",
    "Workers that acknowledged the expert placement in force", ["deployment", "role"])

_SERVING_STATES = frozenset({WorkerState.REGISTERING, WorkerState.LOADING, WorkerState.READY,
                             WorkerState.DRAINING})
"""Workers a placement is rolled out to: every one that serves or is about to."""


class PlacementRepository(Protocol):
    """The durable store of placements (``pdserve.db.Repository`` implements it)."""

    def record_expert_placement(self, record: Any) -> Any: ...

    def latest_expert_placement(self, deployment: str) -> Any: ...


@dataclass(frozen=True, slots=True, eq=False)
class PoolPlacementStatus:
    """A pool's placement in force and how far its roll-out got. ``balancedness`` ``[layers]``
    is under the current load estimate when there is one, else under the planning loads."""

    deployment: str
    role: WorkerRole
    current: PlacementVersion | None
    balancedness: np.ndarray
    num_workers: int
    acknowledged: dict[str, int]
    """Worker id -> version it acknowledged (only workers serving now)."""
    errors: dict[str, str]
    last_error: str

    @property
    def version(self) -> int:
        return self.current.version if self.current is not None else 0

    @property
    def is_rolled_out(self) -> bool:
        """Every serving worker acknowledged the version in force."""
        return self.current is not None and len(self.acknowledged) == self.num_workers and all(
            v >= self.current.version for v in self.acknowledged.values())


@dataclass(slots=True)
class _Pool:
    deployment: str
    role: WorkerRole
    estimate: LoadEstimate | None = None
    current: PlacementVersion | None = None
    version: int = 0
    """Highest version known issued (may exceed ``current`` if a stored one was unreadable)."""
    last_plan_s: float = -math.inf
    acks: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Worker id -> (its registration time, version acknowledged): a re-registered worker (a
    restart) has to acknowledge again."""
    errors: dict[str, str] = field(default_factory=dict)
    num_workers: int = 0
    shape: tuple[int, str] | None = None
    """(GPUs, model) of the instances placed for."""
    last_error: str = ""
    request: worker_pb2.ApplyExpertPlacementRequest | None = None


def _expert_bytes(model_name: str) -> int:
    """Bytes of one routed expert's weights in one layer (0 when the model is not catalogued)."""
    try:
        model = get_model(model_name)
    except PdserveError:
        return 0
    return int(model.num_params_per_expert * model.dtype_bytes)


class ExpertPlacementGovernor:
    """Owns every pool's load estimate, placement and roll-out (one instance per governor)."""

    def __init__(self, policy: ExpertPolicy, workers: WorkerStore, loads: ExpertLoadStore,
                 client: WorkerPlacementClient, clock: Clock,
                 repository: PlacementRepository | None = None) -> None:
        self.policy = policy
        self._workers = workers
        self._loads = loads
        self._client = client
        self._clock = clock
        self._repository = repository
        self._pools: dict[tuple[str, WorkerRole], _Pool] = {}
        self._instances: dict[tuple[str, float], tuple[int, str]] = {}
        """(worker id, registration time) -> (GPUs, model), asked of workers whose record
        carries no description."""
        self._lock = asyncio.Lock()
        """One pass at a time."""
        self._open_lock = asyncio.Lock()
        """One restore per pool, whether a pass or a query opens it."""

    # -- queries ------------------------------------------------------------------------------

    async def status(self, deployment: str, role: WorkerRole) -> PoolPlacementStatus:
        """The pool's placement in force (read from the durable store after a restart)."""
        pool = await self._pool(deployment, role)
        balance = np.zeros(0)
        if pool.current is not None:
            balance = pool.current.balancedness
            if pool.estimate is not None and _is_compatible(pool.current.placement,
                                                            pool.estimate.shape):
                balance = gpu_balancedness(pool.current.placement, pool.estimate.token_loads)
        acknowledged = {worker_id: version for worker_id, (_, version) in pool.acks.items()}
        return PoolPlacementStatus(deployment, role, pool.current, balance, pool.num_workers,
                                   acknowledged, dict(pool.errors), pool.last_error)

    def estimate(self, deployment: str, role: WorkerRole) -> LoadEstimate | None:
        pool = self._pools.get((deployment, role))
        return pool.estimate if pool is not None else None

    # -- the loop -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # keep placing through store hiccups
                logger.exception("expert placement pass failed")
            try:
                await asyncio.wait_for(stop.wait(), self.policy.tick_s)
            except TimeoutError:
                pass

    async def tick(self) -> None:
        """One pass over every pool that reported or was seen before."""
        async with self._lock:
            keys = set(await self._loads.pools()) | set(self._pools)
            addresses: set[str] = set()
            for deployment, role in sorted(keys):
                addresses |= await self._tick_pool(deployment, role)
            await self._client.retain(addresses)

    async def _tick_pool(self, deployment: str, role: WorkerRole) -> set[str]:
        pool = await self._pool(deployment, role)
        now_s = self._clock()
        reports = await self._loads.drain(deployment, role)
        pool.estimate, num_ignored = fold_reports(pool.estimate, reports, now_s,
                                                  self.policy.half_life_s)
        if num_ignored:
            logger.warning("%s/%s: %d expert-load reports of another shape left out",
                           deployment, role, num_ignored)
        records = [r for r in await self._workers.list(deployment, role)
                   if r.state in _SERVING_STATES]
        instances = await self._describe(records)
        targets = self._same_instances(pool, records, instances)
        pool.num_workers = len(targets)
        live = {r.worker_id for r in targets}
        pool.acks = {w: ack for w, ack in pool.acks.items() if w in live}
        pool.errors = {w: e for w, e in pool.errors.items() if w in live}
        if targets and pool.estimate is not None:
            await self._maybe_replan(pool, targets, now_s)
        if targets and pool.current is not None:
            await self._roll_out(pool, targets)
        self._export(pool)
        return {r.address for r in targets}

    def _export(self, pool: _Pool) -> None:
        labels = {"deployment": pool.deployment, "role": pool.role.value}
        _ACKNOWLEDGED.labels(**labels).set(sum(
            1 for _, version in pool.acks.values()
            if pool.current is not None and version >= pool.current.version))
        if pool.current is not None and pool.estimate is not None and _is_compatible(
                pool.current.placement, pool.estimate.shape):
            balance = gpu_balancedness(pool.current.placement, pool.estimate.token_loads)
            _BALANCEDNESS.labels(**labels).set(float(balance.mean()))

    async def _describe(self, records: list[WorkerRecord]) -> dict[str, tuple[int, str]]:
        """(GPUs, model) per worker id: from the record, else from the worker itself (once per
        registration). Workers that cannot be asked now are left out of this pass."""
        shapes: dict[str, tuple[int, str]] = {}
        unknown = []
        for record in records:
            shape = instance_from_spec(record) or self._instances.get(
                (record.worker_id, record.registered_s))
            if shape is not None:
                shapes[record.worker_id] = shape
            else:
                unknown.append(record)
        answers = await asyncio.gather(*(self._client.status(r.address) for r in unknown),
                                       return_exceptions=True)
        live = {(r.worker_id, r.registered_s) for r in records}
        self._instances = {k: v for k, v in self._instances.items() if k in live}
        for record, answer in zip(unknown, answers, strict=True):
            if isinstance(answer, WorkerInstance):
                shape = (answer.num_gpus, answer.model)
                self._instances[(record.worker_id, record.registered_s)] = shape
                shapes[record.worker_id] = shape
        return shapes

    def _same_instances(self, pool: _Pool, records: list[WorkerRecord],
                        shapes: dict[str, tuple[int, str]]) -> list[WorkerRecord]:
        """The workers of the most common instance shape (GPUs, model); a placement fits one."""
        known = [r for r in records if r.worker_id in shapes]
        if not known:
            return []
        counts = collections.Counter(shapes[r.worker_id] for r in known)
        shape, _ = counts.most_common(1)[0]
        if len(counts) > 1:
            logger.warning("%s/%s: workers of %d instance shapes; placing for %s GPUs of %s",
                           pool.deployment, pool.role, len(counts), shape[0], shape[1])
        pool.shape = shape
        return [r for r in known if shapes[r.worker_id] == shape]

    async def _maybe_replan(self, pool: _Pool, targets: list[WorkerRecord], now_s: float) -> None:
        assert pool.estimate is not None
        assert pool.shape is not None
        num_gpus, model_name = pool.shape
        estimate = pool.estimate.at(now_s, self.policy.half_life_s)
        loads = estimate.token_loads
        try:
            topology = pool_topology(num_gpus, loads.shape[1], pool.role, self.policy)
        except InvalidArgumentError as exc:
            _cannot_place(pool, exc)
            return
        current = pool.current.placement if pool.current is not None else None
        # The placement in force, if it still fits this topology and load shape.
        fitting = current if (current is not None and current.topology == topology
                              and _is_compatible(current, loads.shape)) else None
        is_current = fitting is not None
        balance = float(gpu_balancedness(fitting, loads).mean()) if fitting is not None else 0.0
        reason = replan_reason(ReplanInputs(
            now_s=now_s, num_tokens_per_layer=estimate.tokens_per_layer(),
            has_placement=current is not None, is_topology_current=is_current,
            last_plan_s=pool.last_plan_s, balancedness=balance), self.policy)
        if reason is None:
            return
        try:
            outcome = await asyncio.to_thread(plan_pool, fitting, loads, topology,
                                              _expert_bytes(model_name),
                                              self.policy.balance_tolerance)
        except InvalidArgumentError as exc:
            _cannot_place(pool, exc)
            return
        pool.last_plan_s = now_s
        if is_current and outcome.num_experts_moved == 0:
            return
        planned = PlacementVersion(0, outcome.placement, reason.value, outcome.num_experts_moved,
                                   outcome.bytes_moved,
                                   gpu_balancedness(outcome.placement, loads))
        await self._issue(pool, planned, targets)

    async def _issue(self, pool: _Pool, planned: PlacementVersion,
                     targets: list[WorkerRecord]) -> None:
        """Give ``planned`` the next version, store it, and make it the one in force."""
        version = await self._next_version(pool, targets)
        issued = PlacementVersion(version, planned.placement, planned.reason,
                                  planned.num_experts_moved, planned.bytes_moved,
                                  planned.balancedness)
        if self._repository is not None:
            from pdserve.db.records import ExpertPlacementRecord

            mean = float(np.clip(planned.balancedness.mean(), 1e-9, 1.0))
            record = ExpertPlacementRecord(placement_key(pool.deployment, pool.role),
                                           issued.to_json(pool.role), mean, version=version)
            try:
                await asyncio.to_thread(self._repository.record_expert_placement, record)
            except AlreadyExistsError:
                # Another governor issued this version first: adopt the stored placement.
                logger.warning("%s/%s: placement version %d exists; reloading", pool.deployment,
                               pool.role, version)
                await self._restore(pool)
                return
            except Exception as exc:  # noqa: BLE001 - never roll out an unrecorded version
                pool.last_error = f"placement not stored: {exc}"
                logger.warning("%s/%s: placement version %d not stored (%s); not rolled out",
                               pool.deployment, pool.role, version, exc)
                return
        pool.current, pool.version, pool.request, pool.last_error = issued, version, None, ""
        _MOVED.labels(deployment=pool.deployment, role=pool.role.value).inc(
            issued.num_experts_moved)
        logger.info("%s/%s: expert placement v%d (%s): %d slots move, balancedness %.4f",
                    pool.deployment, pool.role, version, issued.reason, issued.num_experts_moved,
                    float(issued.balancedness.mean()))

    async def _next_version(self, pool: _Pool, targets: list[WorkerRecord]) -> int:
        """One more than any version stored or in force on a worker (a worker ignores versions at
        or below its own, so a version must never be reused, whatever was lost)."""
        highest = pool.version
        if self._repository is not None:
            latest = await asyncio.to_thread(self._repository.latest_expert_placement,
                                             placement_key(pool.deployment, pool.role))
            if latest is not None:
                highest = max(highest, int(latest.version))
        answers = await asyncio.gather(*(self._client.status(r.address) for r in targets),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, WorkerInstance):
                highest = max(highest, answer.version)
        return highest + 1

    async def _roll_out(self, pool: _Pool, targets: list[WorkerRecord]) -> None:
        assert pool.current is not None
        version = pool.current.version
        pending = [r for r in targets if not _has_acknowledged(pool, r, version)]
        if not pending:
            return
        if pool.request is None or pool.request.version != version:
            pool.request = apply_request(pool.current.placement, version)
        request = pool.request
        results = await asyncio.gather(*(self._client.apply(r.address, request) for r in pending),
                                       return_exceptions=True)
        for record, result in zip(pending, results, strict=True):
            if isinstance(result, int) and result >= version:
                pool.acks[record.worker_id] = (record.registered_s, result)
                pool.errors.pop(record.worker_id, None)
            elif isinstance(result, BaseException):
                message = result.message if isinstance(result, PdserveError) else repr(result)
                pool.errors[record.worker_id] = message
                logger.warning("%s/%s: worker %s did not take placement v%d: %s",
                               pool.deployment, pool.role, record.worker_id, version, message)
            else:
                pool.errors[record.worker_id] = f"acknowledged version {result}, expected {version}"

    # -- pools and restore --------------------------------------------------------------------

    async def _pool(self, deployment: str, role: WorkerRole) -> _Pool:
        pool = self._pools.get((deployment, role))
        if pool is not None:
            return pool
        async with self._open_lock:
            pool = self._pools.get((deployment, role))
            if pool is None:
                pool = _Pool(deployment, role)
                await self._restore(pool)
                self._pools[(deployment, role)] = pool
        return pool

    async def _restore(self, pool: _Pool) -> None:
        """The latest stored placement becomes the one in force (after a restart, or when a
        peer governor issued a version). Its plan time counts as now: a restart is no reason to
        re-plan at once."""
        if self._repository is None:
            return
        try:
            record = await asyncio.to_thread(self._repository.latest_expert_placement,
                                             placement_key(pool.deployment, pool.role))
        except Exception as exc:  # noqa: BLE001 - the durable store is down: start empty
            pool.last_error = f"stored placement unreadable: {exc}"
            logger.warning("%s/%s: could not read the stored placement: %s", pool.deployment,
                           pool.role, exc)
            return
        if record is None:
            return
        pool.version = max(pool.version, int(record.version))
        try:
            pool.current = PlacementVersion.from_json(int(record.version), dict(record.placement))
        except (PdserveError, KeyError, TypeError, ValueError) as exc:
            pool.last_error = f"stored placement v{record.version} unreadable: {exc}"
            logger.warning("%s/%s: %s", pool.deployment, pool.role, pool.last_error)
            return
        pool.request = None
        pool.last_plan_s = self._clock()


def _has_acknowledged(pool: _Pool, record: WorkerRecord, version: int) -> bool:
    """The worker acknowledged ``version`` (or a newer one) since it last registered."""
    ack = pool.acks.get(record.worker_id)
    return ack is not None and ack[0] == record.registered_s and ack[1] >= version


def _cannot_place(pool: _Pool, exc: InvalidArgumentError) -> None:
    """The settings or the instance shape rule out any placement: say so, keep what runs."""
    pool.last_error = exc.message
    logger.warning("%s/%s: cannot place experts: %s", pool.deployment, pool.role, exc.message)


def _is_compatible(placement: ExpertPlacement, shape: tuple[int, int]) -> bool:
    return placement.num_layers == shape[0] and placement.num_experts == shape[1]

