"""The engine interface the in-house scheduler drives, shaped after how real engines split the work.

Real engines (vLLM v1, SGLang) allocate KV blocks on the *scheduler* side (a block pool with a
free list) and move KV on the *worker* side layer by layer (vLLM's KV connector saves each layer
as the forward pass finishes it and loads layers before attention needs them). pdserve's own
engines (``sim``, ``tiny``) keep the same split under pdserve's scheduler (``worker.scheduler``);
a real engine brings its own scheduler and plugs in at the engine seam (``worker.runtime``):

- ``BlockAllocator``: scheduler side; hands out physical block ids and takes them back.
- ``KvCache``: worker side; one byte buffer per layer, ``[num_blocks, block_nbytes]``, where a
  block holds K and V for ``block_size_tokens`` tokens of one layer. Transports read and write
  whole blocks of one layer at a time.
- ``Engine``: runs prefill layer by layer (a generator that yields after each layer's KV is in
  the cache, so the transport can ship it while the next layer computes) and decode steps over a
  batch of sequences.

These engines are synchronous and CPU-bound (or sleep, for ``sim``); the scheduler runs them in
a thread so the event loop stays free for gRPC and the KV transport.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Shape of one engine's paged KV cache.

    ``block_nbytes`` is the size of one block of one layer (K and V for ``block_size_tokens``
    tokens, all KV heads this instance holds). A transfer moves ``num_layers`` x (blocks of the
    prompt) frames of ``block_nbytes`` each.
    """

    num_layers: int
    num_blocks: int
    block_size_tokens: int
    block_nbytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size_tokens", "block_nbytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvLayout.{name} must be positive, got {getattr(self, name)}")

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return math.ceil(num_tokens / self.block_size_tokens)


@dataclass(frozen=True, slots=True)
class KvMemory:
    """Where a KV cache's layer buffers live, as NIXL registers them: ``kind`` is NIXL's memory
    type (``DRAM`` for host memory, ``VRAM`` for a GPU's), ``device_id`` the GPU's index (0 for
    host memory); layer l is ``layer_nbytes[l]`` bytes at ``layer_addresses[l]``."""

    kind: str
    device_id: int
    layer_addresses: tuple[int, ...]
    layer_nbytes: tuple[int, ...]

    @property
    def is_host(self) -> bool:
        return self.kind == "DRAM"


class KvCache:
    """Worker-side paged KV memory: ``layer_buffers[l]`` is a ``uint8[num_blocks, block_nbytes]``.

    Engines that compute in floating point view each layer buffer with their own dtype and shape;
    transports only ever see bytes. One buffer per layer (not one big tensor) so that a layer can
    be registered, read and written on its own, as NIXL and real engines do. A cache in GPU
    memory (a vLLM engine's on CUDA) has no host buffers: ``memory`` says where its layers are
    (NIXL moves them), and ``layer_blocks``/``zero_blocks`` reach its bytes.
    """

    def __init__(self, layout: KvLayout) -> None:
        self.layout = layout
        self.layer_buffers: list[np.ndarray] = [
            np.zeros((layout.num_blocks, layout.block_nbytes), dtype=np.uint8)
            for _ in range(layout.num_layers)
        ]

    @property
    def memory(self) -> KvMemory:
        return KvMemory("DRAM", 0, tuple(int(b.ctypes.data) for b in self.layer_buffers),
                        tuple(int(b.nbytes) for b in self.layer_buffers))

    def block_view(self, layer: int, block_id: int) -> memoryview:
        """A writable view of one block of one layer (no copy)."""
        return memoryview(self.layer_buffers[layer][block_id])

    def layer_blocks(self, layer: int, block_ids: np.ndarray) -> np.ndarray:
        """``uint8[len(block_ids), block_nbytes]``: the bytes of those blocks of one layer, in
        host memory (a copy)."""
        return self.layer_buffers[layer][block_ids]

    def zero_blocks(self, block_ids: np.ndarray) -> None:
        """Zero those blocks in every layer."""
        for buffer in self.layer_buffers:
            buffer[block_ids] = 0


class BlockAllocator:
    """Scheduler-side free list of physical block ids. Not thread-safe: one owner (the agent)."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_used = np.zeros(num_blocks, dtype=bool)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` ids; raises ``MemoryError`` (and takes nothing) if too few are
        free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise MemoryError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        block_ids = [self._free.pop() for _ in range(num_blocks)]
        self._is_used[block_ids] = True
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Return ids; freeing an id that is not in use is a bug and raises ``ValueError``."""
        for block_id in block_ids:
            if not self._is_used[block_id]:
                raise ValueError(f"double free of KV block {block_id}")
            self._is_used[block_id] = False
            self._free.append(block_id)


@dataclass(slots=True)
class Sequence:
    """One request's state inside an engine.

    ``block_ids`` is the block table (logical block i of the sequence lives in physical block
    ``block_ids[i]`` of every layer). ``num_computed_tokens`` counts tokens whose KV is in the
    cache. ``output_token_ids`` grows by one per decode step.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    """What a prefill cost; seconds of (scaled) wall time."""

    compute_s: float
    num_prompt_tokens: int


@runtime_checkable
class Engine(Protocol):
    """What the in-house scheduler (``worker.scheduler``) needs from an engine (``sim``,
    ``tiny``). Engines that schedule themselves plug in at ``worker.runtime`` instead."""

    name: str
    layout: KvLayout
    kv_cache: KvCache

    def prefill_layers(self, seq: Sequence) -> Iterator[int]:
        """Compute the prompt's KV into ``seq.block_ids``, layer by layer.

        Yields each layer index as soon as that layer's KV for the whole prompt is in the cache.
        When exhausted, ``seq.num_computed_tokens == len(seq.prompt_token_ids)`` and the first
        output token has been appended to ``seq.output_token_ids`` (prefill produces it).
        Precondition: ``len(seq.block_ids) >= layout.num_blocks_for(len(prompt))``.
        """
        ...

    def decode_step(self, seqs: list[Sequence]) -> list[int]:
        """One decode step for a batch: appends one token to each sequence and returns them.

        The caller has ensured every sequence has a block for the token being written.
        """
        ...
