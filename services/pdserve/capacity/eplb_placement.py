"""The vocabulary of redundant-expert placement (EPLB) and its metrics.

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

``gpu_balancedness`` and ``node_balancedness`` are the metrics (mean / max load per layer).
Plans come from ``eplb.plan_expert_placement`` (from scratch) and
``eplb_replan.replan_with_migration`` (for new loads, moving few copies).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from pdserve.capacity import eplb_packing as packing
from pdserve.common.errors import InvalidArgumentError


class PlacementPolicy(enum.StrEnum):
    """Where copies may go: groups pinned to nodes, or anywhere."""

    HIERARCHICAL = "hierarchical"
    GLOBAL = "global"



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



def gpu_loads(placement: ExpertPlacement, expert_loads: np.ndarray) -> np.ndarray:
    """Load on every GPU, ``[layers, num_gpus]``, each expert's load split evenly over its
    copies."""
    loads = validated_loads(expert_loads, placement.topology, num_experts=placement.num_experts)
    check_layers(loads, placement)
    return packing.gpu_loads(placement.slot_to_expert, loads, placement.topology.num_gpus)


def gpu_balancedness(placement: ExpertPlacement, expert_loads: np.ndarray) -> np.ndarray:
    """Per layer mean GPU load / max GPU load, ``[layers]`` in (0, 1]; 1.0 for a layer with no
    load."""
    return _balancedness(gpu_loads(placement, expert_loads))


def node_balancedness(placement: ExpertPlacement, expert_loads: np.ndarray) -> np.ndarray:
    """Per layer mean node load / max node load, ``[layers]`` in (0, 1]; 1.0 for no load."""
    per_gpu = gpu_loads(placement, expert_loads)
    per_node = per_gpu.reshape(per_gpu.shape[0], placement.topology.num_nodes, -1).sum(axis=2)
    return _balancedness(per_node)


def _balancedness(loads: np.ndarray) -> np.ndarray:
    return balancedness_from_max(loads.mean(axis=1), loads.max(axis=1))


def balancedness_from_max(mean_load: np.ndarray, max_load: np.ndarray) -> np.ndarray:
    """``mean / max`` elementwise, 1.0 where nothing is loaded."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(max_load > 0, mean_load / max_load, 1.0)


def validated_loads(
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
            f"expert_loads must be a non-empty 2-D matrix [num_layers, num_experts], got shape "
            f"{loads.shape}",
            field="expert_loads",
        )
    found_experts = loads.shape[1]
    if num_experts is not None and found_experts != num_experts:
        raise InvalidArgumentError(
            f"expert_loads must have one column per expert: expected {num_experts}, got "
            f"{found_experts}",
            field="expert_loads",
        )
    if not np.isfinite(loads).all():
        raise InvalidArgumentError(
            f"expert_loads must be finite, found {int((~np.isfinite(loads)).sum())} non-finite "
            "entries",
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


def check_layers(loads: np.ndarray, placement: ExpertPlacement) -> None:
    """``InvalidArgumentError`` unless ``loads`` has one row per layer of ``placement``."""
    if loads.shape[0] != placement.num_layers:
        raise InvalidArgumentError(
            f"expert_loads must have one row per layer of the placement: expected "
            f"{placement.num_layers}, got {loads.shape[0]}",
            field="expert_loads",
        )
