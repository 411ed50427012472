"""Kernels for re-planning with few expert-weight moves (``eplb_replan.replan_with_migration``).

* ``align_to_current`` relabels a plan computed from scratch so that it keeps as many slots of the
  current placement as it can. GPU numbering and slot order on a GPU carry no meaning for
  balance: whole GPUs are matched to current GPUs by how many experts they share (greedily,
  largest overlap first) and on each GPU an expert already in a slot keeps it. When nodes must
  stay whole (hierarchical policy) nodes are matched first, GPUs only within matched nodes.
* ``revert_toward_current`` gives slots of a plan back their current expert where balance allows.
* ``recount_current`` changes the current copy counts (and, optionally, the node of whole
  groups) by rewriting as few slots as possible.
* ``repack_extremes`` re-packs the heaviest and lightest GPUs together (a large-neighbourhood step
  for when single moves are stuck).

Every slot whose expert changes is one expert copy to load.
"""

from __future__ import annotations

import numpy as np

from pdserve.capacity.eplb_packing import balanced_packing, copy_counts, refine_packing


def align_to_current(
    new: np.ndarray, current: np.ndarray, num_gpus: int, num_nodes: int
) -> np.ndarray:
    """Relabel ``new`` (``[layers, slots]``) to agree with ``current`` in as many slots as it can.

    Balance is unchanged: only GPUs (within ``num_nodes`` blocks that move whole; 1 = any GPU
    may match any GPU) and slots within a GPU are permuted.
    """
    num_layers, num_slots = new.shape
    slots_per_gpu = num_slots // num_gpus
    num_experts = int(max(new.max(), current.max())) + 1
    aligned = np.empty_like(new)
    for layer in range(num_layers):
        new_gpus = new[layer].reshape(num_gpus, slots_per_gpu)
        current_gpus = current[layer].reshape(num_gpus, slots_per_gpu)
        new_to_current = _match_gpus(new_gpus, current_gpus, num_nodes, num_experts)
        out = aligned[layer].reshape(num_gpus, slots_per_gpu)
        for new_gpu, current_gpu in enumerate(new_to_current):
            out[current_gpu] = _order_like(new_gpus[new_gpu], current_gpus[current_gpu])
    return aligned


def _match_gpus(
    new_gpus: np.ndarray, current_gpus: np.ndarray, num_nodes: int, num_experts: int
) -> np.ndarray:
    """``[num_gpus]`` current GPU for every new GPU; nodes (blocks of GPUs) stay whole."""
    num_gpus = new_gpus.shape[0]
    gpus_per_node = num_gpus // num_nodes
    if num_nodes > 1:
        new_nodes = _histograms(new_gpus.reshape(num_nodes, -1), num_experts)
        current_nodes = _histograms(current_gpus.reshape(num_nodes, -1), num_experts)
        node_overlap = np.minimum(new_nodes[:, None, :], current_nodes[None, :, :]).sum(axis=2)
        node_map = greedy_match(node_overlap)
    else:
        node_map = np.zeros(1, dtype=np.int64)
    new_to_current = np.empty(num_gpus, dtype=np.int64)
    for new_node, current_node in enumerate(node_map):
        new_block = new_gpus[new_node * gpus_per_node : (new_node + 1) * gpus_per_node]
        current_block = current_gpus[
            current_node * gpus_per_node : (current_node + 1) * gpus_per_node
        ]
        has_expert = _histograms(current_block, num_experts) > 0
        # overlap[i, j]: experts of new GPU i that current GPU j holds too.
        overlap = has_expert[:, new_block].sum(axis=2).T
        gpu_map = greedy_match(overlap)
        new_to_current[new_node * gpus_per_node : (new_node + 1) * gpus_per_node] = (
            current_node * gpus_per_node + gpu_map
        )
    return new_to_current


