"""Expert parallelism on a worker: the placement the governor rolls out, and the token counts it
plans from.

An ``ExpertParallelEngine`` spreads MoE experts over its GPUs; the agent keeps the version of the
placement in force (``ExpertPlacement``), validates each new slot map against the engine's MoE
shape before the engine swaps it in, and hands the governor the tokens routed to each expert
(heartbeats). Roles do not matter here: prefill and decode workers both run experts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from pdserve.common.errors import InvalidArgumentError


@runtime_checkable
class ExpertParallelEngine(Protocol):
    """An engine that spreads MoE experts over its GPUs (expert parallelism): it counts the
    tokens routed to each expert and runs the expert placement the governor rolls out."""

    num_moe_layers: int
    num_experts: int
    num_expert_gpus: int

    def install_expert_placement(self, slot_to_expert: np.ndarray) -> None:
        """Use ``[num_moe_layers, num_slots]`` from the next forward pass on."""
        ...

    def take_expert_token_counts(self) -> np.ndarray:
        """``[num_moe_layers, num_experts]`` tokens routed since the previous call."""
        ...


def expert_parallel(engine: object) -> ExpertParallelEngine | None:
    """``engine`` as an ``ExpertParallelEngine`` if it runs MoE layers, else None (dense)."""
    if isinstance(engine, ExpertParallelEngine) and engine.num_moe_layers > 0:
        return engine
    return None


def checked_slot_map(engine: ExpertParallelEngine, num_layers: int, num_slots: int,
                     slot_to_expert: list[int]) -> np.ndarray:
    """The slot map as ``int64[num_layers, num_slots]``, or ``InvalidArgumentError``."""
    if num_layers != engine.num_moe_layers:
        raise InvalidArgumentError(
            f"num_layers: the engine has {engine.num_moe_layers} MoE layers, got {num_layers}",
            field="num_layers")
    if num_slots < engine.num_experts or num_slots % engine.num_expert_gpus:
        raise InvalidArgumentError(
            f"num_slots: must be >= num_experts ({engine.num_experts}) and a multiple of the "
            f"instance's {engine.num_expert_gpus} GPUs, got {num_slots}", field="num_slots")
    slot_map = np.asarray(slot_to_expert, dtype=np.int64)
    if slot_map.size != num_layers * num_slots:
        raise InvalidArgumentError("slot_to_expert: length must be num_layers x num_slots",
                                   field="slot_to_expert")
    slot_map = slot_map.reshape(num_layers, num_slots)
    if slot_map.min() < 0 or slot_map.max() >= engine.num_experts:
        raise InvalidArgumentError(
            f"slot_to_expert: expert ids must be in [0, {engine.num_experts})",
            field="slot_to_expert")
    for layer, row in enumerate(slot_map):
        if np.unique(row).size != engine.num_experts:
            raise InvalidArgumentError(
                f"slot_to_expert: layer {layer} leaves an expert without a slot",
                field="slot_to_expert")
    return slot_map


class ExpertPlacement:
    """The placement in force on one worker: its version and flattened slot map."""

    def __init__(self) -> None:
        self.version = 0
        self._slot_to_expert: list[int] = []

    def apply(self, engine: ExpertParallelEngine | None, version: int, num_layers: int,
              num_slots: int, slot_to_expert: list[int]) -> int:
        """Install placement ``version`` (a flattened ``[num_layers, num_slots]`` slot map) and
        return the slots whose expert changed, i.e. the expert weights a real engine loads.

        A version at or below the one in force is acknowledged without change (roll-outs are
        retried). An expert-parallel engine validates the map against its MoE shape
        (``InvalidArgumentError`` naming the constraint) and swaps it in between two forward
        passes; requests keep running on the old map until then. Without one (a dense engine)
        only the version and the map are kept.
        """
        if version <= self.version:
            return 0
        if engine is not None:
            engine.install_expert_placement(
                checked_slot_map(engine, num_layers, num_slots, slot_to_expert))
        if len(self._slot_to_expert) == len(slot_to_expert):
            moved = sum(1 for a, b in zip(self._slot_to_expert, slot_to_expert, strict=True)
                        if a != b)
        else:
            moved = len(slot_to_expert)
        self._slot_to_expert = list(slot_to_expert)
        self.version = version
        return moved


def take_expert_token_counts(engine: ExpertParallelEngine | None) -> tuple[int, list[int]]:
    """``(num_moe_layers, flattened [layers, experts] token counts)`` routed since the previous
    call, for the heartbeat; ``(0, [])`` for a dense engine or when nothing was routed."""
    if engine is None:
        return 0, []
    counts = engine.take_expert_token_counts()
    if not counts.any():
        return 0, []
    return engine.num_moe_layers, counts.reshape(-1).tolist()
