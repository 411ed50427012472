"""Protos <-> values for the expert-placement loop: what a worker says about itself
(``WorkerInfo`` -> ``WorkerInstance``), a placement as the worker takes it
(``ApplyExpertPlacementRequest``) and as the governor's API shows it (``ExpertPlacement``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import governor_pb2, worker_pb2
from pdserve.capacity.eplb_placement import ExpertPlacement
from pdserve.common.types import WorkerRecord


@dataclass(frozen=True, slots=True)
class WorkerInstance:
    """What a worker says about itself: the GPUs its experts spread over, its model, and the
    placement version in force."""

    num_gpus: int
    model: str
    version: int


def instance_from_info(info: pb.WorkerInfo, version: int = 0) -> WorkerInstance:
    return WorkerInstance(max(1, info.num_gpus or info.tp_size or 1), info.model, version)


def instance_from_spec(record: WorkerRecord) -> tuple[int, str] | None:
    """(GPUs, model) from the worker's registration, if the store kept it."""
    if not record.spec:
        return None
    info = pb.WorkerInfo()
    info.ParseFromString(record.spec)
    if not info.model:
        return None
    instance = instance_from_info(info)
    return instance.num_gpus, instance.model


def apply_request(placement: ExpertPlacement,
                  version: int) -> worker_pb2.ApplyExpertPlacementRequest:
    """``placement`` as version ``version`` for ``ApplyExpertPlacement``."""
    return worker_pb2.ApplyExpertPlacementRequest(
        version=version, num_layers=placement.num_layers,
        num_slots=placement.topology.num_slots,
        slot_to_expert=placement.slot_to_expert.reshape(-1).tolist())


def placement_to_pb(placement: ExpertPlacement, balancedness: np.ndarray, *,
                    deployment: str = "", version: int = 0) -> governor_pb2.ExpertPlacement:
    """A placement with its balancedness ``[layers]``; ``deployment`` and ``version`` for one
    issued to a pool (a what-if plan has neither)."""
    return governor_pb2.ExpertPlacement(
        deployment=deployment, version=version,
        num_layers=placement.num_layers, num_slots=placement.topology.num_slots,
        slot_to_expert=placement.slot_to_expert.reshape(-1).tolist(),
        balancedness=[float(b) for b in balancedness],
        num_gpus=placement.topology.num_gpus, num_experts=placement.num_experts,
    )
