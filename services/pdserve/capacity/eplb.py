"""Redundant-expert placement (EPLB) from scratch for MoE expert-parallel pools
(``plan_expert_placement``; the vocabulary and metrics are in ``eplb_placement``).

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

``eplb_replan.replan_with_migration`` re-plans for new loads while changing as few slots (expert
weight copies to move) as it can; ``eplb_memory.choose_num_slots`` weighs redundant slots against
KV-cache memory.
"""

from __future__ import annotations

import enum

import numpy as np

from pdserve.capacity import eplb_packing as packing
from pdserve.capacity.eplb_placement import (
    ExpertPlacement,
    PlacementPolicy,
    PlacementTopology,
    validated_loads,
)
from pdserve.capacity.eplb_refine import SearchGoal, SearchSpace, refine_slot_map
from pdserve.common.errors import InvalidArgumentError

# Restarts of the refined search from perturbed copy counts: how many, how much, which seed.
_NUM_RESTARTS = 4
_RESTART_NOISE = 0.1
_RESTART_SEED = 20240229


class PlacementMethod(enum.StrEnum):
    """How hard to search: the published greedy baseline, or greedy plus local search."""

    GREEDY = "greedy"
    REFINED = "refined"


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
    loads = validated_loads(expert_loads, topology)
    if method not in tuple(PlacementMethod):
        raise InvalidArgumentError(f"unknown placement method {method!r}", field="method")
    greedy = greedy_slot_map(loads, topology, refine_steps=0)
    if method is PlacementMethod.GREEDY:
        return ExpertPlacement.from_slot_map(greedy, loads.shape[1], topology)
    refined = refined_slot_map(loads, topology, greedy)
    return ExpertPlacement.from_slot_map(refined, loads.shape[1], topology)



def greedy_slot_map(
    loads: np.ndarray, topology: PlacementTopology, refine_steps: int
) -> np.ndarray:
    """Greedy (baseline) slot map; ``refine_steps > 0`` also refines the group-to-node packing."""
    return place_on_nodes(loads, topology, _group_nodes(loads, topology, refine_steps))


def _group_nodes(loads: np.ndarray, topology: PlacementTopology, refine_steps: int) -> np.ndarray:
    """Node of every group ``[layers, groups]``; the global policy is one group on one node."""
    num_layers, num_experts = loads.shape
    if topology.policy is PlacementPolicy.GLOBAL:
        return np.zeros((num_layers, 1), dtype=np.int64)
    num_groups = topology.num_groups
    group_loads = loads.reshape(num_layers, num_groups, num_experts // num_groups).sum(axis=2)
    return packing.pack_groups(group_loads, topology.num_nodes, refine_steps)


def place_on_nodes(
    loads: np.ndarray,
    topology: PlacementTopology,
    group_node: np.ndarray,
    replication_loads: np.ndarray | None = None,
) -> np.ndarray:
    """Greedy slot map ``[layers, num_slots]`` with every group on its node of ``group_node``
    ``[layers, groups]``; copy counts from ``replication_loads`` when given (perturbed restarts),
    else from ``loads``."""
    num_nodes = topology.num_nodes if topology.policy is PlacementPolicy.HIERARCHICAL else 1
    return packing.place_hierarchical(
        loads, group_node, topology.num_slots, num_nodes, topology.num_gpus, replication_loads
    )


def refined_slot_map(
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
    space = search_space(topology)
    goal = SearchGoal(max_steps=step_budget(topology))
    is_pinned = group_node is not None
    if group_node is None:
        group_node = _group_nodes(loads, topology, refine_steps=0)
    starts = [greedy]
    if topology.policy is PlacementPolicy.HIERARCHICAL and topology.num_nodes > 1 and not is_pinned:
        refined_groups = _group_nodes(loads, topology, refine_steps=4 * topology.num_groups)
        if (refined_groups != group_node).any():
            starts.append(place_on_nodes(loads, topology, refined_groups))
    rng = np.random.default_rng(_RESTART_SEED)
    for _ in range(_NUM_RESTARTS):
        noise = rng.uniform(1.0 - _RESTART_NOISE, 1.0 + _RESTART_NOISE, size=loads.shape)
        starts.append(place_on_nodes(loads, topology, group_node, replication_loads=loads * noise))
    best = greedy
    best_key = _balance_key(greedy, loads, topology)
    for start in starts:
        refined = refine_slot_map(start, loads, space, goal)
        key = _balance_key(refined, loads, topology)
        is_better = (key[0] < best_key[0]) | ((key[0] == best_key[0]) & (key[1] < best_key[1]))
        best = np.where(is_better[:, None], refined, best)
        best_key = (
            np.where(is_better, key[0], best_key[0]),
            np.where(is_better, key[1], best_key[1]),
        )
    if topology.policy is PlacementPolicy.GLOBAL and topology.num_nodes > 1:
        arranged = packing.arrange_gpus_on_nodes(
            best, loads, topology.num_gpus, topology.num_nodes, refine_steps=4 * topology.num_gpus
        )
        is_better = _balance_key(arranged, loads, topology)[1] < best_key[1]
        best = np.where(is_better[:, None], arranged, best)
    return best


def _balance_key(
    slot_to_expert: np.ndarray, loads: np.ndarray, topology: PlacementTopology
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer (max GPU load, max node load): lower is better, compared in that order."""
    per_gpu = packing.gpu_loads(slot_to_expert, loads, topology.num_gpus)
    per_node = per_gpu.reshape(per_gpu.shape[0], topology.num_nodes, -1).sum(axis=2)
    return per_gpu.max(axis=1), per_node.max(axis=1)


def max_gpu_load(
    slot_to_expert: np.ndarray, loads: np.ndarray, topology: PlacementTopology
) -> np.ndarray:
    """Per layer the load of the heaviest GPU, ``[layers]``."""
    return packing.gpu_loads(slot_to_expert, loads, topology.num_gpus).max(axis=1)


def search_space(topology: PlacementTopology) -> SearchSpace:
    """Where the local search may move copies: within nodes for the hierarchical policy."""
    return SearchSpace(
        num_gpus=topology.num_gpus,
        num_nodes=topology.num_nodes,
        is_node_local=topology.policy is PlacementPolicy.HIERARCHICAL,
    )


def step_budget(topology: PlacementTopology) -> int:
    """Local-search steps per plan: enough to touch every slot a few times."""
    return 4 * topology.num_slots


