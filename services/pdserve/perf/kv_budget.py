"""KV-cache capacity of one engine instance: the block arithmetic vLLM does at start-up.

Capacity is KV memory, not QPS. Per GPU (rank) of an instance with tensor parallelism ``tp``:

    kv_pool_bytes = total_memory_bytes x gpu_memory_utilization
                    - weights_bytes - activation_peak_bytes - non_torch_bytes
    num_blocks    = floor(kv_pool_bytes / (block_size_tokens x kv_bytes_per_token))

and the instance has the minimum ``num_blocks`` over its ranks (every rank holds its shard of
every block). A request of ``n`` tokens holds ``ceil(n / block_size_tokens)`` blocks, so the
instance serves ``num_blocks / ceil(n / block_size_tokens)`` such requests at once.

KV bytes per token per GPU:
- standard attention (MHA/GQA/MQA): ``2 x layers x kv_heads_per_gpu x head_dim x kv_dtype_bytes``,
  ``kv_heads_per_gpu = max(1, kv_heads // tp)``: KV heads are split across ranks, and replicated
  when ``tp`` exceeds them. ``tp`` must divide the attention heads, and either divide the KV heads
  or be a multiple of them.
- MLA (DeepSeek-V2/V3): ``layers x (kv_lora_rank + qk_rope_head_dim) x kv_dtype_bytes``: the
  latent has no head dimension, so every attention-TP rank holds all of it.

Everything here is a pure function of frozen values; nothing reads a clock or a file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import AttentionKind, GpuSpec, ModelSpec

GIB = 1 << 30

DEFAULT_NON_TORCH_BYTES = GIB
"""Memory outside PyTorch's allocator (CUDA context growth, NCCL buffers, CUDA graphs) when no
measurement is given. vLLM logs 0.1-0.5 GiB on one GPU; NCCL and graphs add more under TP."""

_PROFILE_NUM_SEQS = 256
"""Sequences whose logits vLLM's profile run samples (its default ``max_num_seqs``)."""


def check_tp_size(model: ModelSpec, tp_size: int) -> None:
    """Raise ``InvalidArgumentError`` unless ``tp_size`` can shard ``model``'s attention.

    ``tp_size`` must divide the attention heads; for standard attention it must also divide the
    KV heads, or be a multiple of them (then each KV head is replicated ``tp / kv_heads`` times).
    """
    if tp_size < 1:
        raise InvalidArgumentError(f"tp_size must be >= 1, got {tp_size}", field="tp_size")
    heads = model.num_attention_heads
    if heads % tp_size:
        raise InvalidArgumentError(
            f"tp_size {tp_size} does not divide the {heads} attention heads of {model.name}",
            field="tp_size")
    if model.attention_kind is AttentionKind.STANDARD:
        kv_heads = model.num_kv_heads
        if kv_heads % tp_size and tp_size % kv_heads:
            raise InvalidArgumentError(
                f"tp_size {tp_size} neither divides nor is a multiple of the {kv_heads} KV heads "
                f"of {model.name}", field="tp_size")


