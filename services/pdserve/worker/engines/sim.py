"""The ``sim`` engine: a GPU running a model, simulated by the calibrated roofline.

Timing comes from ``pdserve.capacity.perf_model`` (prefill time from FLOPs and bytes for the
prompt, decode step time from weight + KV bytes read by the batch), divided by ``speedup`` so
tests run fast. KV accounting is exact: the block count comes from the capacity model (capped by
``max_num_blocks`` so a laptop can hold it) and every block id is a real block of a real buffer.
KV bytes are real and deterministic (a function of the tokens, the layer and the position), of
the real size per block scaled by ``kv_scale``, so transports move, and tests check, real data.
Tokens are deterministic functions of the prompt (printable byte-tokenizer ids): exactly
``max_tokens`` of them, never end-of-sequence.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pdserve.capacity.catalog import get_gpu, get_model
from pdserve.capacity.kv_budget import CapacityConfig, capacity_report
from pdserve.capacity.perf_model import PerfModel, perf_model_for
from pdserve.common.errors import InvalidArgumentError
from pdserve.worker.engine import KvCache, KvLayout, Sequence

_MIN_SLEEP_S = 50e-6
_ALPHABET = b"etaoinshrdlucmfwypvbgkjqxz     .,"
"""Sim tokens are byte-tokenizer ids of these characters, so a simulated answer prints as
letter soup rather than binary (the package tokenizer maps byte b to id b)."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What the sim engine simulates, and how much it scales down."""

    model: str = "llama-3.1-8b"
    gpu: str = "h100-sxm-80gb"
    tp_size: int = 1
    block_size_tokens: int = 16
    gpu_memory_utilization: float = 0.9
    max_num_blocks: int = 8192
    """Cap on KV blocks, so the buffers fit in host memory (0 = no cap)."""
    kv_scale: float = 1.0 / 64
    """Bytes per block relative to the real model's (1.0 = real size)."""
    speedup: float = 1.0
    """Simulated seconds per wall-clock second; large values make compute nearly instant."""
    num_kv_layers: int = 0
    """Layers to move KV for (0 = the model's). Fewer layers keep small tests small."""

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise InvalidArgumentError("speedup: must be > 0", field="speedup")
        if not 0 < self.kv_scale <= 1:
            raise InvalidArgumentError("kv_scale: must be in (0, 1]", field="kv_scale")


class SimEngine:
    """Implements ``pdserve.worker.engine.Engine``."""

    name = "sim"

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.model = get_model(config.model)
        self.gpu = get_gpu(config.gpu)
        self.perf: PerfModel = perf_model_for(config.model, config.gpu, config.tp_size)
        report = capacity_report(self.model, self.gpu, CapacityConfig(
            tp_size=config.tp_size, block_size_tokens=config.block_size_tokens,
            gpu_memory_utilization=config.gpu_memory_utilization,
        ))
        self.num_real_blocks = report.num_blocks
        num_blocks = report.num_blocks
        if config.max_num_blocks:
            num_blocks = min(num_blocks, config.max_num_blocks)
        num_layers = config.num_kv_layers or self.model.num_layers
        real_block_nbytes = report.block_bytes // self.model.num_layers * config.tp_size
        block_nbytes = max(16, int(real_block_nbytes * config.kv_scale) // 16 * 16)
        self.layout = KvLayout(num_layers=num_layers, num_blocks=num_blocks,
                               block_size_tokens=config.block_size_tokens, block_nbytes=block_nbytes)
        self.kv_cache = KvCache(self.layout)
        self.max_context_tokens = self.model.max_context_tokens

    # -- time ---------------------------------------------------------------------------------

    def _sleep(self, simulated_s: float) -> None:
        wall_s = simulated_s / self.config.speedup
        if wall_s >= _MIN_SLEEP_S:
            time.sleep(wall_s)

    # -- KV content ---------------------------------------------------------------------------

    def _block_patterns(self, token_ids: list[int]) -> np.ndarray:
        """``uint8[num_blocks, block_nbytes]``: each block's bytes, a function of its tokens and
        its position. Layer ``l`` stores ``pattern ^ l`` so layers differ too."""
        size = self.layout.block_size_tokens
        num_blocks = self.layout.num_blocks_for(len(token_ids))
        patterns = np.empty((num_blocks, self.layout.block_nbytes), dtype=np.uint8)
        for index in range(num_blocks):
            digest = hashlib.blake2b(
                np.asarray(token_ids[index * size:(index + 1) * size], dtype=np.int64).tobytes(),
                digest_size=16, person=index.to_bytes(8, "little"),
            ).digest()
            patterns[index] = np.resize(np.frombuffer(digest, dtype=np.uint8), self.layout.block_nbytes)
        return patterns

    # -- tokens -------------------------------------------------------------------------------

    def _token(self, seq: Sequence, position: int) -> int:
        digest = hashlib.blake2b(
            np.asarray(seq.prompt_token_ids[-64:], dtype=np.int64).tobytes()
            + position.to_bytes(8, "little"), digest_size=4,
        ).digest()
        return _ALPHABET[int.from_bytes(digest, "little") % len(_ALPHABET)]

    # -- Engine -------------------------------------------------------------------------------

    def prefill_layers(self, seq: Sequence) -> Iterator[int]:
        num_prompt = len(seq.prompt_token_ids)
        needed = self.layout.num_blocks_for(num_prompt)
        if len(seq.block_ids) < needed:
            raise ValueError(f"sequence {seq.request_id} has {len(seq.block_ids)} blocks, needs {needed}")
        num_cached = min(seq.num_computed_tokens, num_prompt - 1) if num_prompt else 0
        per_layer_s = self.perf.prefill_time_s([num_prompt - num_cached]) / self.layout.num_layers
        patterns = self._block_patterns(seq.prompt_token_ids)
        block_ids = np.asarray(seq.block_ids[:needed], dtype=np.int64)
        for layer in range(self.layout.num_layers):
            self._sleep(per_layer_s)
            self.kv_cache.layer_buffers[layer][block_ids] = patterns ^ np.uint8(layer & 0xFF)
            yield layer
        seq.num_computed_tokens = num_prompt
        seq.output_token_ids.append(self._token(seq, 0))

    def decode_step(self, seqs: list[Sequence]) -> list[int]:
        context = sum(s.num_tokens for s in seqs)
        self._sleep(self.perf.decode_step_time_s(len(seqs), context))
        new_tokens = []
        for seq in seqs:
            # Decode accounts for the new token's KV slot but does not write bytes for it: only
            # prompt KV crosses the wire, and that is what the sim engine makes real.
            position = seq.num_tokens - 1
            token = self._token(seq, len(seq.output_token_ids))
            seq.output_token_ids.append(token)
            seq.num_computed_tokens = position + 1
            new_tokens.append(token)
        return new_tokens
