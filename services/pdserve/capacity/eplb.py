"""Redundant-expert placement (EPLB) for MoE expert-parallel pools.

In expert parallelism every GPU waits for the slowest one at each all-to-all, so a GPU holding a
hot expert sets the step time of the whole pool. A placement gives every layer ``num_slots``
physical expert slots (``num_slots - num_experts`` of them redundant copies of hot experts) and
decides which logical expert sits in each slot. Slot ``s`` is on GPU ``s // slots_per_gpu``; GPU
``g`` is on node ``g // gpus_per_node``. An expert's load (tokens routed to it) is split evenly
over its copies.

Two policies (``PlacementPolicy``):

* ``HIERARCHICAL`` keeps each expert group (``num_experts / num_groups`` consecutive experts) on
  one node, so group-limited routing (DeepSeek-V3 sends each token to at most 4 of 8 groups)
  stays inside a node. For prefill with a small EP degree. Needs ``num_groups % num_nodes == 0``.
* ``GLOBAL`` treats the pool as one group on one node. For decode with a large EP degree.

Two methods (``PlacementMethod``):

* ``GREEDY`` is the baseline DeepSeek describes for its EPLB (deepseek-ai/EPLB README), written
  from that description: groups balanced-packed onto nodes, the expert with the highest load per
  copy replicated one slot at a time, copies balanced-packed onto GPUs.
* ``REFINED`` starts from the greedy plan (and, for the hierarchical policy, also from a
  swap-refined group-to-node packing), then runs a local search that swaps slots and moves copies
  between experts (``eplb_refine``), and for the global policy permutes whole GPUs among nodes
  for node balance. Every layer keeps the better of the refined and the greedy plan, so it is
  never less balanced than ``GREEDY``. Work is bounded by step counts rather than a wall clock so
  that a plan is a pure function of its inputs; one 58-layer plan takes about a second.

``replan_with_migration`` re-plans for new loads while changing as few slots (expert weight
copies to move) as it can. ``gpu_balancedness`` and ``node_balancedness`` are the metrics.
``choose_num_slots`` (from ``eplb_memory``) weighs redundant slots against KV-cache memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from pdserve.capacity import eplb_packing as packing
from pdserve.capacity.eplb_memory import (
    DecodeCapacity,
    ExpertMemoryModel,
    RedundancyOption,
    choose_num_slots,
)
from pdserve.capacity.eplb_migration import (
    align_to_current,
    greedy_match,
    recount_current,
    repack_extremes,
    revert_toward_current,
)
from pdserve.capacity.eplb_refine import SearchGoal, SearchSpace, refine_slot_map
from pdserve.common.errors import InvalidArgumentError

__all__ = [
    "DEEPSEEK_V3_EXPERT_BYTES",
    "DecodeCapacity",
    "ExpertMemoryModel",
    "ExpertPlacement",
    "MigrationPlan",
    "PlacementMethod",
    "PlacementPolicy",
    "PlacementTopology",
    "RedundancyOption",
    "choose_num_slots",
    "gpu_balancedness",
    "gpu_loads",
    "node_balancedness",
    "plan_expert_placement",
    "replan_with_migration",
]

# One DeepSeek-V3 routed expert in one layer: gate, up and down projections of
# hidden_size 7168 x moe_intermediate_size 2048, FP8 (1 byte per weight), from the model's
# config.json (deepseek-ai/DeepSeek-V3). The 128x128-block FP32 scales add 3 x 56 x 16 x 4 =
# 10,752 bytes (0.02%), left out. About 44 MB.
DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048


# Restarts of the refined search from perturbed copy counts: how many, how much, which seed.
_NUM_RESTARTS = 4
_RESTART_NOISE = 0.1
_RESTART_SEED = 20240229


class PlacementPolicy(enum.StrEnum):
    """Where copies may go: groups pinned to nodes, or anywhere."""

    HIERARCHICAL = "hierarchical"
    GLOBAL = "global"


class PlacementMethod(enum.StrEnum):
    """How hard to search: the published greedy baseline, or greedy plus local search."""

    GREEDY = "greedy"
    REFINED = "refined"


@dataclass(frozen=True, slots=True)
class PlacementTopology:
    """The expert-parallel pool a placement is for.

    ``num_slots`` physical expert slots per layer, a multiple of ``num_gpus``; ``num_gpus`` a
    multiple of ``num_nodes``. ``num_groups`` expert groups; the hierarchical policy needs
    ``num_groups % num_nodes == 0``. Raises ``InvalidArgumentError`` naming the broken constraint.
    """

    num_slots: int
    num_gpus: int
    num_nodes: int
    num_groups: int
    policy: PlacementPolicy

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_gpus", "num_nodes", "num_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise InvalidArgumentError(
                    f"{name} must be a positive integer, got {value!r}", field=name
                )
        if self.num_slots % self.num_gpus:
            raise InvalidArgumentError(
                f"num_slots must be a multiple of num_gpus (equal slots per GPU): "
                f"num_slots={self.num_slots}, num_gpus={self.num_gpus}",
                field="num_slots",
            )
        if self.num_gpus % self.num_nodes:
            raise InvalidArgumentError(
                f"num_gpus must be a multiple of num_nodes (equal GPUs per node): "
                f"num_gpus={self.num_gpus}, num_nodes={self.num_nodes}",
                field="num_gpus",
            )
        if self.policy not in tuple(PlacementPolicy):
            raise InvalidArgumentError(f"unknown placement policy {self.policy!r}", field="policy")
        if self.policy is PlacementPolicy.HIERARCHICAL and self.num_groups % self.num_nodes:
            raise InvalidArgumentError(
                f"hierarchical placement needs num_groups divisible by num_nodes: "
                f"num_groups={self.num_groups}, num_nodes={self.num_nodes}",
                field="num_groups",
            )

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    def gpu_of_slot(self) -> np.ndarray:
        """``[num_slots]`` GPU index of every slot."""
        return np.arange(self.num_slots) // self.slots_per_gpu

    def node_of_gpu(self) -> np.ndarray:
        """``[num_gpus]`` node index of every GPU."""
        return np.arange(self.num_gpus) // self.gpus_per_node


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Which logical expert sits in every physical slot, per layer, and the same seen per expert.

    ``slot_to_expert`` ``[layers, num_slots]``; ``expert_to_slots`` ``[layers, num_experts,
    max_copies]`` slot ids in ascending order, padded with -1; ``expert_num_copies`` ``[layers,
    num_experts]`` (every entry >= 1). Arrays are read-only. Build with ``from_slot_map``.
    """

    topology: PlacementTopology
    slot_to_expert: np.ndarray
    expert_to_slots: np.ndarray
    expert_num_copies: np.ndarray

    @classmethod
    def from_slot_map(
        cls, slot_to_expert: np.ndarray, num_experts: int, topology: PlacementTopology
    ) -> ExpertPlacement:
        """Derive the per-expert views from a ``[layers, num_slots]`` slot map."""
        slot_to_expert = np.asarray(slot_to_expert, dtype=np.int64)
        num_layers, num_slots = slot_to_expert.shape
        assert num_slots == topology.num_slots, (num_slots, topology.num_slots)
        counts = packing.copy_counts(slot_to_expert, num_experts)
        assert counts.min() >= 1, "every expert needs a copy"
        max_copies = int(counts.max())
        order = np.argsort(slot_to_expert, axis=1, kind="stable")
        sorted_expert = np.take_along_axis(slot_to_expert, order, axis=1)
        starts = np.cumsum(counts, axis=1) - counts
        rank = np.arange(num_slots)[None, :] - np.take_along_axis(starts, sorted_expert, axis=1)
        expert_to_slots = np.full((num_layers, num_experts, max_copies), -1, dtype=np.int64)
        expert_to_slots[np.arange(num_layers)[:, None], sorted_expert, rank] = order
        for array in (slot_to_expert, expert_to_slots, counts):
            array.flags.writeable = False
        return cls(topology, slot_to_expert, expert_to_slots, counts)

    @property
    def num_layers(self) -> int:
        return self.slot_to_expert.shape[0]

    @property
    def num_experts(self) -> int:
        return self.expert_num_copies.shape[1]


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """A re-plan and what it costs to roll out.

    ``num_experts_moved`` counts (layer, slot) pairs whose expert changes, i.e. expert weight
    copies to load; ``layer_num_experts_moved`` is the same per layer ``[layers]``.
    ``target_balancedness`` ``[layers]`` is what a plan from scratch reaches for the new loads.
    """

    placement: ExpertPlacement
    layer_num_experts_moved: np.ndarray
    num_experts_moved: int
    bytes_moved: int
    target_balancedness: np.ndarray


