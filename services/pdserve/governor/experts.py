"""The governor's expert-placement loop: EPLB as a service for MoE prefill and decode pools.

Data path. MoE workers count the tokens routed to every (layer, expert) and send the counts in
heartbeats (``HeartbeatRequest.expert_token_counts``, every ``expert_report_interval_s``); the pool
manager appends each report to its pool's queue in the hot-state store beside the worker records
(``pdserve.state.expert_loads``); this loop drains the queues. The governor never talks to the pool
manager for loads and every pool-manager replica can take heartbeats.

Per pool (one deployment's prefill or decode workers) the loop, every ``tick_s``:

1. folds the new counts into a **decayed load estimate**: a token counted ``a`` seconds ago weighs
   ``2 ** (-a / half_life_s)`` (counts are stamped when drained, on the governor's clock);
2. **decides** whether to re-plan (``replan_reason``, pure): a first plan once the estimate holds
   ``min_tokens_per_layer``; the instance shape changed; ``replan_period_s`` passed since the last
   plan; or the mean GPU balancedness (mean / max GPU load) of the placement in force fell under
   ``min_balancedness``, at most once per ``min_replan_interval_s``;
3. **plans**: from scratch the first time (``plan_expert_placement``), afterwards with the
   migration-aware re-planner (``replan_with_migration``), which reaches near the best balance
   while changing as few slots (expert weights to load) as it can; a re-plan that changes nothing
   issues no version;
4. **versions** the placement: one more than the highest of the repository's latest and what the
   workers report in force, stored in the durable store *before* anything is rolled out, so a
   restarted governor (or its standby) never issues a version twice;
5. **rolls it out** to every worker of the pool that has not acknowledged it: ``ApplyExpertPlacement``
   to each worker on its own, concurrently, each call under a deadline. Routing does not pause:
   a worker swaps the new map in between two forward passes and keeps serving, and workers that
   fail (or join later, or restart) are retried on the next tick until each acknowledges.

Pools are keyed by deployment and role; the durable key and the ``GetExpertPlacement``
deployment field are ``<deployment>`` for the decode pool and ``<deployment>:prefill`` for the
prefill pool. The instance's GPUs (``WorkerInfo.num_gpus``) are the expert-parallel group a
placement spreads over; every worker of a pool gets the same placement (they serve the same
traffic mix). Decode pools use the global policy; prefill pools the hierarchical one when
``num_groups`` > 1 divides into the instance's nodes.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import governor_pb2, worker_pb2, worker_pb2_grpc
from pdserve.capacity.eplb import (
    ExpertPlacement,
    PlacementPolicy,
    PlacementTopology,
    gpu_balancedness,
    plan_expert_placement,
    replan_with_migration,
)
from pdserve.common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    PdserveError,
    UnavailableError,
)
from pdserve.common.grpc_client import error_from_rpc_error
from pdserve.common.metrics import counter, gauge
from pdserve.common.types import Clock, WorkerRecord, WorkerRole, WorkerState
from pdserve.perf.catalog import get_model
from pdserve.state.expert_loads import ExpertLoadReport, ExpertLoadStore, expert_load_store_for
from pdserve.state.interfaces import StateBackend, WorkerStore

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


# -- pure policy ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExpertPolicy:
    """How the placement loop decides. Seconds throughout; balancedness in [0, 1]."""

    half_life_s: float = 300.0
    replan_period_s: float = 600.0
    min_balancedness: float = 0.85
    min_replan_interval_s: float = 60.0
    min_tokens_per_layer: float = 10_000.0
    balance_tolerance: float = 0.01
    slots_per_gpu: int = 0
    """0: the fewest that hold every expert, plus one when that leaves no slot redundant."""
    gpus_per_node: int = 8
    num_groups: int = 1
    tick_s: float = 1.0
    rollout_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("half_life_s", "replan_period_s", "tick_s", "rollout_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"{name}: must be a finite number > 0, got {value!r}",
                                           field=name)
        if not 0.0 <= self.min_balancedness <= 1.0:
            raise InvalidArgumentError("min_balancedness: must be in [0, 1]",
                                       field="min_balancedness")
        if not 0.0 <= self.balance_tolerance < 1.0:
            raise InvalidArgumentError("balance_tolerance: must be in [0, 1)",
                                       field="balance_tolerance")
        if self.min_replan_interval_s < 0 or self.min_tokens_per_layer < 0:
            raise InvalidArgumentError("min_replan_interval_s, min_tokens_per_layer: must be >= 0",
                                       field="min_replan_interval_s")
        if self.slots_per_gpu < 0 or self.gpus_per_node < 1 or self.num_groups < 1:
            raise InvalidArgumentError(
                "slots_per_gpu >= 0, gpus_per_node >= 1 and num_groups >= 1 required",
                field="slots_per_gpu")

    @classmethod
    def from_settings(cls, settings: object) -> ExpertPolicy:
        """From ``GovernorSettings``; the defaults for any other settings object (the one-machine
        stack passes its own)."""
        from pdserve.governor.settings import GovernorSettings

        if not isinstance(settings, GovernorSettings):
            return cls()
        return cls(
            half_life_s=settings.expert_half_life_s,
            replan_period_s=settings.expert_replan_period_s,
            min_balancedness=settings.expert_min_balancedness,
            min_replan_interval_s=settings.expert_min_replan_interval_s,
            min_tokens_per_layer=settings.expert_min_tokens_per_layer,
            balance_tolerance=settings.expert_balance_tolerance,
            slots_per_gpu=settings.expert_slots_per_gpu,
            gpus_per_node=settings.expert_gpus_per_node,
            num_groups=settings.expert_num_groups,
            tick_s=settings.expert_tick_s,
            rollout_timeout_s=settings.expert_rollout_timeout_s,
        )


def decay_factor(elapsed_s: float, half_life_s: float) -> float:
    """Weight of a count ``elapsed_s`` old: ``2 ** (-elapsed_s / half_life_s)`` (1.0 for a
    negative age, i.e. a clock that stepped back)."""
    return 0.5 ** (max(0.0, elapsed_s) / half_life_s)


@dataclass(frozen=True, slots=True, eq=False)
class LoadEstimate:
    """Decayed tokens per ``[num_layers, num_experts]`` as of ``as_of_s`` (governor clock)."""

    token_loads: np.ndarray
    as_of_s: float

    @property
    def shape(self) -> tuple[int, int]:
        return self.token_loads.shape  # type: ignore[return-value]

    def at(self, now_s: float, half_life_s: float) -> LoadEstimate:
        """The estimate decayed to ``now_s``."""
        factor = decay_factor(now_s - self.as_of_s, half_life_s)
        return LoadEstimate(self.token_loads * factor, max(now_s, self.as_of_s))

    def add(self, token_counts: np.ndarray, now_s: float, half_life_s: float) -> LoadEstimate:
        """Decay to ``now_s``, then add counts seen at ``now_s`` (same shape)."""
        decayed = self.at(now_s, half_life_s)
        return LoadEstimate(decayed.token_loads + token_counts, decayed.as_of_s)

    def tokens_per_layer(self) -> float:
        """Mean decayed tokens per layer (how much evidence the estimate holds)."""
        return float(self.token_loads.sum(axis=1).mean())


def fold_reports(estimate: LoadEstimate | None, reports: Sequence[ExpertLoadReport], now_s: float,
                 half_life_s: float) -> tuple[LoadEstimate | None, int]:
    """Add the reports drained at ``now_s`` to ``estimate``; returns the new estimate and the
    number of reports left out. Reports of another shape than the newest report's are left out;
    when the newest shape differs from the estimate's (the model or its MoE layers changed) the
    estimate starts again from the reports."""
    if not reports:
        return estimate, 0
    shape = reports[-1].matrix().shape
    matching = [r.matrix() for r in reports if r.matrix().shape == shape]
    total = np.sum(matching, axis=0, dtype=np.float64)
    if estimate is None or estimate.shape != shape:
        return LoadEstimate(total, now_s), len(reports) - len(matching)
    return estimate.add(total, now_s, half_life_s), len(reports) - len(matching)


class ReplanReason(enum.StrEnum):
    """Why the loop planned a new placement."""

    INITIAL = "initial"
    TOPOLOGY = "topology"
    PERIOD = "period"
    IMBALANCE = "imbalance"


@dataclass(frozen=True, slots=True)
class ReplanInputs:
    """What ``replan_reason`` looks at. ``balancedness`` is the mean over layers of the placement
    in force under the current estimate (ignored without a placement)."""

    now_s: float
    num_tokens_per_layer: float
    has_placement: bool
    is_topology_current: bool
    last_plan_s: float
    balancedness: float


def replan_reason(inputs: ReplanInputs, policy: ExpertPolicy) -> ReplanReason | None:
    """Pure: whether to plan now, and why (see the module docstring)."""
    if inputs.num_tokens_per_layer < policy.min_tokens_per_layer:
        return None
    if not inputs.has_placement:
        return ReplanReason.INITIAL
    if not inputs.is_topology_current:
        return ReplanReason.TOPOLOGY
    elapsed_s = inputs.now_s - inputs.last_plan_s
    if elapsed_s >= policy.replan_period_s:
        return ReplanReason.PERIOD
    if inputs.balancedness < policy.min_balancedness and elapsed_s >= policy.min_replan_interval_s:
        return ReplanReason.IMBALANCE
    return None


def default_slots_per_gpu(num_experts: int, num_gpus: int) -> int:
    """The fewest slots per GPU that hold every expert, plus one when that leaves none redundant
    (DeepSeek-V3's 256 experts: 1 on 320 GPUs, 2 on 144, 9 on 32). One GPU needs no copies."""
    if num_gpus <= 1:
        return num_experts
    per_gpu = -(-num_experts // num_gpus)
    return per_gpu + 1 if per_gpu * num_gpus == num_experts else per_gpu


def pool_topology(num_gpus: int, num_experts: int, role: WorkerRole,
                  policy: ExpertPolicy) -> PlacementTopology:
    """The placement topology of one instance of ``num_gpus`` GPUs. Raises
    ``InvalidArgumentError`` naming the constraint the settings break."""
    slots_per_gpu = policy.slots_per_gpu or default_slots_per_gpu(num_experts, num_gpus)
    is_whole_nodes = num_gpus >= policy.gpus_per_node and num_gpus % policy.gpus_per_node == 0
    num_nodes = num_gpus // policy.gpus_per_node if is_whole_nodes else 1
    groups = policy.num_groups
    if (role is WorkerRole.PREFILL and groups > 1 and num_experts % groups == 0
            and groups % num_nodes == 0):
        return PlacementTopology(slots_per_gpu * num_gpus, num_gpus, num_nodes, groups,
                                 PlacementPolicy.HIERARCHICAL)
    return PlacementTopology(slots_per_gpu * num_gpus, num_gpus, num_nodes, 1,
                             PlacementPolicy.GLOBAL)


@dataclass(frozen=True, slots=True)
class PlanOutcome:
    """A new placement and what rolling it out moves (slots whose expert changes)."""

    placement: ExpertPlacement
    num_experts_moved: int
    bytes_moved: int


def plan_pool(current: ExpertPlacement | None, loads: np.ndarray, topology: PlacementTopology,
              expert_bytes: int, balance_tolerance: float) -> PlanOutcome:
    """Pure: a migration-aware re-plan of ``current`` when it has this topology and shape, else
    a plan from scratch (every slot counts as moved)."""
    if (current is not None and current.topology == topology
            and current.slot_to_expert.shape[0] == loads.shape[0]
            and current.num_experts == loads.shape[1]):
        plan = replan_with_migration(current, loads, expert_bytes, balance_tolerance)
        return PlanOutcome(plan.placement, plan.num_experts_moved, plan.bytes_moved)
    placement = plan_expert_placement(loads, topology)
    num_moved = int(placement.slot_to_expert.size)
    return PlanOutcome(placement, num_moved, num_moved * expert_bytes)


def placement_key(deployment: str, role: WorkerRole) -> str:
    """Durable key and ``GetExpertPlacement`` name of a pool."""
    return deployment if role is WorkerRole.DECODE else f"{deployment}:{role.value}"


def parse_placement_key(key: str) -> tuple[str, WorkerRole]:
    """``"m"`` and ``"m:decode"`` -> decode pool of ``m``; ``"m:prefill"`` -> its prefill pool."""
    if not key:
        raise InvalidArgumentError("deployment: required", field="deployment")
    deployment, sep, role = key.rpartition(":")
    if sep and role in (WorkerRole.PREFILL.value, WorkerRole.DECODE.value) and deployment:
        return deployment, WorkerRole(role)
    return key, WorkerRole.DECODE


# -- versions and their durable form ----------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class PlacementVersion:
    """One issued placement of a pool. ``balancedness`` ``[layers]`` under the loads it was
    planned for."""

    version: int
    placement: ExpertPlacement
    reason: str
    num_experts_moved: int
    bytes_moved: int
    balancedness: np.ndarray

    def to_json(self, role: WorkerRole) -> dict[str, Any]:
        topology = self.placement.topology
        return {
            "role": role.value, "num_layers": self.placement.num_layers,
            "num_experts": self.placement.num_experts, "num_slots": topology.num_slots,
            "num_gpus": topology.num_gpus, "num_nodes": topology.num_nodes,
            "num_groups": topology.num_groups, "policy": topology.policy.value,
            "slot_to_expert": self.placement.slot_to_expert.reshape(-1).tolist(),
            "reason": self.reason, "num_experts_moved": self.num_experts_moved,
            "bytes_moved": self.bytes_moved,
            "balancedness": [round(float(b), 6) for b in self.balancedness],
        }

    @classmethod
    def from_json(cls, version: int, doc: dict[str, Any]) -> PlacementVersion:
        """Raises ``InvalidArgumentError`` (or ``KeyError``/``ValueError``) for a bad document."""
        topology = PlacementTopology(int(doc["num_slots"]), int(doc["num_gpus"]),
                                     int(doc["num_nodes"]), int(doc["num_groups"]),
                                     PlacementPolicy(doc["policy"]))
        slot_map = np.asarray(doc["slot_to_expert"], dtype=np.int64).reshape(
            int(doc["num_layers"]), topology.num_slots)
        placement = ExpertPlacement.from_slot_map(slot_map, int(doc["num_experts"]), topology)
        return cls(version, placement, str(doc.get("reason", "")),
                   int(doc.get("num_experts_moved", 0)), int(doc.get("bytes_moved", 0)),
                   np.asarray(doc.get("balancedness", []), dtype=np.float64))


class PlacementRepository(Protocol):
    """The durable store of placements (``pdserve.db.Repository`` implements it)."""

    def record_expert_placement(self, record: Any) -> Any: ...

    def latest_expert_placement(self, deployment: str) -> Any: ...


# -- worker calls -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerInstance:
    """What a worker says about itself: the GPUs its experts spread over, its model, and the
    placement version in force."""

    num_gpus: int
    model: str
    version: int


def instance_from_info(info: pb.WorkerInfo, version: int = 0) -> WorkerInstance:
    return WorkerInstance(max(1, info.num_gpus or info.tp_size or 1), info.model, version)


class WorkerPlacementClient(Protocol):
    """The calls the loop makes to workers; errors are ``PdserveError``s."""

    async def apply(self, address: str, request: worker_pb2.ApplyExpertPlacementRequest) -> int:
        """The version the worker acknowledges as in force."""
        ...

    async def status(self, address: str) -> WorkerInstance: ...

    async def retain(self, addresses: Iterable[str]) -> None:
        """Forget connections to every other address."""
        ...

    async def close(self) -> None: ...


class GrpcWorkerPlacementClient:
    """``WorkerPlacementClient`` over gRPC, one channel per worker address."""

    def __init__(self, settings: Any = None, timeout_s: float = 5.0) -> None:
        self._settings = settings
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerAgentServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            if self._settings is not None:
                from pdserve.common.grpc_client import open_channel

                channel = open_channel(address, self._settings)
            else:
                channel = grpc.aio.insecure_channel(address)
            self._channels[address] = channel
        return worker_pb2_grpc.WorkerAgentServiceStub(channel)

    async def apply(self, address: str, request: worker_pb2.ApplyExpertPlacementRequest) -> int:
        try:
            response = await self._stub(address).ApplyExpertPlacement(request,
                                                                      timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
        return int(response.version)

    async def status(self, address: str) -> WorkerInstance:
        try:
            response = await self._stub(address).GetStatus(worker_pb2.GetStatusRequest(),
                                                           timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
        return instance_from_info(response.worker, int(response.expert_placement_version))

    async def retain(self, addresses: Iterable[str]) -> None:
        keep = set(addresses)
        for address in [a for a in self._channels if a not in keep]:
            await self._channels.pop(address).close()

    async def close(self) -> None:
        await self.retain(())


# -- the loop ---------------------------------------------------------------------------------


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


def _instance_from_spec(record: WorkerRecord) -> tuple[int, str] | None:
    """(GPUs, model) from the worker's registration, if the store kept it."""
    if not record.spec:
        return None
    info = pb.WorkerInfo()
    info.ParseFromString(record.spec)
    if not info.model:
        return None
    instance = instance_from_info(info)
    return instance.num_gpus, instance.model


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
            shape = _instance_from_spec(record) or self._instances.get(
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
            pool.last_error = exc.message
            logger.warning("%s/%s: cannot place experts: %s", pool.deployment, pool.role,
                           exc.message)
            return
        current = pool.current.placement if pool.current is not None else None
        is_current = current is not None and current.topology == topology and _is_compatible(
            current, loads.shape)
        balance = float(gpu_balancedness(current, loads).mean()) if is_current else 0.0
        reason = replan_reason(ReplanInputs(
            now_s=now_s, num_tokens_per_layer=estimate.tokens_per_layer(),
            has_placement=current is not None, is_topology_current=is_current,
            last_plan_s=pool.last_plan_s, balancedness=balance), self.policy)
        if reason is None:
            return
        try:
            outcome = await asyncio.to_thread(plan_pool, current if is_current else None, loads,
                                              topology, _expert_bytes(model_name),
                                              self.policy.balance_tolerance)
        except InvalidArgumentError as exc:
            pool.last_error = exc.message
            logger.warning("%s/%s: cannot place experts: %s", pool.deployment, pool.role,
                           exc.message)
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
            placement = pool.current.placement
            pool.request = worker_pb2.ApplyExpertPlacementRequest(
                version=version, num_layers=placement.num_layers,
                num_slots=placement.topology.num_slots,
                slot_to_expert=placement.slot_to_expert.reshape(-1).tolist())
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


def _is_compatible(placement: ExpertPlacement, shape: tuple[int, int]) -> bool:
    return placement.num_layers == shape[0] and placement.num_experts == shape[1]


# -- the component the governor app runs ------------------------------------------------------


def placement_to_pb(status: PoolPlacementStatus) -> governor_pb2.ExpertPlacement:
    current = status.current
    assert current is not None
    placement = current.placement
    return governor_pb2.ExpertPlacement(
        deployment=placement_key(status.deployment, status.role), version=current.version,
        num_layers=placement.num_layers, num_slots=placement.topology.num_slots,
        slot_to_expert=placement.slot_to_expert.reshape(-1).tolist(),
        balancedness=[float(b) for b in status.balancedness],
        num_gpus=placement.topology.num_gpus, num_experts=placement.num_experts,
    )


class ExpertPlacementService:
    """The expert-placement loop as the governor app runs it: the hot-state backend (its own,
    from ``settings.redis_url``, unless one is shared in), the durable store, gRPC to workers."""

    def __init__(self, settings: Any, backend: StateBackend | None = None,
                 repository: PlacementRepository | None = None, clock: Clock = time.time) -> None:
        self.policy = ExpertPolicy.from_settings(settings)
        self._owns_backend = backend is None
        if backend is None:
            from pdserve.state.factory import open_backend

            backend = open_backend(getattr(settings, "redis_url", None), clock)
        self.backend = backend
        self.client = GrpcWorkerPlacementClient(settings, self.policy.rollout_timeout_s)
        self.governor = ExpertPlacementGovernor(
            self.policy, backend.workers, expert_load_store_for(backend), self.client, clock,
            repository)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.governor.run(self._stop),
                                             name="expert-placement")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.client.close()
        if self._owns_backend:
            await self.backend.close()

    async def get_expert_placement(
        self, request: governor_pb2.GetExpertPlacementRequest
    ) -> governor_pb2.GetExpertPlacementResponse:
        deployment, role = parse_placement_key(request.deployment)
        try:
            status = await self.governor.status(deployment, role)
        except PdserveError:
            raise
        except Exception as exc:  # noqa: BLE001 - the durable store is the likely cause
            raise UnavailableError(f"expert placement unavailable: {exc}") from None
        if status.current is None:
            return governor_pb2.GetExpertPlacementResponse()
        return governor_pb2.GetExpertPlacementResponse(placement=placement_to_pb(status))
