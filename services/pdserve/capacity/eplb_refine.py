"""Local search that lowers the heaviest GPU of a placement, one slot change at a time.

A placement is a slot map ``[layers, num_slots]`` (logical expert in every physical slot; slot
``s`` on GPU ``s // slots_per_gpu``). An expert's load is split evenly over its copies. The search
works on all layers at once: each step makes, in every layer still improving, the one move that
helps that layer's heaviest GPU ``h`` most. Moves:

* swap: exchange a slot of ``h`` with a slot of another GPU (two slots change expert);
* grow: turn a slot of an expert with spare copies, anywhere, into one more copy of an expert on
  ``h`` (every GPU holding that expert gets lighter; one slot changes);
* shrink: turn a slot of ``h`` whose expert has spare copies into a copy of an expert not on ``h``
  (one slot changes).

Grow and shrink change copy counts, so replication and packing are searched together: this is
how replication accounts for the granularity of slots per GPU. A move is taken only if ``h`` and
every GPU the move makes heavier end strictly below the current maximum, so per layer the pair
(max load, number of GPUs at max) falls at every step: the search never makes a layer worse and
always stops. New loads of GPUs that also hold the grown expert are over-estimated (its relief
there is ignored), which can only reject a move, never accept a bad one. Moves never put two
copies of one expert on a GPU and, when ``is_node_local``, never move a copy across nodes (the
hierarchical policy keeps every group on its node).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.capacity.eplb_packing import copy_counts

_NONE = np.inf
_STRICT = 1.0 - 1e-12


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Where slots live and which moves are allowed.

    ``num_gpus`` divides the slot count and ``num_nodes`` divides ``num_gpus``.
    ``is_node_local`` forbids moves between nodes.
    """

    num_gpus: int
    num_nodes: int
    is_node_local: bool


@dataclass(frozen=True, slots=True)
class SearchGoal:
    """When to stop and how to rank moves.

    ``max_steps`` bounds the work (one move per layer per step). ``target_max_load`` (``[layers]``
    or None) stops a layer as soon as its heaviest GPU is at or below it. With
    ``is_move_averse`` moves are ranked by load removed from the heaviest GPU per slot changed
    (for re-planning with few weight moves); otherwise by the lowest resulting load.
    """

    max_steps: int
    target_max_load: np.ndarray | None = None
    is_move_averse: bool = False


class _State:
    """Mutable search state; owned by one ``refine_slot_map`` call."""

    def __init__(self, slot_to_expert: np.ndarray, expert_loads: np.ndarray, space: SearchSpace):
        self.slot_to_expert = slot_to_expert.copy()
        self.expert_loads = expert_loads
        num_layers, num_slots = slot_to_expert.shape
        self.num_experts = expert_loads.shape[1]
        self.slots_per_gpu = num_slots // space.num_gpus
        self.gpu_of_slot = np.arange(num_slots) // self.slots_per_gpu
        self.node_of_gpu = np.arange(space.num_gpus) // (space.num_gpus // space.num_nodes)
        self.counts = copy_counts(self.slot_to_expert, self.num_experts)
        self.present = np.zeros((num_layers, space.num_gpus, self.num_experts), dtype=np.int16)
        layer_index = np.broadcast_to(np.arange(num_layers)[:, None], slot_to_expert.shape)
        np.add.at(self.present, (layer_index, self.gpu_of_slot[None, :], self.slot_to_expert), 1)

    def change(self, layers: np.ndarray, slots: np.ndarray, experts: np.ndarray) -> None:
        """Put ``experts[i]`` into slot ``slots[i]`` of layer ``layers[i]``."""
        old = self.slot_to_expert[layers, slots]
        gpus = self.gpu_of_slot[slots]
        np.add.at(self.counts, (layers, old), -1)
        np.add.at(self.counts, (layers, experts), 1)
        np.add.at(self.present, (layers, gpus, old), -1)
        np.add.at(self.present, (layers, gpus, experts), 1)
        self.slot_to_expert[layers, slots] = experts