def kv_heads_per_gpu(model: ModelSpec, tp_size: int) -> int:
    """KV heads each rank stores: ``max(1, kv_heads // tp)`` (replicated when tp > kv_heads)."""
    check_tp_size(model, tp_size)
    return max(1, model.num_kv_heads // tp_size)


def kv_bytes_per_token(model: ModelSpec, tp_size: int = 1) -> int:
    """KV-cache bytes one token occupies on each GPU of a ``tp_size``-way instance."""
    check_tp_size(model, tp_size)
    if model.attention_kind is AttentionKind.MLA:
        latent = model.kv_lora_rank + model.qk_rope_head_dim
        return model.num_layers * latent * model.kv_dtype_bytes
    heads = kv_heads_per_gpu(model, tp_size)
    return 2 * model.num_layers * heads * model.head_dim * model.kv_dtype_bytes


def weights_bytes_per_gpu(model: ModelSpec, tp_size: int = 1) -> int:
    """Weight bytes on each rank: all parameters sharded evenly (vocab-parallel embeddings too).

    Norms and biases are replicated in practice; they are well under 0.1% of any catalog model.
    """
    check_tp_size(model, tp_size)
    return math.ceil(model.num_params * model.dtype_bytes / tp_size)


def estimate_activation_peak_bytes(model: ModelSpec, tp_size: int,
                                   max_num_batched_tokens: int) -> int:
    """A rough guess of the profile run's activation peak on one rank, erring high.

    For ``T = max_num_batched_tokens`` tokens in one forward pass: the residual stream and its
    normalised copies (4 x hidden), this rank's Q/K/V and attention output, and its MLP
    intermediate (gate, up and activated: 3 x intermediate / tp; for MoE the experts each token
    visits), all in 2-byte activations, doubled for allocator fragmentation; plus fp32 logits
    and probabilities for 256 sampled sequences. For Llama-3-8B at 8,192 tokens this gives
    about 2.4 GiB; vLLM's measured peak varies widely with its version, compilation and CUDA
    graph settings (1-2 GiB is common, one logged start-up shows 9.37 GiB). So pass the measured
    value (vLLM logs it as the activation peak) in ``RankMemory`` whenever it is known.
    """
    check_tp_size(model, tp_size)
    heads_per_gpu = model.num_attention_heads // tp_size
    qkv = heads_per_gpu * (2 * model.qk_head_dim + model.head_dim)
    if model.is_moe:
        experts_visited = model.num_experts_per_token + model.num_shared_experts
        mlp = 3 * model.moe_intermediate_size * experts_visited // tp_size
    else:
        mlp = 3 * model.intermediate_size // tp_size
    per_token = (4 * model.hidden_size + qkv + mlp) * 2
    logits = _PROFILE_NUM_SEQS * model.vocab_size * 4 * 2 // tp_size
    return 2 * max_num_batched_tokens * per_token + logits


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Memory accounting of one GPU of an instance, as an engine measures it at start-up (bytes).

    ``total_memory_bytes`` is what the driver reports for the device; the rest is what the engine
    found after loading weights and running its profiling forward pass.
    """

    total_memory_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int

    @property
    def reserved_bytes(self) -> int:
        """Everything that is not KV cache."""
        return self.weights_bytes + self.activation_peak_bytes + self.non_torch_bytes


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    """Engine settings the capacity depends on (names follow the governor's GetCapacity RPC).

    ``max_model_len`` defaults to the model's context length. ``max_num_batched_tokens`` and
    ``non_torch_bytes`` are used only when no measured ``RankMemory`` is given.
    """

    tp_size: int = 1
    block_size_tokens: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    non_torch_bytes: int = DEFAULT_NON_TORCH_BYTES

    def __post_init__(self) -> None:
        if self.block_size_tokens < 1:
            raise InvalidArgumentError(
                f"block_size_tokens must be >= 1, got {self.block_size_tokens}",
                field="block_size_tokens")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidArgumentError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
                field="gpu_memory_utilization")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidArgumentError(
                f"max_model_len must be >= 1, got {self.max_model_len}", field="max_model_len")


def estimate_rank_memory(model: ModelSpec, gpu: GpuSpec, config: CapacityConfig) -> RankMemory:
    """``RankMemory`` from the catalog alone: nominal GPU memory, sharded weights, estimates."""
    return RankMemory(
        total_memory_bytes=gpu.memory_bytes,
        weights_bytes=weights_bytes_per_gpu(model, config.tp_size),
        activation_peak_bytes=estimate_activation_peak_bytes(
            model, config.tp_size, config.max_num_batched_tokens),
        non_torch_bytes=config.non_torch_bytes,
    )


def kv_pool_bytes(rank: RankMemory, gpu_memory_utilization: float) -> int:
    """Bytes left for KV cache on one rank (negative when the rank is over-committed)."""
    usable = math.floor(rank.total_memory_bytes * gpu_memory_utilization)
    return usable - rank.reserved_bytes


def num_blocks_for_pool(pool_bytes: int, bytes_per_token: int, block_size_tokens: int) -> int:
    """Whole blocks of ``block_size_tokens`` tokens that fit in ``pool_bytes`` (0 if none)."""
    if pool_bytes <= 0:
        return 0
    return pool_bytes // (block_size_tokens * bytes_per_token)


def blocks_per_request(length_tokens: int, block_size_tokens: int) -> int:
    """Blocks one request of ``length_tokens`` tokens holds: ``ceil(length / block_size)``."""
    if length_tokens < 0:
        raise InvalidArgumentError(
            f"length_tokens must be >= 0, got {length_tokens}", field="length_tokens")
    return -(-length_tokens // block_size_tokens)


@dataclass(frozen=True, slots=True)
class CapacityReport:
    """KV capacity of one instance. Byte figures are per GPU; block counts are per instance.

    ``max_concurrency`` is the number of ``max_model_len``-token requests that fit at once, as
    vLLM logs it ("maximum concurrency for N tokens per request"): fractional, not floored.
    """

    model_name: str
    gpu_name: str
    tp_size: int
    block_size_tokens: int
    gpu_memory_utilization: float
    kv_bytes_per_token: int
    weights_bytes_per_gpu: int
    kv_pool_bytes: int
    num_blocks: int
    max_model_len: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block on one GPU (all layers)."""
        return self.block_size_tokens * self.kv_bytes_per_token

    @property
    def num_tokens(self) -> int:
        """Tokens the instance's KV cache holds when every block is full."""
        return self.num_blocks * self.block_size_tokens

    @property
    def max_concurrency(self) -> float:
        return self.max_concurrency_at(self.max_model_len)

    def max_concurrency_at(self, length_tokens: int) -> float:
        """Requests of ``length_tokens`` tokens that fit at once (fractional)."""
        return self.num_blocks / max(1, blocks_per_request(length_tokens, self.block_size_tokens))

    def num_requests_for_lengths(self, lengths_tokens: Iterable[int]) -> int:
        """Requests that fit at once when their lengths follow the sample ``lengths_tokens``.

        ``floor(num_blocks / mean blocks per request)``, each request rounded up to whole blocks;
        the sample is a length distribution (e.g. prompt + expected output of a trace), not a set
        of requests that must all fit.
        """
        num_requests = 0
        num_blocks = 0
        for length in lengths_tokens:
            num_requests += 1
            num_blocks += max(1, blocks_per_request(length, self.block_size_tokens))
        if num_requests == 0:
            raise InvalidArgumentError("lengths_tokens is empty", field="lengths_tokens")
        return math.floor(self.num_blocks * num_requests / num_blocks)


def capacity_report(model: ModelSpec, gpu: GpuSpec, config: CapacityConfig = CapacityConfig(),
                    rank_memories: tuple[RankMemory, ...] | None = None) -> CapacityReport:
    """The KV capacity of ``model`` on a ``config.tp_size``-GPU instance of ``gpu``.

    ``rank_memories`` holds what each rank measured (one entry for all ranks, or one per rank);
    without it the memory is estimated from the catalog. Raises ``InvalidArgumentError`` when
    the model does not fit (no whole block left on some rank), naming model, GPU and bytes.
    """
    tp = config.tp_size
    bytes_per_token = kv_bytes_per_token(model, tp)
    if rank_memories is None:
        rank_memories = (estimate_rank_memory(model, gpu, config),)
    if len(rank_memories) not in (1, tp):
        raise InvalidArgumentError(
            f"rank_memories has {len(rank_memories)} entries; give 1 or tp_size ({tp})",
            field="rank_memories")
    tightest = min(rank_memories, key=lambda r: kv_pool_bytes(r, config.gpu_memory_utilization))
    pool = kv_pool_bytes(tightest, config.gpu_memory_utilization)
    num_blocks = num_blocks_for_pool(pool, bytes_per_token, config.block_size_tokens)
    if num_blocks < 1:
        usable = math.floor(tightest.total_memory_bytes * config.gpu_memory_utilization)
        raise InvalidArgumentError(
            f"model {model.name} does not fit on {gpu.name} with tp_size {tp}: a GPU needs "
            f"{tightest.reserved_bytes} bytes (weights {tightest.weights_bytes}, activations "
            f"{tightest.activation_peak_bytes}, non-torch {tightest.non_torch_bytes}) plus "
            f"{config.block_size_tokens * bytes_per_token} for one KV block, but only {usable} "
            f"of {tightest.total_memory_bytes} bytes are usable at utilisation "
            f"{config.gpu_memory_utilization}", field="model")
    return CapacityReport(
        model_name=model.name,
        gpu_name=gpu.name,
        tp_size=tp,
        block_size_tokens=config.block_size_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_bytes_per_token=bytes_per_token,
        weights_bytes_per_gpu=tightest.weights_bytes,
        kv_pool_bytes=pool,
        num_blocks=num_blocks,
        max_model_len=config.max_model_len or model.max_context_tokens,
    )
