"""HBM trade-off of redundant expert slots against KV cache, and a goodput proxy to choose a count.

Every expert slot a GPU holds costs ``num_moe_layers * expert_bytes`` of HBM (one copy per MoE
layer). A pool with ``num_slots`` slots on ``num_gpus`` GPUs gives each GPU
``num_slots / num_gpus`` slots per layer; the fewest it could hold with no redundancy at all is
``ceil(num_experts / num_gpus)``, so only the slots above that take memory from the KV cache.
(With 256 experts, EP320 and 320 slots, or EP144 and 288 slots, redundancy costs no HBM at all:
the GPUs hold that many slots anyway.)

Goodput proxy for a decode pool, per GPU, in sequences decoded at the target step time:
``min(kv_limited, compute_limited)`` where ``kv_limited = kv blocks left / blocks_per_sequence``
and ``compute_limited = balancedness * max_sequences_per_gpu``. The MoE step lasts as long as the
straggler GPU, which carries ``1 / balancedness`` times the mean load, so at a fixed step time the
mean batch a GPU can run scales with balancedness. It ignores attention time and communication
overlap; it is meant to rank slot counts, not to predict throughput. A full capacity model
lives elsewhere; this one takes bytes as plain inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.common.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class ExpertMemoryModel:
    """What an expert slot costs a GPU. Sizes in bytes; ``kv_bytes_per_block`` per GPU."""

    num_experts: int
    num_gpus: int
    num_moe_layers: int
    expert_bytes: int
    kv_bytes_per_block: int

    def __post_init__(self) -> None:
        for name in (
            "num_experts",
            "num_gpus",
            "num_moe_layers",
            "expert_bytes",
            "kv_bytes_per_block",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(
                    f"{name} must be a positive integer, got {value!r}", field=name
                )

    def redundant_slots_per_gpu(self, num_slots: int) -> int:
        """Slots per GPU per layer above the minimum ``ceil(num_experts / num_gpus)``."""
        if num_slots % self.num_gpus or num_slots < self.num_experts:
            raise InvalidArgumentError(
                "num_slots must be a multiple of num_gpus and >= num_experts: "
                f"num_slots={num_slots}, num_gpus={self.num_gpus}, num_experts={self.num_experts}",
                field="num_slots",
            )
        return num_slots // self.num_gpus - math.ceil(self.num_experts / self.num_gpus)

    def kv_blocks_given_up_per_gpu(self, num_slots: int) -> int:
        """KV blocks each GPU gives up to hold ``num_slots`` slots per layer instead of the
        minimum."""
        extra_bytes = (
            self.redundant_slots_per_gpu(num_slots) * self.num_moe_layers * self.expert_bytes
        )
        return math.ceil(extra_bytes / self.kv_bytes_per_block)


@dataclass(frozen=True, slots=True)
class DecodeCapacity:
    """Per-GPU decode limits with the minimum expert slots.

    ``kv_blocks_per_gpu``: KV blocks a GPU holds with ``ceil(num_experts / num_gpus)`` slots per
    layer. ``blocks_per_sequence``: mean KV blocks of a running sequence. ``max_sequences_per_gpu``:
    sequences per GPU the MoE step sustains at the target step time if load were perfectly even.
    """

    kv_blocks_per_gpu: int
    blocks_per_sequence: float
    max_sequences_per_gpu: float


@dataclass(frozen=True, slots=True)
class RedundancyOption:
    """One candidate slot count and its goodput proxy (sequences per GPU)."""

    num_slots: int
    num_redundant_slots: int
    kv_blocks_given_up_per_gpu: int
    balancedness: float
    kv_limited_sequences: float
    compute_limited_sequences: float
    goodput_proxy: float


def choose_num_slots(
    memory: ExpertMemoryModel,
    capacity: DecodeCapacity,
    balancedness_by_num_slots: Mapping[int, float],
) -> tuple[RedundancyOption, list[RedundancyOption]]:
    """Pick the slot count with the highest goodput proxy; ties go to fewer slots.

    ``balancedness_by_num_slots`` maps each candidate slot count to the GPU balancedness a plan
    with that many slots reaches (e.g. the mean over layers of ``gpu_balancedness``). Returns the
    choice and every option in ascending slot order.
    """
    if not balancedness_by_num_slots:
        raise InvalidArgumentError(
            "balancedness_by_num_slots must name at least one slot count",
            field="balancedness_by_num_slots",
        )
    if (
        capacity.blocks_per_sequence <= 0
        or capacity.max_sequences_per_gpu <= 0
        or capacity.kv_blocks_per_gpu < 0
    ):
        raise InvalidArgumentError(
            f"decode capacity must be positive, got {capacity}", field="capacity"
        )
    options = []
    for num_slots in sorted(balancedness_by_num_slots):
        balancedness = float(balancedness_by_num_slots[num_slots])
        if not 0.0 < balancedness <= 1.0:
            raise InvalidArgumentError(
                f"balancedness must be in (0, 1], got {balancedness} for num_slots={num_slots}",
                field="balancedness_by_num_slots",
            )
        given_up = memory.kv_blocks_given_up_per_gpu(num_slots)
        kv_limited = max(capacity.kv_blocks_per_gpu - given_up, 0) / capacity.blocks_per_sequence
        compute_limited = balancedness * capacity.max_sequences_per_gpu
        options.append(
            RedundancyOption(
                num_slots=num_slots,
                num_redundant_slots=num_slots - memory.num_experts,
                kv_blocks_given_up_per_gpu=given_up,
                balancedness=balancedness,
                kv_limited_sequences=kv_limited,
                compute_limited_sequences=compute_limited,
                goodput_proxy=min(kv_limited, compute_limited),
            )
        )
    best = max(options, key=lambda option: (option.goodput_proxy, -option.num_slots))
    return best, options
