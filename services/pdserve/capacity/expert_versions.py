"""Issued expert placements as the governor keeps them: the durable key of a pool and its
``GetExpertPlacement`` name (``placement_key``: ``<deployment>`` for the decode pool,
``<deployment>:prefill`` for the prefill pool), and one versioned placement with its JSON form
(``PlacementVersion``). A version is issued once and never reused: workers ignore versions at or
below the one in force."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.capacity.eplb_placement import ExpertPlacement, PlacementPolicy, PlacementTopology
from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import WorkerRole


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

