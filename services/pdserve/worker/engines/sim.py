"""The ``sim`` engine: a GPU running a model, simulated by the calibrated roofline.

Timing comes from ``pdserve.perf.perf_model`` (prefill time from FLOPs and bytes for the
prompt, decode step time from weight + KV bytes read by the batch), divided by ``speedup`` so
tests run fast. KV accounting is exact: the block count comes from the capacity model (capped by
``max_num_blocks`` so a laptop can hold it) and every block id is a real block of a real buffer.
KV bytes are real and deterministic (a function of the tokens, the layer and the position), of
the real size per block scaled by ``kv_scale``, so transports move, and tests check, real data.
Tokens are deterministic functions of the prompt (printable byte-tokenizer ids): exactly
``max_tokens`` of them, never end-of-sequence.

MoE models. Every forward pass routes each token to ``num_experts_per_token`` experts per MoE
layer, drawn from a seeded load profile (per layer, popularity ``(rank + 1) ** -expert_skew``
over a seeded permutation of the experts; every worker of a deployment uses the same seed, as
every replica of a model routes alike). The engine counts the tokens per (layer, expert) for the
governor's placement loop and runs an expert-parallel placement over the instance's ``tp_size``
GPUs: the slot map a worker installs (``install_expert_placement``), or before the first one
experts in contiguous blocks. Expert parallelism makes every GPU wait for the most loaded one at
each MoE layer, so the MoE share of the roofline time is scaled by the straggler factor, the mean
over layers of max GPU load / mean GPU load for the tokens of that pass (an expert's tokens split
evenly over its copies). A better placement therefore shows up as a shorter decode step (TPOT).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import get_gpu, get_model
from pdserve.perf.kv_budget import CapacityConfig, capacity_report
from pdserve.perf.perf_model import PerfModel, perf_model_for
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
    num_moe_layers: int = 0
    """MoE layers whose expert routing is simulated (0 = the model's; dense models have none)."""
    expert_skew: float = 0.9
    """Zipf exponent of the expert-popularity profile (0 = uniform routing)."""
    expert_seed: int = 0
    """Seed of the profile (which experts are hot in which layer) and of the routing draws."""

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise InvalidArgumentError("speedup: must be > 0", field="speedup")
        if self.expert_skew < 0 or not math.isfinite(self.expert_skew):
            raise InvalidArgumentError("expert_skew: must be a finite number >= 0",
                                       field="expert_skew")
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
                               block_size_tokens=config.block_size_tokens,
                               block_nbytes=block_nbytes)
        self.kv_cache = KvCache(self.layout)
        self.max_context_tokens = self.model.max_context_tokens
        self.num_expert_gpus = config.tp_size
        """GPUs the experts are spread over (expert parallelism across the instance)."""
        self.num_experts = self.model.num_experts
        self.num_moe_layers = ((config.num_moe_layers or self.model.num_moe_layers)
                               if self.model.is_moe else 0)
        self.last_step_s = 0.0
        """Simulated seconds of the latest decode step (before ``speedup``)."""
        if self.num_moe_layers:
            self._expert_popularity = expert_popularity(
                self.num_moe_layers, self.num_experts, config.expert_skew, config.expert_seed)
            self._routing_rng = np.random.default_rng([config.expert_seed, 1])
            self._expert_counts = np.zeros((self.num_moe_layers, self.num_experts), dtype=np.int64)
            self._counts_lock = threading.Lock()
            self._gpu_share = contiguous_gpu_share(
                self.num_moe_layers, self.num_experts, self.num_expert_gpus)

    # -- time ---------------------------------------------------------------------------------

    def _sleep(self, simulated_s: float) -> None:
        wall_s = simulated_s / self.config.speedup
        if wall_s >= _MIN_SLEEP_S:
            time.sleep(wall_s)

    # -- experts ------------------------------------------------------------------------------

    def install_expert_placement(self, slot_to_expert: np.ndarray) -> None:
        """Use ``slot_to_expert`` (``[num_moe_layers, num_slots]``, ``num_slots`` a multiple of
        ``num_expert_gpus``, every expert in at least one slot per layer; the caller validated it)
        from the next forward pass on. One reference swap: a pass in flight finishes on the
        placement it started with, so a placement is only ever installed between steps."""
        self._gpu_share = gpu_share(np.asarray(slot_to_expert), self.num_experts,
                                    self.num_expert_gpus)

    def take_expert_token_counts(self) -> np.ndarray:
        """Tokens routed per ``[num_moe_layers, num_experts]`` since the previous call (all
        zeros for a dense model's empty shape). Called from another thread than the steps."""
        if not self.num_moe_layers:
            return np.zeros((0, 0), dtype=np.int64)
        with self._counts_lock:
            counts, self._expert_counts = self._expert_counts, np.zeros_like(self._expert_counts)
        return counts

    def _route(self, num_tokens: int) -> float:
        """Route ``num_tokens`` tokens through every MoE layer; returns the straggler factor
        (>= 1) of this pass under the installed placement, 1.0 for a dense model."""
        if not self.num_moe_layers or num_tokens <= 0:
            return 1.0
        draws = num_tokens * self.model.num_experts_per_token
        counts = self._routing_rng.multinomial(draws, self._expert_popularity)
        with self._counts_lock:
            self._expert_counts += counts
        return straggler_factor(counts, self._gpu_share)

    def moe_roofline_s(self, num_tokens: int, context_tokens: int, *, is_prefill: bool) -> float:
        """Seconds of one pass's roofline time that the routed experts account for: their share
        of the bytes read when the pass is memory-bound, of the FLOPs when compute-bound."""
        if not self.num_moe_layers or num_tokens <= 0:
            return 0.0
        perf, model = self.perf, self.model
        if is_prefill:
            work = perf.prefill_work([num_tokens])
            flops_per_s = perf.peak_flops_per_s * perf.efficiency.prefill_mfu
        else:
            work = perf.decode_work(num_tokens, context_tokens)
            flops_per_s = perf.peak_flops_per_s * perf.efficiency.decode_mfu
        bytes_per_s = self.gpu.hbm_bytes_per_s * perf.efficiency.mbu
        expert_params = model.num_moe_layers * model.num_params_per_expert / self.config.tp_size
        miss = 1.0 - model.num_experts_per_token / model.num_experts
        touched = model.num_experts * (1.0 - miss ** num_tokens)
        expert_bytes = expert_params * model.dtype_bytes * touched
        expert_flops = 2.0 * expert_params * model.num_experts_per_token * num_tokens
        memory_s = work.memory_bytes / bytes_per_s
        compute_s = work.flops / flops_per_s
        if memory_s >= compute_s:
            return memory_s * min(1.0, expert_bytes / work.memory_bytes)
        return compute_s * min(1.0, expert_flops / work.flops)

    def decode_step_time_s(self, num_seqs: int, context_tokens: int, straggler: float) -> float:
        """Simulated seconds of one decode step: the perf model's time plus the MoE share's
        wait for the straggler GPU (``straggler`` = max / mean GPU load, 1.0 = perfect balance)."""
        base_s = self.perf.decode_step_time_s(num_seqs, context_tokens)
        moe_s = self.moe_roofline_s(num_seqs, context_tokens, is_prefill=False)
        return base_s + moe_s * (straggler - 1.0)

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
            patterns[index] = np.resize(np.frombuffer(digest, dtype=np.uint8),
                                        self.layout.block_nbytes)
        return patterns

    # -- tokens -------------------------------------------------------------------------------

    def _token(self, seq: Sequence, position: int) -> int:
        digest = hashlib.blake2b(
            np.asarray(seq.prompt_token_ids[-64:], dtype=np.int64).tobytes()
            + position.to_bytes(8, "little"), digest_size=4,
        ).digest()
        return _ALPHABET[int.from_bytes(digest, "little") % len(_ALPHABET)]

    def estimated_prefill_tokens_per_s(self, num_tokens: int = 1024) -> float:
        """Prefill throughput in wall-clock tokens per second (the roofline, sped up)."""
        return num_tokens / max(1e-9, self.perf.prefill_time_s([num_tokens]) / self.config.speedup)

    # -- Engine -------------------------------------------------------------------------------

    def prefill_layers(self, seq: Sequence) -> Iterator[int]:
        num_prompt = len(seq.prompt_token_ids)
        needed = self.layout.num_blocks_for(num_prompt)
        if len(seq.block_ids) < needed:
            raise ValueError(
                f"sequence {seq.request_id} has {len(seq.block_ids)} blocks, needs {needed}")
        num_cached = min(seq.num_computed_tokens, num_prompt - 1) if num_prompt else 0
        num_new = num_prompt - num_cached
        straggler = self._route(num_new)
        prefill_s = (self.perf.prefill_time_s([num_new])
                     + self.moe_roofline_s(num_new, 0, is_prefill=True) * (straggler - 1.0))
        per_layer_s = prefill_s / self.layout.num_layers
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
        straggler = self._route(len(seqs))
        self.last_step_s = self.decode_step_time_s(len(seqs), context, straggler)
        self._sleep(self.last_step_s)
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