def refine_slot_map(
    slot_to_expert: np.ndarray, expert_loads: np.ndarray, space: SearchSpace, goal: SearchGoal
) -> np.ndarray:
    """Return an improved copy of ``slot_to_expert`` (``[layers, slots]``) for ``expert_loads``.

    Every expert keeps at least one copy and every GPU keeps its slot count. The heaviest GPU of
    each layer never gets heavier than in the input.
    """
    state = _State(slot_to_expert, expert_loads, space)
    is_active = np.ones(slot_to_expert.shape[0], dtype=bool)
    for _ in range(goal.max_steps):
        layers = np.flatnonzero(is_active)
        if layers.size == 0:
            break
        keep = _step(state, layers, space, goal)
        is_active[layers[~keep]] = False
    return state.slot_to_expert


def _step(state: _State, layers: np.ndarray, space: SearchSpace, goal: SearchGoal) -> np.ndarray:
    """Make one move in each of ``layers``; return which of them moved (and may move again)."""
    view = _View(state, layers)
    moves = [
        _best_swap(state, view, space),
        _best_grow(state, view, space),
        _best_shrink(state, view, space),
    ]
    gains = np.stack([view.max_load - value for value, _, _ in moves])
    costs = np.array([2.0, 1.0, 1.0])[:, None]
    score = gains / costs if goal.is_move_averse else gains - 1e-9 * view.max_load * costs
    choice = np.argmax(score, axis=0)
    index = np.arange(layers.size)
    is_moving = gains[choice, index] > view.max_load * (1.0 - _STRICT)
    if goal.target_max_load is not None:
        is_moving &= view.max_load > goal.target_max_load[layers]
    for kind, (_, slots, experts) in enumerate(moves):
        chosen = np.flatnonzero(is_moving & (choice == kind))
        if chosen.size:
            state.change(
                np.repeat(layers[chosen], slots.shape[1]),
                slots[chosen].ravel(),
                experts[chosen].ravel(),
            )
    return is_moving


