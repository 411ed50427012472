"""Roofline performance model of one engine instance: prefill time and decode step time.

One instance is ``tp_size`` GPUs of one catalog type running one catalog model with tensor
parallelism. Each phase is costed per GPU as

    time = max(flops / (peak x mfu), bytes / (hbm_bandwidth x mbu))   roofline
         + comm_bytes / (nvlink x link_efficiency)                     TP all-reduce volume
         + comm_steps x allreduce_latency_s                            TP all-reduce latency
         + overhead_s                                                  launch, schedule, sample

- Prefill of prompts ``l_i``: ``flops = (2 x active_params x sum(l_i)
  + layers x heads x (d_qk + d_v) x sum(l_i^2)) / tp`` (causal attention is quadratic in the
  prompt); ``bytes`` = the weights this rank reads once plus the KV it writes.
- Decode step of ``B`` sequences holding ``C`` context tokens in all: ``flops = (2 x
  active_params x B + 2 x layers x heads x (d_qk + d_v) x C) / tp``; ``bytes`` = weights read
  plus the whole KV cache of the batch read once. (MLA decodes in the absorbed form: attention
  runs over the latent, ``d_qk = kv_lora_rank + rope``, ``d_v = kv_lora_rank``.)
- MoE: FLOPs use the active parameters; the weight bytes read count only the routed experts a
  batch of ``n`` tokens is expected to touch under uniform routing, ``E x (1 - (1 - k/E)^n)``
  per MoE layer. Expert parallelism is not modelled (experts are TP-sharded).
- TP: two all-reduces per layer of ``tokens x hidden`` activations; a ring all-reduce moves
  ``2 (tp - 1) / tp`` of the buffer over each GPU's link in ``2 (tp - 1)`` latency steps.

``Efficiency`` holds the factors real engines fall short of the roofline by. Its defaults are
textbook values; ``perf_model_for`` uses the sets ``calibration`` fitted to measured profiles
(shipped in ``catalog/efficiency.json``; they describe the 2023 engine SplitwiseSim profiled, so a
worker's own profile, fitted with ``calibration.fit_worker_profile``, should replace them).
``PerfModel`` precomputes everything that does not depend on the batch, so its methods are a
handful of float operations (the simulator calls them per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import (
    AttentionKind,
    GpuSpec,
    ModelSpec,
    default_catalog,
    get_gpu,
    get_model,
)
from pdserve.perf.kv_budget import check_tp_size, kv_bytes_per_token

ACTIVATION_BYTES = 2
"""Width of the activations all-reduced between TP ranks (bf16)."""


@dataclass(frozen=True, slots=True)
class Efficiency:
    """How far an engine falls short of the roofline. Fractions are in (0, 1]; times in seconds.

    ``prefill_mfu`` / ``decode_mfu``: fraction of peak dense FLOP/s reached (decode runs skinny
    matrix products, so far less). ``mbu``: fraction of HBM bandwidth reached. Overheads are per
    prefill batch and per decode step. ``allreduce_latency_s`` is per ring step;
    ``link_efficiency`` the fraction of NVLink bandwidth an all-reduce reaches.
    """

    prefill_mfu: float = 0.5
    decode_mfu: float = 0.25
    mbu: float = 0.75
    prefill_overhead_s: float = 0.005
    decode_overhead_s: float = 0.003
    allreduce_latency_s: float = 5e-6
    link_efficiency: float = 0.7

    def __post_init__(self) -> None:
        for name in ("prefill_mfu", "decode_mfu", "mbu", "link_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InvalidArgumentError(f"Efficiency.{name} must be in (0, 1], got {value}",
                                           field=name)
        for name in ("prefill_overhead_s", "decode_overhead_s", "allreduce_latency_s"):
            value = getattr(self, name)
            if value < 0.0:
                raise InvalidArgumentError(f"Efficiency.{name} must be >= 0, got {value}",
                                           field=name)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class PhaseWork:
    """Efficiency-independent work of one prefill batch or decode step, per GPU.

    ``comm_bytes`` is what crosses each GPU's link (already scaled by the ring factor);
    ``comm_steps`` the number of latency-bound ring steps. ``calibration`` fits ``Efficiency``
    against these without re-deriving the model.
    """

    flops: float
    memory_bytes: float
    comm_bytes: float
    comm_steps: float


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Timing of ``model`` on a ``tp_size``-GPU instance of ``gpu``. Immutable; cheap to call."""

    model: ModelSpec
    gpu: GpuSpec
    tp_size: int = 1
    efficiency: Efficiency = Efficiency()
    # Derived constants, per GPU (set in __post_init__).
    _flops_per_token: float = field(init=False, repr=False, compare=False)
    _attn_flops_per_token_pair: float = field(init=False, repr=False, compare=False)
    _decode_attn_flops_per_token: float = field(init=False, repr=False, compare=False)
    _dense_weight_bytes: float = field(init=False, repr=False, compare=False)
    _expert_bytes_per_expert: float = field(init=False, repr=False, compare=False)
    _kv_bytes_per_token: int = field(init=False, repr=False, compare=False)
    _comm_bytes_per_token: float = field(init=False, repr=False, compare=False)
    _comm_steps: float = field(init=False, repr=False, compare=False)
    _prefill_flops_per_s: float = field(init=False, repr=False, compare=False)
    _decode_flops_per_s: float = field(init=False, repr=False, compare=False)
    _bytes_per_s: float = field(init=False, repr=False, compare=False)
    _comm_s_per_token: float = field(init=False, repr=False, compare=False)
    _comm_latency_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_tp_size(self.model, self.tp_size)
        model, tp, eff = self.model, self.tp_size, self.efficiency
        heads_per_gpu = model.num_attention_heads / tp
        expert_params = model.num_routed_expert_params
        ring = 2.0 * (tp - 1) / tp
        derived = {
            "_flops_per_token": 2.0 * model.num_active_params / tp,
            # Causal attention over l tokens: QK^T and PV each cost l^2/2 x d multiply-adds per
            # head, i.e. l^2 x (d_qk + d_v) FLOPs per head and layer.
            "_attn_flops_per_token_pair": (
                model.num_layers * heads_per_gpu * (model.qk_head_dim + model.head_dim)),
            # A decode token attends to each context token: 2 x (d_qk + d_v) FLOPs per head and
            # layer. MLA decodes in the absorbed form, over the latent: d_qk = rank + rope and
            # d_v = rank.
            "_decode_attn_flops_per_token": 2.0 * model.num_layers * heads_per_gpu * (
                2 * model.kv_lora_rank + model.qk_rope_head_dim
                if model.attention_kind is AttentionKind.MLA
                else model.qk_head_dim + model.head_dim),
            "_dense_weight_bytes": (model.num_params - expert_params) * model.dtype_bytes / tp,
            "_expert_bytes_per_expert": (
                model.num_moe_layers * model.num_params_per_expert * model.dtype_bytes / tp),
            "_kv_bytes_per_token": kv_bytes_per_token(model, tp),
            "_comm_bytes_per_token": (
                2.0 * model.num_layers * model.hidden_size * ACTIVATION_BYTES * ring),
            "_comm_steps": 2.0 * model.num_layers * 2 * (tp - 1),
            "_prefill_flops_per_s": self.peak_flops_per_s * eff.prefill_mfu,
            "_decode_flops_per_s": self.peak_flops_per_s * eff.decode_mfu,
            "_bytes_per_s": self.gpu.hbm_bytes_per_s * eff.mbu,
        }
        derived["_comm_s_per_token"] = derived["_comm_bytes_per_token"] / (
            self.gpu.nvlink_bytes_per_s * eff.link_efficiency)
        derived["_comm_latency_s"] = derived["_comm_steps"] * eff.allreduce_latency_s
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def peak_flops_per_s(self) -> float:
        """Dense peak of one GPU for this model's weight type (FP8 where the GPU has it)."""
        return self.gpu.peak_flops_per_s(self.model.dtype_bytes)

    # -- hot path -------------------------------------------------------------------------

    def prefill_time_s(self, prompt_lens: Sequence[int]) -> float:
        """Seconds to prefill one batch of prompts of ``prompt_lens`` tokens (0.0 if empty)."""
        num_tokens = 0
        sum_squares = 0
        for length in prompt_lens:
            num_tokens += length
            sum_squares += length * length
        return self._prefill_time_s(num_tokens, sum_squares)

    def mean_prefill_time_s(self, mean_tokens: float, mean_squared_tokens: float = 0.0) -> float:
        """Mean seconds to prefill one prompt alone, over prompts whose lengths have mean
        ``mean_tokens`` and mean square ``mean_squared_tokens`` (at least ``mean_tokens ** 2``;
        0 or less: the mean's square, i.e. every prompt of the mean length).

        Attention is quadratic in the prompt, so with spread lengths this is more than the time
        of a prompt of the mean length. It is exact where every prompt is on the same side of
        the roofline (long prompts: compute-bound) and a lower bound otherwise (the roofline's
        ``max`` is convex)."""
        if mean_tokens <= 0:
            return 0.0
        return self._prefill_time_s(mean_tokens, max(mean_squared_tokens, mean_tokens ** 2))

    def token_weighted_prefill_time_s(self, mean_tokens: float, mean_squared_tokens: float = 0.0,
                                      mean_cubed_tokens: float = 0.0) -> float:
        """``E[P x prefill_time(P)] / E[P]`` over prompts of lengths ``P`` with these first three
        moments: the mean prefill time of a prompt picked in proportion to its length (as the
        KV blocks it holds meanwhile are). Moments below their floors (the mean's square; the
        square's square over the mean, the least third moment the first two allow) are raised
        to them; with neither, a prompt of the mean length. Exact and bounded as
        ``mean_prefill_time_s`` is: the time is linear in a prompt's length and its square on
        each side of the roofline."""
        if mean_tokens <= 0:
            return 0.0
        squared = max(mean_squared_tokens, mean_tokens ** 2)
        cubed = max(mean_cubed_tokens, squared * squared / mean_tokens)
        return self._prefill_time_s(squared / mean_tokens, cubed / mean_tokens)

    def _prefill_time_s(self, num_tokens: float, sum_squares: float) -> float:
        if num_tokens <= 0:
            return 0.0
        flops = self._flops_per_token * num_tokens + self._attn_flops_per_token_pair * sum_squares
        memory_bytes = self._weight_bytes_read(num_tokens) + self._kv_bytes_per_token * num_tokens
        roofline_s = max(flops / self._prefill_flops_per_s, memory_bytes / self._bytes_per_s)
        return (roofline_s + self._comm_s_per_token * num_tokens + self._comm_latency_s
                + self.efficiency.prefill_overhead_s)

    def decode_step_time_s(self, batch_size: float, total_context_tokens: float) -> float:
        """Seconds for one decode step of ``batch_size`` sequences (0.0 if the batch is empty).

        ``total_context_tokens`` is the sum over the batch of each sequence's tokens so far
        (prompt plus generated), i.e. the KV the step reads. Both may be fractional: the
        analytic planners evaluate the roofline at mean batch sizes and contexts.
        """
        if batch_size <= 0:
            return 0.0
        flops = (self._flops_per_token * batch_size
                 + self._decode_attn_flops_per_token * total_context_tokens)
        memory_bytes = (self._weight_bytes_read(batch_size)
                        + self._kv_bytes_per_token * total_context_tokens)
        roofline_s = max(flops / self._decode_flops_per_s, memory_bytes / self._bytes_per_s)
        return (roofline_s + self._comm_s_per_token * batch_size + self._comm_latency_s
                + self.efficiency.decode_overhead_s)

    def _weight_bytes_read(self, num_tokens: float) -> float:
        """Weight bytes one forward pass over ``num_tokens`` tokens reads on each GPU."""
        if not self._expert_bytes_per_expert:
            return self._dense_weight_bytes
        num_experts = self.model.num_experts
        miss = 1.0 - self.model.num_experts_per_token / num_experts
        touched = num_experts * (1.0 - miss ** num_tokens)
        return self._dense_weight_bytes + self._expert_bytes_per_expert * touched

    # -- KV sizes ---------------------------------------------------------------------------

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return self._kv_bytes_per_token

    def prompt_kv_bytes(self, prompt_tokens: int) -> int:
        """KV bytes a prompt leaves on the whole instance (every rank's shard, replicas too).

        This is what a prefill instance ships to a decode instance of the same ``tp_size`` when
        each rank sends its own shard.
        """
        return self._kv_bytes_per_token * prompt_tokens * self.tp_size

    def prompt_kv_bytes_per_gpu(self, prompt_tokens: int) -> int:
        """KV bytes of a prompt on one rank."""
        return self._kv_bytes_per_token * prompt_tokens

    def kv_transfer_time_s(self, prompt_tokens: int) -> float:
        """Seconds to move a prompt's KV over the NICs, every rank sending its shard in parallel.

        Unhidden cost only: streaming layer by layer overlaps most of it with prefill.
        """
        return self._kv_bytes_per_token * prompt_tokens / self.gpu.nic_bytes_per_s

    # -- efficiency-independent work (for calibration) -------------------------------------

    def prefill_work(self, prompt_lens: Sequence[int]) -> PhaseWork:
        """The work ``prefill_time_s`` costs, before efficiency factors are applied."""
        num_tokens = sum(prompt_lens)
        sum_squares = sum(length * length for length in prompt_lens)
        return PhaseWork(
            flops=self._flops_per_token * num_tokens
            + self._attn_flops_per_token_pair * sum_squares,
            memory_bytes=self._weight_bytes_read(num_tokens)
            + self._kv_bytes_per_token * num_tokens,
            comm_bytes=self._comm_bytes_per_token * num_tokens,
            comm_steps=self._comm_steps,
        )

    def decode_work(self, batch_size: float, total_context_tokens: float) -> PhaseWork:
        """The work ``decode_step_time_s`` costs, before efficiency factors are applied."""
        return PhaseWork(
            flops=self._flops_per_token * batch_size
            + self._decode_attn_flops_per_token * total_context_tokens,
            memory_bytes=self._weight_bytes_read(batch_size)
            + self._kv_bytes_per_token * total_context_tokens,
            comm_bytes=self._comm_bytes_per_token * batch_size,
            comm_steps=self._comm_steps,
        )

    def time_for_s(self, work: PhaseWork, *, is_prefill: bool) -> float:
        """Seconds for ``work`` under this model's efficiency (the module docstring's formula).

        Equal to ``prefill_time_s`` / ``decode_step_time_s`` for the work they cost; slower
        (it is not the hot path), but it is the formula ``calibration`` vectorises.
        """
        eff = self.efficiency
        mfu = eff.prefill_mfu if is_prefill else eff.decode_mfu
        overhead_s = eff.prefill_overhead_s if is_prefill else eff.decode_overhead_s
        compute_s = work.flops / (self.peak_flops_per_s * mfu)
        memory_s = work.memory_bytes / (self.gpu.hbm_bytes_per_s * eff.mbu)
        comm_s = work.comm_bytes / (self.gpu.nvlink_bytes_per_s * eff.link_efficiency)
        return (max(compute_s, memory_s) + comm_s + work.comm_steps * eff.allreduce_latency_s
                + overhead_s)

    def with_efficiency(self, efficiency: Efficiency) -> PerfModel:
        return PerfModel(self.model, self.gpu, self.tp_size, efficiency)


