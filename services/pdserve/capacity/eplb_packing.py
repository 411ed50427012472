"""Array kernels that build expert placements: balanced packing, greedy replication, hierarchy.

These are the building blocks of the greedy placement that DeepSeek describes for its EPLB
(deepseek-ai/EPLB README: pack expert groups onto nodes evenly, replicate the expert with the
highest load per copy one slot at a time, pack the copies onto GPUs evenly). They are written here
from that description; no code was taken from it. ``pdserve.capacity.eplb`` is the public entry
point; everything here works on plain arrays and trusts its caller to have validated them.

Every kernel works on a batch of independent rows (layers, or (layer, node) pairs) at once, so a
loop runs over items or copies, never over layers.
"""

from __future__ import annotations

import numpy as np

_FULL = np.inf


def balanced_packing(item_weights: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` items per row into ``num_packs`` packs of exactly ``n // num_packs`` items each.

    Heaviest item first, each onto the lightest pack that still has room (ties: lowest pack
    index). ``item_weights`` is ``[num_rows, n]`` with ``n % num_packs == 0``. Returns
    ``(pack_of_item, rank_in_pack)``, both ``[num_rows, n]`` int64; ``rank_in_pack`` numbers the
    items of a pack 0.. in the order they were placed.
    """
    num_rows, num_items = item_weights.shape
    assert num_items % num_packs == 0, (num_items, num_packs)
    items_per_pack = num_items // num_packs
    order = np.argsort(-item_weights, axis=1, kind="stable")
    rows = np.arange(num_rows)
    pack_load = np.zeros((num_rows, num_packs))
    pack_count = np.zeros((num_rows, num_packs), dtype=np.int64)
    pack_of_item = np.empty((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, num_items), dtype=np.int64)
    for step in range(num_items):
        item = order[:, step]
        pack = np.argmin(np.where(pack_count < items_per_pack, pack_load, _FULL), axis=1)
        pack_of_item[rows, item] = pack
        rank_in_pack[rows, item] = pack_count[rows, pack]
        pack_load[rows, pack] += item_weights[rows, item]
        pack_count[rows, pack] += 1
    return pack_of_item, rank_in_pack


def refine_packing(
    item_weights: np.ndarray, pack_of_item: np.ndarray, num_packs: int, max_steps: int
) -> np.ndarray:
    """Improve an equal-count packing by swapping items between the heaviest pack and any other.

    ``item_weights`` and ``pack_of_item`` are ``[num_rows, n]``. Each step swaps, per row, the pair
    (item on the heaviest pack, item elsewhere) that lowers the larger of the two packs' new loads
    the most, and only if that is strictly below the current maximum, so the (max load, number of
    packs at max) pair falls at every step and a row never gets worse. Counts per pack are kept.
    Returns the new ``pack_of_item``.
    """
    num_rows, num_items = item_weights.shape
    items_per_pack = num_items // num_packs
    pack_of_item = pack_of_item.copy()
    rows = np.arange(num_rows)
    is_active = np.ones(num_rows, dtype=bool)
    for _ in range(max_steps):
        act = rows[is_active]
        packs = pack_of_item[act]
        weights = item_weights[act]
        one_hot = packs[:, :, None] == np.arange(num_packs)[None, None, :]
        pack_load = np.einsum("rn,rnp->rp", weights, one_hot)
        heaviest = np.argmax(pack_load, axis=1)
        max_load = pack_load[np.arange(act.size), heaviest]
        on_heaviest = packs == heaviest[:, None]
        # The items of the heaviest pack, [rows, items_per_pack], in item order.
        heavy_items = np.argsort(~on_heaviest, axis=1, kind="stable")[:, :items_per_pack]
        heavy_weight = np.take_along_axis(weights, heavy_items, axis=1)
        # Swap heavy item a with item b elsewhere: heaviest pack and b's pack, after the swap.
        delta = weights[:, None, :] - heavy_weight[:, :, None]
        new_heavy = max_load[:, None, None] + delta
        other_load = np.take_along_axis(pack_load, packs, axis=1)
        new_other = other_load[:, None, :] - delta
        value = np.where(on_heaviest[:, None, :], _FULL, np.maximum(new_heavy, new_other))
        value = value.reshape(act.size, -1)
        best = np.argmin(value, axis=1)
        improves = value[np.arange(act.size), best] < max_load * (1.0 - 1e-12)
        is_active[act[~improves]] = False
        if not improves.any():
            break
        act, best = act[improves], best[improves]
        heavy_index, item_b = np.divmod(best, num_items)
        item_a = heavy_items[improves, heavy_index]
        pack_a = pack_of_item[act, item_a]
        pack_of_item[act, item_a] = pack_of_item[act, item_b]
        pack_of_item[act, item_b] = pack_a
    return pack_of_item


def ranks_within_packs(pack_of_item: np.ndarray, num_packs: int) -> np.ndarray:
    """Number the items of each pack 0.. in item order. ``[num_rows, n]`` -> ``[num_rows, n]``."""
    one_hot = (pack_of_item[:, :, None] == np.arange(num_packs)[None, None, :]).astype(np.int64)
    before = np.cumsum(one_hot, axis=1) - one_hot
    return np.take_along_axis(before, pack_of_item[:, :, None], axis=2)[:, :, 0]


def replicate_greedy(weights: np.ndarray, num_copies_total: int) -> np.ndarray:
    """Copy counts ``[num_rows, n]``: one copy each, then each extra copy to the highest load/copy.

    This minimises the largest load per copy for the given total (a classic exchange argument),
    which is optimal when each GPU holds one slot. ``num_copies_total >= n``; ties go to the lowest
    index.
    """
    num_rows, num_logical = weights.shape
    assert num_copies_total >= num_logical, (num_copies_total, num_logical)
    counts = np.ones((num_rows, num_logical), dtype=np.int64)
    rows = np.arange(num_rows)
    for _ in range(num_copies_total - num_logical):
        hottest = np.argmax(weights / counts, axis=1)
        counts[rows, hottest] += 1
    return counts


def expand_counts(counts: np.ndarray) -> np.ndarray:
    """``[num_rows, n]`` copy counts with equal row sums -> ``[num_rows, total]`` logical ids."""
    num_rows, num_logical = counts.shape
    total = int(counts[0].sum())
    logical = np.tile(np.arange(num_logical), num_rows)
    return np.repeat(logical, counts.ravel()).reshape(num_rows, total)


def pack_copies(weights: np.ndarray, counts: np.ndarray, num_gpus: int) -> np.ndarray:
    """Lay copies out on GPUs: ``[num_rows, n]`` loads and copy counts -> ``[num_rows, slots]``.

    Each copy carries ``weight / count``; copies are balanced-packed onto ``num_gpus`` GPUs of
    ``slots // num_gpus`` slots, and slot ``s`` is on GPU ``s // slots_per_gpu``. The result holds
    the logical (row-local) id in every slot.
    """
    num_rows = weights.shape[0]
    copy_logical = expand_counts(counts)
    num_slots = copy_logical.shape[1]
    assert num_slots % num_gpus == 0, (num_slots, num_gpus)
    slots_per_gpu = num_slots // num_gpus
    copy_weight = np.take_along_axis(weights / counts, copy_logical, axis=1)
    gpu, rank = balanced_packing(copy_weight, num_gpus)
    slot_to_logical = np.empty_like(copy_logical)
    slot_to_logical[np.arange(num_rows)[:, None], gpu * slots_per_gpu + rank] = copy_logical
    return slot_to_logical


def pack_groups(group_loads: np.ndarray, num_nodes: int, refine_steps: int) -> np.ndarray:
    """Node of every expert group, ``[layers, groups]``, equal groups per node.

    Balanced packing, then (if ``refine_steps > 0``) swap refinement on the heaviest node.
    """
    group_node, _ = balanced_packing(group_loads, num_nodes)
    if refine_steps > 0:
        group_node = refine_packing(group_loads, group_node, num_nodes, refine_steps)
    return group_node


def place_hierarchical(
    expert_loads: np.ndarray,
    group_node: np.ndarray,
    num_slots: int,
    num_nodes: int,
    num_gpus: int,
    replication_loads: np.ndarray | None = None,
) -> np.ndarray:
    """Slot map ``[layers, num_slots]`` that keeps every expert group on the node
    ``group_node`` says.

    ``group_node`` is ``[layers, num_groups]`` with ``num_groups / num_nodes`` groups on every
    node. Within each node the node's experts are replicated greedily onto its
    ``num_slots / num_nodes`` slots and the copies balanced-packed onto its GPUs. The global
    policy is the special case of one group on one node. ``replication_loads`` (same shape as
    ``expert_loads``, default the loads themselves) decide the copy counts only; packing always
    uses the true loads.
    """
    num_layers, num_experts = expert_loads.shape
    num_groups = group_node.shape[1]
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_slots // num_nodes
    group_rank = ranks_within_packs(group_node, num_nodes)
    expert_node = np.repeat(group_node, group_size, axis=1)
    expert_local = np.repeat(group_rank, group_size, axis=1) * group_size + np.tile(
        np.arange(group_size), num_groups
    )
    local_to_expert = np.empty((num_layers, num_nodes, experts_per_node), dtype=np.int64)
    layer_index = np.arange(num_layers)[:, None]
    local_to_expert[layer_index, expert_node, expert_local] = np.arange(num_experts)[None, :]
    local_to_expert = local_to_expert.reshape(num_layers * num_nodes, experts_per_node)
    local_loads = np.take_along_axis(
        np.repeat(expert_loads, num_nodes, axis=0), local_to_expert, axis=1
    )
    if replication_loads is None:
        counts = replicate_greedy(local_loads, slots_per_node)
    else:
        skewed = np.take_along_axis(
            np.repeat(replication_loads, num_nodes, axis=0), local_to_expert, axis=1
        )
        counts = replicate_greedy(skewed, slots_per_node)
    slot_to_local = pack_copies(local_loads, counts, num_gpus // num_nodes)
    slot_to_expert = np.take_along_axis(local_to_expert, slot_to_local, axis=1)
    return slot_to_expert.reshape(num_layers, num_slots)


def copy_counts(slot_to_expert: np.ndarray, num_experts: int) -> np.ndarray:
    """Copies of every expert, ``[layers, num_experts]``, from a slot map ``[layers,
    num_slots]``."""
    num_layers = slot_to_expert.shape[0]
    offsets = (np.arange(num_layers) * num_experts)[:, None]
    flat = np.bincount((slot_to_expert + offsets).ravel(), minlength=num_layers * num_experts)
    return flat.reshape(num_layers, num_experts)


def slot_weights(slot_to_expert: np.ndarray, expert_loads: np.ndarray) -> np.ndarray:
    """Load carried by every slot, ``[layers, num_slots]``: the expert's load split evenly."""
    counts = copy_counts(slot_to_expert, expert_loads.shape[1])
    per_copy = expert_loads / np.maximum(counts, 1)
    return np.take_along_axis(per_copy, slot_to_expert, axis=1)


def gpu_loads(slot_to_expert: np.ndarray, expert_loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """Load on every GPU, ``[layers, num_gpus]``; slot ``s`` is on GPU ``s // slots_per_gpu``."""
    weights = slot_weights(slot_to_expert, expert_loads)
    return weights.reshape(weights.shape[0], num_gpus, -1).sum(axis=2)


def arrange_gpus_on_nodes(
    slot_to_expert: np.ndarray,
    expert_loads: np.ndarray,
    num_gpus: int,
    num_nodes: int,
    refine_steps: int,
) -> np.ndarray:
    """Permute whole GPUs among nodes to balance node loads; GPU balance is unchanged.

    Used by the global policy, where any GPU may sit on any node: the GPU loads are packed onto
    nodes (equal GPUs per node) and refined by swaps, and each GPU's block of slots moves with it.
    """
    num_layers, num_slots = slot_to_expert.shape
    slots_per_gpu = num_slots // num_gpus
    gpus_per_node = num_gpus // num_nodes
    loads = gpu_loads(slot_to_expert, expert_loads, num_gpus)
    node_of_gpu, _ = balanced_packing(loads, num_nodes)
    node_of_gpu = refine_packing(loads, node_of_gpu, num_nodes, refine_steps)
    new_gpu = node_of_gpu * gpus_per_node + ranks_within_packs(node_of_gpu, num_nodes)
    blocks = slot_to_expert.reshape(num_layers, num_gpus, slots_per_gpu)
    arranged = np.empty_like(blocks)
    arranged[np.arange(num_layers)[:, None], new_gpu] = blocks
    return arranged.reshape(num_layers, num_slots)
