"""The expert-placement loop's pure policy (EPLB as a service; the loop itself is
``pdserve.governor.expert_loop``): how it estimates load, when it re-plans, what topology a pool's
instances give a placement, and how it plans.

1. A **decayed load estimate** per pool: a token counted ``a`` seconds ago weighs
   ``2 ** (-a / half_life_s)`` (``LoadEstimate``, ``fold_reports``; counts are stamped when the
   loop drains them, on the governor's clock).
2. **Whether to re-plan** (``replan_reason``): a first plan once the estimate holds
   ``min_tokens_per_layer``; the instance shape changed; ``replan_period_s`` passed since the
   last plan; or the mean GPU balancedness (mean / max GPU load) of the placement in force fell
   under ``min_balancedness``, at most once per ``min_replan_interval_s``.
3. **Planning** (``plan_pool``): from scratch the first time (``plan_expert_placement``),
   afterwards with the migration-aware re-planner (``replan_with_migration``), which reaches
   near the best balance while changing as few slots (expert weights to load) as it can.

The instance's GPUs are the expert-parallel group a placement spreads over (``pool_topology``):
decode pools use the global policy; prefill pools the hierarchical one when ``num_groups`` > 1
divides into the instance's nodes. Plain values in, decisions out: no clock, no I/O.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.capacity.eplb import plan_expert_placement
from pdserve.capacity.eplb_placement import ExpertPlacement, PlacementPolicy, PlacementTopology
from pdserve.capacity.eplb_replan import replan_with_migration
from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import WorkerRole
from pdserve.state.expert_loads import ExpertLoadReport


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
        """``(num_layers, num_experts)``."""
        num_layers, num_experts = self.token_loads.shape
        return num_layers, num_experts

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
    total = np.stack(matching).sum(axis=0, dtype=np.float64)
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