def calibrated_efficiency(model_name: str, gpu_name: str) -> tuple[Efficiency, str]:
    """The fitted efficiency factors that best match (model, GPU), and where they came from.

    Lookup order: a fit for this model on this GPU; a fit for this GPU over all profiled models;
    the same two for the GPU's ``calibration_proxy``; the defaults. The second element names the
    entry used (e.g. ``"gpu:a100-sxm-80gb"`` or ``"default"``).
    """
    catalog = default_catalog()
    model = catalog.model(model_name)
    gpu = catalog.gpu(gpu_name)
    doc = catalog.efficiency
    by_model_gpu = {(e["model"], e["gpu"]): e["factors"] for e in doc.get("by_model_gpu", ())}
    by_gpu = {e["gpu"]: e["factors"] for e in doc.get("by_gpu", ())}
    for gpu_key in (gpu.name, gpu.calibration_proxy):
        if gpu_key is None:
            continue
        if (model.name, gpu_key) in by_model_gpu:
            factors = by_model_gpu[(model.name, gpu_key)]
            return Efficiency(**factors), f"model_gpu:{model.name}:{gpu_key}"
        if gpu_key in by_gpu:
            return Efficiency(**by_gpu[gpu_key]), f"gpu:{gpu_key}"
    return Efficiency(), "default"


def perf_model_for(model_name: str, gpu_name: str, tp_size: int = 1,
                   efficiency: Efficiency | None = None) -> PerfModel:
    """A ``PerfModel`` by catalog names, with calibrated factors unless ``efficiency`` is given."""
    if efficiency is None:
        efficiency, _ = calibrated_efficiency(model_name, gpu_name)
    return PerfModel(get_model(model_name), get_gpu(gpu_name), tp_size, efficiency)