class _View:
    """Per-step derived arrays for the active layers (first axis ``A = len(layers)``)."""

    def __init__(self, state: _State, layers: np.ndarray):
        self.layers = layers
        self.slot_to_expert = state.slot_to_expert[layers]
        self.loads = state.expert_loads[layers]
        self.counts = state.counts[layers]
        num_active = layers.size
        num_gpus = state.present.shape[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            self.per_copy = self.loads / self.counts
            # Load per copy if an expert gives one copy away (only meaningful where can_give).
            self.can_give = self.counts >= 2
            self.give_up = np.where(
                self.can_give, self.loads / np.maximum(self.counts - 1, 1), self.per_copy
            )
        self.weight = np.take_along_axis(self.per_copy, self.slot_to_expert, axis=1)
        self.gpu_load = self.weight.reshape(num_active, num_gpus, -1).sum(axis=2)
        self.heaviest = np.argmax(self.gpu_load, axis=1)
        self.max_load = self.gpu_load[np.arange(num_active), self.heaviest]
        k = state.slots_per_gpu
        self.heavy_slots = self.heaviest[:, None] * k + np.arange(k)[None, :]
        self.heavy_experts = np.take_along_axis(self.slot_to_expert, self.heavy_slots, axis=1)
        self.slot_gpu_load = self.gpu_load[:, state.gpu_of_slot]
        # n_heavy_has[a, s]: copies of slot s's expert on the heaviest GPU.
        self.heavy_has_slot_expert = state.present[
            layers[:, None], self.heaviest[:, None], self.slot_to_expert
        ]
        # gpu_has_heavy[a, i, s]: copies of heavy slot i's expert on slot s's GPU.
        self.gpu_has_heavy = state.present[
            layers[:, None, None], state.gpu_of_slot[None, None, :], self.heavy_experts[:, :, None]
        ]
        self.is_other_gpu = state.gpu_of_slot[None, :] != self.heaviest[:, None]
        if state.node_of_gpu.size and state.node_of_gpu[-1] > 0:
            self.is_other_gpu_same_node = self.is_other_gpu & (
                state.node_of_gpu[state.gpu_of_slot][None, :]
                == state.node_of_gpu[self.heaviest][:, None]
            )
        else:
            self.is_other_gpu_same_node = self.is_other_gpu
        self._state = state
        self.others_excluding_own, self.others_all = self._other_holders_max()

    def reachable(self, space: SearchSpace) -> np.ndarray:
        """Slots ``[A, S]`` a copy on the heaviest GPU may be exchanged with."""
        return self.is_other_gpu_same_node if space.is_node_local else self.is_other_gpu

    def _other_holders_max(self) -> tuple[np.ndarray, np.ndarray]:
        """Per slot ``s`` (expert ``y``): heaviest GPU load among y's other holders if y gives a
        copy.

        Returns ``(excluding_own_gpu [A, S], all_holders [A, E])``: the largest
        ``load + copies_there * extra`` over GPUs holding ``y``, never counting the heaviest GPU,
        and in the first array not counting slot ``s``'s own GPU either. ``-inf`` when none.
        """
        state = self._state
        num_active = self.slot_to_expert.shape[0]
        extra = np.take_along_axis(self.give_up - self.per_copy, self.slot_to_expert, axis=1)
        has_there = state.present[
            self.layers[:, None], state.gpu_of_slot[None, :], self.slot_to_expert
        ]
        value = np.where(self.is_other_gpu, self.slot_gpu_load + has_there * extra, -np.inf)
        order = np.lexsort((-value, self.slot_to_expert), axis=-1)
        sorted_expert = np.take_along_axis(self.slot_to_expert, order, axis=1)
        sorted_value = np.take_along_axis(value, order, axis=1)
        sorted_gpu = state.gpu_of_slot[order]
        is_first = np.ones_like(sorted_expert, dtype=bool)
        is_first[:, 1:] = sorted_expert[:, 1:] != sorted_expert[:, :-1]
        is_second = np.zeros_like(is_first)
        is_second[:, 1:] = ~is_first[:, 1:] & is_first[:, :-1]
        top1 = np.full((num_active, state.num_experts), -np.inf)
        top1_gpu = np.full((num_active, state.num_experts), -1)
        top2 = np.full((num_active, state.num_experts), -np.inf)
        rows, cols = np.nonzero(is_first)
        top1[rows, sorted_expert[rows, cols]] = sorted_value[rows, cols]
        top1_gpu[rows, sorted_expert[rows, cols]] = sorted_gpu[rows, cols]
        rows, cols = np.nonzero(is_second)
        top2[rows, sorted_expert[rows, cols]] = sorted_value[rows, cols]
        own_top1 = np.take_along_axis(top1, self.slot_to_expert, axis=1)
        own_top1_gpu = np.take_along_axis(top1_gpu, self.slot_to_expert, axis=1)
        own_top2 = np.take_along_axis(top2, self.slot_to_expert, axis=1)
        excluding = np.where(own_top1_gpu == state.gpu_of_slot[None, :], own_top2, own_top1)
        return excluding, top1


def _pick(value: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best (lowest) entry of ``value [A, m, n]``: ``(value [A], index_m [A], index_n [A])``."""
    flat = value.reshape(value.shape[0], -1)
    best = np.argmin(flat, axis=1)
    index_m, index_n = np.divmod(best, value.shape[2])
    return flat[np.arange(flat.shape[0]), best], index_m, index_n


def _best_swap(state: _State, view: _View, space: SearchSpace):
    """Swap heavy slot ``i`` with slot ``s`` of another GPU ``g``: value = max(new h, new g)."""
    heavy_weight = np.take_along_axis(view.weight, view.heavy_slots, axis=1)
    delta = view.weight[:, None, :] - heavy_weight[:, :, None]
    value = np.maximum(view.max_load[:, None, None] + delta, view.slot_gpu_load[:, None, :] - delta)
    is_valid = (
        view.reachable(space)[:, None, :]
        & (view.gpu_has_heavy == 0)
        & (view.heavy_has_slot_expert == 0)[:, None, :]
    )
    best, heavy_index, slot = _pick(np.where(is_valid, value, _NONE))
    rows = np.arange(view.layers.size)
    heavy_slot = view.heavy_slots[rows, heavy_index]
    slots = np.stack([heavy_slot, slot], axis=1)
    experts = np.stack(
        [view.slot_to_expert[rows, slot], view.heavy_experts[rows, heavy_index]], axis=1
    )
    return best, slots, experts


def _best_grow(state: _State, view: _View, space: SearchSpace):
    """Slot ``s`` (expert ``y`` with spare copies, GPU ``g``) becomes a copy of heavy expert
    ``x``."""
    rows = np.arange(view.layers.size)
    x = view.heavy_experts
    x_count = np.take_along_axis(view.counts, x, axis=1)
    x_new_weight = np.take_along_axis(view.loads, x, axis=1) / (x_count + 1)
    x_relief = np.take_along_axis(view.per_copy, x, axis=1) - x_new_weight
    heavy_has_x = state.present[view.layers[:, None], view.heaviest[:, None], x]
    y_new_weight = np.take_along_axis(view.give_up, view.slot_to_expert, axis=1)
    y_extra = y_new_weight - view.weight
    # New load of h (slot s elsewhere), of g, and of y's other holders.
    new_heavy = (
        view.max_load[:, None, None]
        - (heavy_has_x * x_relief)[:, :, None]
        + (view.heavy_has_slot_expert * y_extra)[:, None, :]
    )
    gpu_has_y = state.present[view.layers[:, None], state.gpu_of_slot[None, :], view.slot_to_expert]
    # g loses y's old copy in s, gains x's new one; its other x and y copies change weight.
    new_own = (
        view.slot_gpu_load[:, None, :]
        - view.gpu_has_heavy * x_relief[:, :, None]
        + (gpu_has_y * y_extra - y_new_weight)[:, None, :]
        + x_new_weight[:, :, None]
    )
    value = np.maximum(np.maximum(new_heavy, new_own), view.others_excluding_own[:, None, :])
    # A slot on h itself is never valid: x is on h already (no two copies on one GPU).
    is_valid = (
        np.take_along_axis(view.can_give, view.slot_to_expert, axis=1)[:, None, :]
        & (view.gpu_has_heavy == 0)
        & view.reachable(space)[:, None, :]
    )
    best, heavy_index, slot = _pick(np.where(is_valid, value, _NONE))
    return best, slot[:, None], x[rows, heavy_index][:, None]


def _best_shrink(state: _State, view: _View, space: SearchSpace):
    """Heavy slot ``i`` (expert ``y`` with spare copies) becomes a copy of expert ``z`` not on h.

    Only experts of the heaviest GPU's node qualify under the node-local rule, and every expert
    of a node lives on that node, so there ``z`` is limited to experts already on h's node.
    """
    rows = np.arange(view.layers.size)
    y_weight = np.take_along_axis(view.weight, view.heavy_slots, axis=1)
    y_new_weight = np.take_along_axis(view.give_up, view.heavy_experts, axis=1)
    y_extra = y_new_weight - y_weight
    heavy_has_y = state.present[view.layers[:, None], view.heaviest[:, None], view.heavy_experts]
    z_new_weight = view.loads / (view.counts + 1)
    new_heavy = (
        view.max_load[:, None, None]
        - y_weight[:, :, None]
        + z_new_weight[:, None, :]
        + ((heavy_has_y - 1) * y_extra)[:, :, None]
    )
    others = np.take_along_axis(view.others_all, view.heavy_experts, axis=1)
    value = np.maximum(new_heavy, others[:, :, None])
    heavy_has = state.present[view.layers, view.heaviest] > 0
    is_valid = (
        np.take_along_axis(view.can_give, view.heavy_experts, axis=1)[:, :, None]
        & ~heavy_has[:, None, :]
    )
    if space.is_node_local:
        is_valid &= _node_has_expert(state, view)[:, None, :]
    best, heavy_index, z = _pick(np.where(is_valid, value, _NONE))
    return best, view.heavy_slots[rows, heavy_index][:, None], z[:, None]


def _node_has_expert(state: _State, view: _View) -> np.ndarray:
    """``[A, E]``: experts with a copy on the heaviest GPU's node (all experts for one node)."""
    gpus_per_node = state.present.shape[1] // (int(state.node_of_gpu[-1]) + 1)
    node = state.node_of_gpu[view.heaviest]
    node_gpus = node[:, None] * gpus_per_node + np.arange(gpus_per_node)[None, :]
    return state.present[view.layers[:, None], node_gpus].sum(axis=1) > 0