# -- expert-parallel helpers (pure) -----------------------------------------------------------


def expert_popularity(num_layers: int, num_experts: int, skew: float, seed: int) -> np.ndarray:
    """``[num_layers, num_experts]`` routing probabilities, rows summing to 1: per layer
    ``(rank + 1) ** -skew`` over a seeded permutation of the experts."""
    rng = np.random.default_rng([seed, 0])
    ranks = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])
    weights = (ranks + 1.0) ** -skew
    return weights / weights.sum(axis=1, keepdims=True)


def gpu_share(slot_to_expert: np.ndarray, num_experts: int, num_gpus: int) -> np.ndarray:
    """``[layers, num_experts, num_gpus]``: the fraction of each expert's tokens each GPU takes
    (its copies there over all its copies) for a ``[layers, num_slots]`` slot map whose slots are
    split evenly over the GPUs in order."""
    num_layers, num_slots = slot_to_expert.shape
    gpu_of_slot = np.arange(num_slots) // (num_slots // num_gpus)
    share = np.zeros((num_layers, num_experts, num_gpus))
    layers = np.repeat(np.arange(num_layers), num_slots)
    np.add.at(share, (layers, slot_to_expert.reshape(-1), np.tile(gpu_of_slot, num_layers)), 1.0)
    copies = share.sum(axis=2, keepdims=True)
    return share / np.maximum(copies, 1.0)


def contiguous_gpu_share(num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """The placement before any is installed: one copy of each expert, in contiguous blocks
    (expert ``e`` on GPU ``e * num_gpus // num_experts``)."""
    share = np.zeros((num_layers, num_experts, num_gpus))
    share[:, np.arange(num_experts), np.arange(num_experts) * num_gpus // num_experts] = 1.0
    return share


def straggler_factor(token_counts: np.ndarray, share: np.ndarray) -> float:
    """Mean over layers of max GPU load / mean GPU load (>= 1; 1.0 for a layer without tokens)
    for ``[layers, experts]`` token counts under a ``gpu_share`` placement."""
    per_gpu = np.einsum("le,leg->lg", token_counts.astype(np.float64), share)
    mean = per_gpu.mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(mean > 0, per_gpu.max(axis=1) / mean, 1.0)
    return float(ratio.mean())