def plan_expert_placement(
    expert_loads: np.ndarray,
    topology: PlacementTopology,
    method: PlacementMethod = PlacementMethod.REFINED,
) -> ExpertPlacement:
    """Place ``num_slots`` expert copies per layer on the pool for the given loads.

    ``expert_loads`` is ``[num_layers, num_experts]``, finite and >= 0 (tokens per expert over a
    window; only ratios within a layer matter). Needs ``num_slots >= num_experts`` and, for the
    hierarchical policy, ``num_experts % num_groups == 0``. Every expert gets at least one copy,
    every GPU ``num_slots / num_gpus`` slots.
    """
    loads = _validated_loads(expert_loads, topology)
    if method not in tuple(PlacementMethod):
        raise InvalidArgumentError(f"unknown placement method {method!r}", field="method")
    greedy = _greedy_slot_map(loads, topology, refine_steps=0)
    if method is PlacementMethod.GREEDY:
        return ExpertPlacement.from_slot_map(greedy, loads.shape[1], topology)
    refined = _refined_slot_map(loads, topology, greedy)
    return ExpertPlacement.from_slot_map(refined, loads.shape[1], topology)


def gpu_loads(placement: ExpertPlacement, expert_loads: np.ndarray) -> np.ndarray:
    """Load on every GPU, ``[layers, num_gpus]``, each expert's load split evenly over its copies."""
    loads = _validated_loads(expert_loads, placement.topology, num_experts=placement.num_experts)
    _check_layers(loads, placement)
    return packing.gpu_loads(placement.slot_to_expert, loads, placement.topology.num_gpus)


