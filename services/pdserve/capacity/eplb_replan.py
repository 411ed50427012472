"""Re-planning an expert placement for new loads while moving few expert copies
(``replan_with_migration``): every slot whose expert changes is one expert's weights to load on
a GPU that is serving, so a re-plan is judged by balance *and* by what it moves. The kernels it
combines (relabel, revert, re-count, re-pack) are in ``eplb_migration``; the search it starts
from is ``eplb``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.capacity import eplb_packing as packing
from pdserve.capacity.eplb import (
    greedy_slot_map,
    max_gpu_load,
    place_on_nodes,
    refined_slot_map,
    search_space,
    step_budget,
)
from pdserve.capacity.eplb_migration import (
    align_to_current,
    greedy_match,
    recount_current,
    repack_extremes,
    revert_toward_current,
)
from pdserve.capacity.eplb_placement import (
    ExpertPlacement,
    PlacementPolicy,
    PlacementTopology,
    balancedness_from_max,
    check_layers,
    validated_loads,
)
from pdserve.capacity.eplb_refine import SearchGoal, refine_slot_map
from pdserve.common.errors import InvalidArgumentError

# One DeepSeek-V3 routed expert in one layer: gate, up and down projections of
# hidden_size 7168 x moe_intermediate_size 2048, FP8 (1 byte per weight), from the model's
# config.json (deepseek-ai/DeepSeek-V3). The 128x128-block FP32 scales add 3 x 56 x 16 x 4 =
# 10,752 bytes (0.02%), left out. About 44 MB.
DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048


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
    loads = validated_loads(expert_loads, topology, num_experts=current.num_experts)
    check_layers(loads, current)
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
    scratch = refined_slot_map(loads, topology, greedy_slot_map(loads, topology, refine_steps=0))
    mean_load = loads.sum(axis=1) / topology.num_gpus
    scratch_max = max_gpu_load(scratch, loads, topology)
    target_balance = balancedness_from_max(mean_load, scratch_max)
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
            max_gpu_load(plans, loads[rows], topology) <= accept_max[rows] * (1 + 1e-12)
        ) | is_final
        is_better = is_ok & (moves < fewest_moves[rows])
        chosen[rows[is_better]] = plans[is_better]
        fewest_moves[rows[is_better]] = moves[is_better]
        return np.flatnonzero(fewest_moves == never)

    def improve(rows: np.ndarray, plans: np.ndarray) -> np.ndarray:
        goal = SearchGoal(
            step_budget(topology), target_max_load=accept_max[rows], is_move_averse=True
        )
        return refine_slot_map(plans, loads[rows], search_space(topology), goal)

    every = np.arange(old.shape[0])
    offer(every, old)
    offer(every, improve(every, old))
    if topology.policy is PlacementPolicy.HIERARCHICAL:
        group_node = _current_group_nodes(old, loads.shape[1], topology)
        pinned = refined_slot_map(
            loads, topology, place_on_nodes(loads, topology, group_node), group_node=group_node
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
            moved = place_on_nodes(loads[rows], topology, new_split)
            moved = refined_slot_map(loads[rows], topology, moved, group_node=new_split)
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
        kept = np.maximum(accept_max[rows], max_gpu_load(aligned, loads[rows], topology))
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



def _alignment_nodes(topology: PlacementTopology) -> int:
    """Nodes whose GPUs must stay together when relabelling (1: any GPU may match any GPU)."""
    return topology.num_nodes if topology.policy is PlacementPolicy.HIERARCHICAL else 1