def _histograms(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """``[n, m]`` expert ids -> ``[n, num_experts]`` copies of each expert per row."""
    num_rows = rows.shape[0]
    offsets = (np.arange(num_rows) * num_experts)[:, None]
    flat = np.bincount((rows + offsets).ravel(), minlength=num_rows * num_experts)
    return flat.reshape(num_rows, num_experts)


def greedy_match(overlap: np.ndarray) -> np.ndarray:
    """Perfect matching of rows to columns of a square ``overlap``: largest overlaps first.

    ``match[row]`` is the column; rows left without a positive overlap take free columns in order.
    """
    size = overlap.shape[0]
    match = np.full(size, -1, dtype=np.int64)
    is_taken = np.zeros(size, dtype=bool)
    rows, cols = np.nonzero(overlap > 0)
    order = np.argsort(-overlap[rows, cols], kind="stable")
    for row, col in zip(rows[order].tolist(), cols[order].tolist(), strict=True):
        if match[row] < 0 and not is_taken[col]:
            match[row] = col
            is_taken[col] = True
    free_cols = iter(np.flatnonzero(~is_taken).tolist())
    for row in np.flatnonzero(match < 0).tolist():
        match[row] = next(free_cols)
    return match


def _order_like(new_experts: np.ndarray, current_experts: np.ndarray) -> np.ndarray:
    """Order one GPU's new experts so that any expert already in a slot keeps that slot."""
    if new_experts.size == 1:
        return new_experts
    remaining = new_experts.tolist()
    out = [-1] * len(remaining)
    for position, expert in enumerate(current_experts.tolist()):
        if expert in remaining:
            remaining.remove(expert)
            out[position] = expert
    fill = iter(remaining)
    return np.array(
        [expert if expert >= 0 else next(fill) for expert in out], dtype=new_experts.dtype
    )


def revert_toward_current(
    plan: np.ndarray,
    current: np.ndarray,
    expert_loads: np.ndarray,
    max_gpu_load: np.ndarray,
    num_gpus: int,
    node_of_group_slots: int,
) -> np.ndarray:
    """Give slots of ``plan`` back their ``current`` expert wherever balance allows.

    Per layer (``[layers, slots]`` maps, ``expert_loads`` ``[layers, experts]``), each slot that
    differs is reverted, most relieving first, if afterwards the heaviest GPU stays at or below
    ``max_gpu_load[layer]``, every expert keeps a copy, no GPU holds an expert twice and (with
    ``node_of_group_slots`` > 1 nodes whose experts must stay together) the expert lives on that
    node already. Passes repeat until none is reverted. Used when a plan from scratch is needed
    to reach the balance target, to keep what it need not change.
    """
    reverted = plan.copy()
    num_slots = plan.shape[1]
    slots_per_gpu = num_slots // num_gpus
    slots_per_node = num_slots // node_of_group_slots
    for layer in range(plan.shape[0]):
        reverted[layer] = _revert_layer(
            reverted[layer],
            current[layer],
            expert_loads[layer],
            max_gpu_load[layer],
            slots_per_gpu,
            slots_per_node,
        )
    return reverted


def _revert_layer(
    plan: np.ndarray,
    current: np.ndarray,
    loads: np.ndarray,
    max_gpu_load: float,
    slots_per_gpu: int,
    slots_per_node: int,
) -> np.ndarray:
    plan = plan.copy()
    num_slots = plan.size
    num_experts = loads.size
    gpu_of_slot = np.arange(num_slots) // slots_per_gpu
    node_of_slot = np.arange(num_slots) // slots_per_node
    limit = max_gpu_load * (1.0 + 1e-12)
    is_changed = True
    while is_changed:
        is_changed = False
        counts = np.bincount(plan, minlength=num_experts)
        # Most relieving first: slots whose current expert carries the least load per copy.
        differing = np.flatnonzero(plan != current)
        order = differing[
            np.argsort(loads[current[differing]] / (counts[current[differing]] + 1), kind="stable")
        ]
        for slot in order.tolist():
            old, new = int(plan[slot]), int(current[slot])
            if counts[old] < 2:
                continue
            gpu = gpu_of_slot[slot]
            on_gpu = plan[gpu * slots_per_gpu : (gpu + 1) * slots_per_gpu]
            if (on_gpu == new).any():
                continue
            if counts[new] and (node_of_slot[plan == new] != node_of_slot[slot]).any():
                continue
            plan[slot] = new
            counts[old] -= 1
            counts[new] += 1
            weights = loads[plan] / counts[plan]
            if weights.reshape(-1, slots_per_gpu).sum(axis=1).max() <= limit:
                is_changed = True
            else:
                plan[slot] = old
                counts[old] += 1
                counts[new] -= 1
    return plan


def recount_current(
    current: np.ndarray,
    target_counts: np.ndarray,
    expert_loads: np.ndarray,
    num_gpus: int,
    num_nodes: int,
    expert_node: np.ndarray | None = None,
) -> np.ndarray:
    """Change ``current``'s copy counts to ``target_counts`` by rewriting as few slots as possible.

    Per layer, an expert with too many copies gives up those on its heaviest GPUs; the freed
    slots go to experts with too few, heaviest new copy first, each to the lightest GPU with a
    freed slot that does not hold the expert yet. With ``num_nodes`` > 1 (nodes whose experts must
    stay together) a copy only goes to its expert's node: ``expert_node`` (``[layers, experts]``)
    when given, which may move whole groups (all their copies are rewritten), otherwise the node
    the expert is on now. The caller guarantees that the target counts fill every node exactly.
    A start for local search.
    """
    num_layers, num_slots = current.shape
    slots_per_gpu = num_slots // num_gpus
    slots_per_node = num_slots // num_nodes
    recounted = current.copy()
    for layer in range(num_layers):
        home = None if expert_node is None else expert_node[layer]
        recounted[layer] = _recount_layer(
            current[layer],
            target_counts[layer],
            expert_loads[layer],
            slots_per_gpu,
            slots_per_node,
            home,
        )
    return recounted


def _recount_layer(
    current: np.ndarray,
    target: np.ndarray,
    loads: np.ndarray,
    slots_per_gpu: int,
    slots_per_node: int,
    home: np.ndarray | None,
) -> np.ndarray:
    plan = current.copy()
    node_of_slot = np.arange(plan.size) // slots_per_node
    if home is None:
        home = np.empty(target.size, dtype=np.int64)
        home[plan] = node_of_slot
    else:
        plan[home[plan] != node_of_slot] = -1
    counts = np.bincount(plan[plan >= 0], minlength=target.size)
    if (counts == target).all():
        return plan
    weight = loads / target
    gpu_of_slot = np.arange(plan.size) // slots_per_gpu
    gpu_load = np.bincount(
        gpu_of_slot[plan >= 0],
        weights=weight[plan[plan >= 0]],
        minlength=plan.size // slots_per_gpu,
    )
    for expert in np.flatnonzero(counts > target).tolist():
        slots = np.flatnonzero(plan == expert)
        freed = slots[np.argsort(-gpu_load[gpu_of_slot[slots]], kind="stable")][
            : counts[expert] - target[expert]
        ]
        gpu_load[gpu_of_slot[freed]] -= weight[expert]
        plan[freed] = -1
    deficit = np.flatnonzero(counts < target)
    copies = np.repeat(deficit, (target - counts)[deficit])
    for expert in copies[np.argsort(-weight[copies], kind="stable")].tolist():
        free = np.flatnonzero(plan == -1)
        free = free[node_of_slot[free] == home[expert]]
        holds = np.array(
            [
                (plan[g * slots_per_gpu : (g + 1) * slots_per_gpu] == expert).any()
                for g in gpu_of_slot[free]
            ]
        )
        candidates = free[~holds] if (~holds).any() else free
        slot = candidates[np.argmin(gpu_load[gpu_of_slot[candidates]])]
        plan[slot] = expert
        gpu_load[gpu_of_slot[slot]] += weight[expert]
    return plan


def repack_extremes(
    slot_to_expert: np.ndarray,
    expert_loads: np.ndarray,
    num_gpus: int,
    num_nodes: int,
    num_pairs: int,
) -> np.ndarray:
    """Re-pack the ``num_pairs`` heaviest and lightest GPUs of each layer together.

    A large-neighbourhood step for when single moves are stuck: the copies on those GPUs (on the
    heaviest GPU's node when ``num_nodes`` > 1 nodes must stay whole) are balanced-packed anew
    among them and swap-refined, then matched back onto the same GPUs so that copies that can
    stay do. At most ``2 * num_pairs * slots_per_gpu`` slots change per layer.
    """
    num_layers, num_slots = slot_to_expert.shape
    slots_per_gpu = num_slots // num_gpus
    gpus_per_node = num_gpus // num_nodes
    num_experts = expert_loads.shape[1]
    counts = copy_counts(slot_to_expert, num_experts)
    weights = np.take_along_axis(expert_loads / np.maximum(counts, 1), slot_to_expert, axis=1)
    gpu_load = weights.reshape(num_layers, num_gpus, slots_per_gpu).sum(axis=2)
    repacked = slot_to_expert.copy()
    for layer in range(num_layers):
        node = int(np.argmax(gpu_load[layer])) // gpus_per_node if num_nodes > 1 else 0
        span = (
            np.arange(node * gpus_per_node, (node + 1) * gpus_per_node)
            if num_nodes > 1
            else np.arange(num_gpus)
        )
        by_load = span[np.argsort(gpu_load[layer, span], kind="stable")]
        size = min(num_pairs, by_load.size // 2)
        if size < 1:
            continue
        chosen = np.concatenate([by_load[-size:], by_load[:size]])
        blocks = repacked[layer].reshape(num_gpus, slots_per_gpu)
        items = blocks[chosen].ravel()
        item_weight = weights[layer].reshape(num_gpus, slots_per_gpu)[chosen].ravel()[None, :]
        pack, _ = balanced_packing(item_weight, chosen.size)
        pack = refine_packing(item_weight, pack, chosen.size, max_steps=4 * items.size)[0]
        new_gpus = items[np.argsort(pack, kind="stable")].reshape(chosen.size, slots_per_gpu)
        mapping = _match_gpus(new_gpus, blocks[chosen], 1, num_experts)
        for index, target in enumerate(mapping.tolist()):
            blocks[chosen[target]] = _order_like(new_gpus[index], blocks[chosen[target]].copy())
    return repacked