def gpu_balancedness(placement: ExpertPlacement, expert_loads: np.ndarray) -> np.ndarray:
    """Per layer mean GPU load / max GPU load, ``[layers]`` in (0, 1]; 1.0 for a layer with no load."""
    return _balancedness(gpu_loads(placement, expert_loads))


def node_balancedness(placement: ExpertPlacement, expert_loads: np.ndarray) -> np.ndarray:
    """Per layer mean node load / max node load, ``[layers]`` in (0, 1]; 1.0 for no load."""
    per_gpu = gpu_loads(placement, expert_loads)
    per_node = per_gpu.reshape(per_gpu.shape[0], placement.topology.num_nodes, -1).sum(axis=2)
    return _balancedness(per_node)


def replan_with_migration(
    current: ExpertPlacement,
    expert_loads: np.ndarray,
    expert_bytes: int,
    balance_tolerance: float = 0.01,
) -> MigrationPlan:
    """Re-plan ``current`` for new loads, moving as few expert copies as it can.

    A layer's re-plan is accepted once its GPU balancedness is within ``balance_tolerance``
    (absolute, in [0, 1)) of a refined plan from scratch for the new loads, or at least as good as
    that plan. Per layer the qualifying candidate with the fewest changed slots wins (see
    ``_migrate``): the current placement unchanged or improved by a move-averse local search
    (each step the move that relieves the heaviest GPU most per slot changed, stopping at the
    tolerance); re-counted to the copy counts of a plan from scratch, with a growing number of
    GPUs re-packed, or (hierarchical) with groups moved to a better node split, then improved;
    or a plan from scratch relabelled to match the current one. ``expert_bytes`` is
    one expert copy's weights in bytes (``DEEPSEEK_V3_EXPERT_BYTES`` for DeepSeek-V3).
    """
    topology = current.topology
    loads = _validated_loads(expert_loads, topology, num_experts=current.num_experts)
    _check_layers(loads, current)
    if (
        isinstance(expert_bytes, bool)
        or not isinstance(expert_bytes, int | np.integer)
        or expert_bytes < 0
    ):
        raise InvalidArgumentError(
            f"expert_bytes must be an integer >= 0, got {expert_bytes!r}", field="expert_bytes"
        )
    if not (isinstance(balance_tolerance, float | int) and 0.0 <= balance_tolerance < 1.0):
        raise InvalidArgumentError(
            f"balance_tolerance must be in [0, 1), got {balance_tolerance!r}",
            field="balance_tolerance",
        )
    old = np.asarray(current.slot_to_expert)
    scratch = _refined_slot_map(loads, topology, _greedy_slot_map(loads, topology, refine_steps=0))
    mean_load = loads.sum(axis=1) / topology.num_gpus
    scratch_max = _max_gpu_load(scratch, loads, topology)
    target_balance = _balancedness_from_max(mean_load, scratch_max)
    accept_balance = np.maximum(target_balance - balance_tolerance, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        accept_max = np.where(accept_balance > 0, mean_load / accept_balance, np.inf)
    accept_max = np.maximum(accept_max, scratch_max)
    chosen = _migrate(old, loads, topology, scratch, accept_max)
    layer_moved = (chosen != old).sum(axis=1)
    placement = ExpertPlacement.from_slot_map(chosen, current.num_experts, topology)
    num_moved = int(layer_moved.sum())
    return MigrationPlan(
        placement=placement,
        layer_num_experts_moved=layer_moved,
        num_experts_moved=num_moved,
        bytes_moved=num_moved * int(expert_bytes),
        target_balancedness=target_balance,
    )


def _migrate(
    old: np.ndarray,
    loads: np.ndarray,
    topology: PlacementTopology,
    scratch: np.ndarray,
    accept_max: np.ndarray,
) -> np.ndarray:
    """Per layer the plan with the fewest changed slots whose heaviest GPU is within ``accept_max``.

    Candidates, the cheap ones on every layer, the costlier ones only on layers that no earlier
    candidate satisfied:

    1. the current placement, and it improved by move-averse local search;
    2. the current placement re-counted to the copy counts of a plan from scratch that keeps the
       current groups on their nodes, then improved the same way;
    3. that, with the heaviest and lightest GPUs re-packed together (2, 4, 8, ... of them);
    4. hierarchical only: groups moved to a new node split (the best single swap of two groups,
       then the split of the plan from scratch), re-counted and improved;
    5. a plan from scratch relabelled onto the current one, with slots given back to their current
       expert where the target allows (first the one that keeps groups on their nodes, then the
       unconstrained ``scratch``, which always qualifies).
    """
    nodes = _alignment_nodes(topology)
    chosen = old.copy()
    never = np.iinfo(np.int64).max
    fewest_moves = np.full(old.shape[0], never)

    def offer(rows: np.ndarray, plans: np.ndarray, is_final: bool = False) -> np.ndarray:
        moves = (plans != old[rows]).sum(axis=1)
        is_ok = (
            _max_gpu_load(plans, loads[rows], topology) <= accept_max[rows] * (1 + 1e-12)
        ) | is_final
        is_better = is_ok & (moves < fewest_moves[rows])
        chosen[rows[is_better]] = plans[is_better]
        fewest_moves[rows[is_better]] = moves[is_better]
        return np.flatnonzero(fewest_moves == never)

    def improve(rows: np.ndarray, plans: np.ndarray) -> np.ndarray:
        goal = SearchGoal(
            _step_budget(topology), target_max_load=accept_max[rows], is_move_averse=True
        )
        return refine_slot_map(plans, loads[rows], _search_space(topology), goal)

    every = np.arange(old.shape[0])
    offer(every, old)
    offer(every, improve(every, old))
    if topology.policy is PlacementPolicy.HIERARCHICAL:
        group_node = _current_group_nodes(old, loads.shape[1], topology)
        pinned = _refined_slot_map(
            loads, topology, _place(loads, topology, group_node), group_node=group_node
        )
    else:
        pinned = scratch
    counts = packing.copy_counts(pinned, loads.shape[1])
    recounted = improve(every, recount_current(old, counts, loads, topology.num_gpus, nodes))
    rows = offer(every, recounted)
    num_pairs = 1
    while rows.size and num_pairs <= topology.num_gpus // (2 * nodes):
        repacked = repack_extremes(
            recounted[rows], loads[rows], topology.num_gpus, nodes, num_pairs
        )
        rows = offer(rows, improve(rows, repacked))
        num_pairs *= 2
    if rows.size and topology.policy is PlacementPolicy.HIERARCHICAL and topology.num_nodes > 1:
        for split in (_best_group_swap, _scratch_group_split):
            if rows.size == 0:
                break
            new_split = split(loads[rows], topology, group_node[rows], scratch[rows])
            moved = _place(loads[rows], topology, new_split)
            moved = _refined_slot_map(loads[rows], topology, moved, group_node=new_split)
            expert_node = np.repeat(new_split, loads.shape[1] // topology.num_groups, axis=1)
            recount = recount_current(
                old[rows],
                packing.copy_counts(moved, loads.shape[1]),
                loads[rows],
                topology.num_gpus,
                nodes,
                expert_node,
            )
            rows = offer(rows, improve(rows, recount))
    for plan, is_final in ((pinned, False), (scratch, True)):
        if rows.size == 0:
            break
        aligned = align_to_current(plan[rows], old[rows], topology.num_gpus, nodes)
        kept = np.maximum(accept_max[rows], _max_gpu_load(aligned, loads[rows], topology))
        reverted = revert_toward_current(
            aligned, old[rows], loads[rows], kept, topology.num_gpus, nodes
        )
        rows = offer(rows, reverted, is_final)
    return chosen


def _group_loads(loads: np.ndarray, num_groups: int) -> np.ndarray:
    return loads.reshape(loads.shape[0], num_groups, -1).sum(axis=2)


def _best_group_swap(
    loads: np.ndarray, topology: PlacementTopology, group_node: np.ndarray, scratch: np.ndarray
) -> np.ndarray:
    """The node split after the one swap of two groups on different nodes that most lowers the
    heaviest node (``[layers, groups]``); unchanged where no swap helps."""
    group_loads = _group_loads(loads, topology.num_groups)
    one_hot = group_node[:, :, None] == np.arange(topology.num_nodes)[None, None, :]
    node_load = np.einsum("lg,lgn->ln", group_loads, one_hot)
    # After swapping groups a and b: node(a) gains b - a, node(b) gains a - b.
    delta = group_loads[:, None, :] - group_loads[:, :, None]
    node_a = np.take_along_axis(node_load, group_node, axis=1)
    new_a = node_a[:, :, None] + delta
    new_b = node_a[:, None, :] - delta
    # Heaviest node other than node(a) and node(b), which the swap leaves alone.
    nodes = np.arange(topology.num_nodes)
    is_untouched = (nodes != group_node[:, :, None, None]) & (nodes != group_node[:, None, :, None])
    others = np.where(is_untouched, node_load[:, None, None, :], -np.inf).max(axis=3)
    value = np.maximum(np.maximum(new_a, new_b), others)
    is_valid = group_node[:, :, None] != group_node[:, None, :]
    value = np.where(is_valid, value, np.inf).reshape(loads.shape[0], -1)
    best = np.argmin(value, axis=1)
    improves = value[np.arange(loads.shape[0]), best] < node_load.max(axis=1) * (1 - 1e-12)
    split = group_node.copy()
    for layer in np.flatnonzero(improves).tolist():
        a, b = divmod(int(best[layer]), topology.num_groups)
        split[layer, a], split[layer, b] = group_node[layer, b], group_node[layer, a]
    return split


def _scratch_group_split(
    loads: np.ndarray, topology: PlacementTopology, group_node: np.ndarray, scratch: np.ndarray
) -> np.ndarray:
    """The node split of the plan from scratch, its nodes renamed to share most groups with now."""
    split = _current_group_nodes(scratch, loads.shape[1], topology)
    renamed = np.empty_like(split)
    for layer in range(split.shape[0]):
        nodes = np.arange(topology.num_nodes)
        in_new = (split[layer][:, None] == nodes[None, :]).astype(np.int64)
        in_now = (group_node[layer][:, None] == nodes[None, :]).astype(np.int64)
        renamed[layer] = greedy_match(in_new.T @ in_now)[split[layer]]
    return renamed


def _current_group_nodes(
    slot_to_expert: np.ndarray, num_experts: int, topology: PlacementTopology
) -> np.ndarray:
    """Node of every group ``[layers, groups]`` in a hierarchical slot map."""
    group_size = num_experts // topology.num_groups
    node_of_slot = np.arange(topology.num_slots) // (topology.num_slots // topology.num_nodes)
    first_slot = np.argmax(
        slot_to_expert[:, None, :] == np.arange(0, num_experts, group_size)[None, :, None], axis=2
    )
    return node_of_slot[first_slot]


def _greedy_slot_map(
    loads: np.ndarray, topology: PlacementTopology, refine_steps: int
) -> np.ndarray:
    """Greedy (baseline) slot map; ``refine_steps > 0`` also refines the group-to-node packing."""
    return _place(loads, topology, _group_nodes(loads, topology, refine_steps))


def _group_nodes(loads: np.ndarray, topology: PlacementTopology, refine_steps: int) -> np.ndarray:
    """Node of every group ``[layers, groups]``; the global policy is one group on one node."""
    num_layers, num_experts = loads.shape
    if topology.policy is PlacementPolicy.GLOBAL:
        return np.zeros((num_layers, 1), dtype=np.int64)
    num_groups = topology.num_groups
    group_loads = loads.reshape(num_layers, num_groups, num_experts // num_groups).sum(axis=2)
    return packing.pack_groups(group_loads, topology.num_nodes, refine_steps)


def _place(
    loads: np.ndarray,
    topology: PlacementTopology,
    group_node: np.ndarray,
    replication_loads: np.ndarray | None = None,
) -> np.ndarray:
    num_nodes = topology.num_nodes if topology.policy is PlacementPolicy.HIERARCHICAL else 1
    return packing.place_hierarchical(
        loads, group_node, topology.num_slots, num_nodes, topology.num_gpus, replication_loads
    )


def _refined_slot_map(
    loads: np.ndarray,
    topology: PlacementTopology,
    greedy: np.ndarray,
    group_node: np.ndarray | None = None,
) -> np.ndarray:
    """Refined slot map: local search from several greedy starts, best per layer.

    Starts: the greedy plan; for the hierarchical policy the greedy plan over a swap-refined
    group-to-node packing (when it differs); and ``_NUM_RESTARTS`` greedy plans whose copy counts
    come from seeded, slightly perturbed loads (packing granularity makes the count that
    minimises the largest copy not always the best once copies share GPUs). The greedy plan is
    a candidate too, so no layer ends less balanced than ``GREEDY``. A given ``group_node``
    pins the groups to those nodes (``greedy`` must then be placed with it).
    """
    space = _search_space(topology)
    goal = SearchGoal(max_steps=_step_budget(topology))
    is_pinned = group_node is not None
    if group_node is None:
        group_node = _group_nodes(loads, topology, refine_steps=0)
    starts = [greedy]
    if topology.policy is PlacementPolicy.HIERARCHICAL and topology.num_nodes > 1 and not is_pinned:
        refined_groups = _group_nodes(loads, topology, refine_steps=4 * topology.num_groups)
        if (refined_groups != group_node).any():
            starts.append(_place(loads, topology, refined_groups))
    rng = np.random.default_rng(_RESTART_SEED)
    for _ in range(_NUM_RESTARTS):
        noise = rng.uniform(1.0 - _RESTART_NOISE, 1.0 + _RESTART_NOISE, size=loads.shape)
        starts.append(_place(loads, topology, group_node, replication_loads=loads * noise))
    best = greedy
    best_key = _placement_key(greedy, loads, topology)
    for start in starts:
        refined = refine_slot_map(start, loads, space, goal)
        key = _placement_key(refined, loads, topology)
        is_better = (key[0] < best_key[0]) | ((key[0] == best_key[0]) & (key[1] < best_key[1]))
        best = np.where(is_better[:, None], refined, best)
        best_key = tuple(
            np.where(is_better, new, old) for new, old in zip(key, best_key, strict=True)
        )
    if topology.policy is PlacementPolicy.GLOBAL and topology.num_nodes > 1:
        arranged = packing.arrange_gpus_on_nodes(
            best, loads, topology.num_gpus, topology.num_nodes, refine_steps=4 * topology.num_gpus
        )
        is_better = _placement_key(arranged, loads, topology)[1] < best_key[1]
        best = np.where(is_better[:, None], arranged, best)
    return best


def _placement_key(
    slot_to_expert: np.ndarray, loads: np.ndarray, topology: PlacementTopology
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer (max GPU load, max node load): lower is better, compared in that order."""
    per_gpu = packing.gpu_loads(slot_to_expert, loads, topology.num_gpus)
    per_node = per_gpu.reshape(per_gpu.shape[0], topology.num_nodes, -1).sum(axis=2)
    return per_gpu.max(axis=1), per_node.max(axis=1)


def _max_gpu_load(
    slot_to_expert: np.ndarray, loads: np.ndarray, topology: PlacementTopology
) -> np.ndarray:
    return packing.gpu_loads(slot_to_expert, loads, topology.num_gpus).max(axis=1)


def _search_space(topology: PlacementTopology) -> SearchSpace:
    return SearchSpace(
        num_gpus=topology.num_gpus,
        num_nodes=topology.num_nodes,
        is_node_local=topology.policy is PlacementPolicy.HIERARCHICAL,
    )


def _alignment_nodes(topology: PlacementTopology) -> int:
    """Nodes whose GPUs must stay together when relabelling (1: any GPU may match any GPU)."""
    return topology.num_nodes if topology.policy is PlacementPolicy.HIERARCHICAL else 1


def _step_budget(topology: PlacementTopology) -> int:
    """Local-search steps per plan: enough to touch every slot a few times."""
    return 4 * topology.num_slots


def _balancedness(loads: np.ndarray) -> np.ndarray:
    return _balancedness_from_max(loads.mean(axis=1), loads.max(axis=1))


def _balancedness_from_max(mean_load: np.ndarray, max_load: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(max_load > 0, mean_load / max_load, 1.0)


def _validated_loads(
    expert_loads: np.ndarray, topology: PlacementTopology, num_experts: int | None = None
) -> np.ndarray:
    """The load matrix as float64 ``[layers, experts]``, or ``InvalidArgumentError``."""
    try:
        loads = np.asarray(expert_loads, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"expert_loads must be numeric: {exc}", field="expert_loads"
        ) from exc
    if loads.ndim != 2 or loads.shape[0] < 1 or loads.shape[1] < 1:
        raise InvalidArgumentError(
            f"expert_loads must be a non-empty 2-D matrix [num_layers, num_experts], got shape {loads.shape}",
            field="expert_loads",
        )
    found_experts = loads.shape[1]
    if num_experts is not None and found_experts != num_experts:
        raise InvalidArgumentError(
            f"expert_loads must have one column per expert: expected {num_experts}, got {found_experts}",
            field="expert_loads",
        )
    if not np.isfinite(loads).all():
        raise InvalidArgumentError(
            f"expert_loads must be finite, found {int((~np.isfinite(loads)).sum())} non-finite entries",
            field="expert_loads",
        )
    if (loads < 0).any():
        raise InvalidArgumentError(
            f"expert_loads must be >= 0, found minimum {loads.min()}", field="expert_loads"
        )
    if topology.num_slots < found_experts:
        raise InvalidArgumentError(
            f"num_slots must be >= num_experts (every expert needs a slot): "
            f"num_slots={topology.num_slots}, num_experts={found_experts}",
            field="num_slots",
        )
    if topology.policy is PlacementPolicy.HIERARCHICAL and found_experts % topology.num_groups:
        raise InvalidArgumentError(
            f"hierarchical placement needs num_experts divisible by num_groups: "
            f"num_experts={found_experts}, num_groups={topology.num_groups}",
            field="num_groups",
        )
    return loads


def _check_layers(loads: np.ndarray, placement: ExpertPlacement) -> None:
    if loads.shape[0] != placement.num_layers:
        raise InvalidArgumentError(
            f"expert_loads must have one row per layer of the placement: expected "
            f"{placement.num_layers}, got {loads.shape[0]}",
            field="expert_loads",
        )
