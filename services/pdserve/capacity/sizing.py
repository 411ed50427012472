"""Demand to instances: how many prefill and decode instances a request rate needs, from the
capacity and performance models (``size_pools``; the autoscaler, its oracle in
``bench/autoscale.py`` and the governor use the same arithmetic).

Prefill is compute: one instance prefills ``speedup / E[prefill_time_s(prompt)]`` requests per
second, sized at ``prefill_target_utilization`` (TTFT includes queue wait); the mean time comes
from the mean and mean square of the prompt lengths, as attention is quadratic in the prompt.
Decode is KV memory and batch: an instance runs at most ``min(max_batch_size, the batch its KV
blocks hold, largest batch whose step time meets the TPOT SLO)`` sequences, each for ``output x
step_time`` seconds; sized at ``decode_target_utilization`` of the throughput that batch delivers
(see ``decode_rate_per_instance`` for why throughput, not batch). A request's blocks are reserved
on its decode instance when it is routed, before its prompt is prefilled, and held until its last
token, so the KV an instance needs is its rate times the mean block-seconds per request
(``decode_kv_blocks_held``): long prompts hold more blocks for longer, and long outputs stay in
the batch longer, so the length moments (``LengthMoments``) enter, not only the means. Backlog
(queued prompt tokens, sequences waiting for KV room) is added as the rate that clears it within
the backlog horizon. The two pools are sized from different quantities (prompt length for
prefill; output length, context and KV for decode), so they scale independently.

Only moments enter here: the SLO planner (``planner``) sizes from a whole length distribution
with queueing; this is the cheap form a scaling decision can afford every interval.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import get_gpu, get_model
from pdserve.perf.kv_budget import CapacityConfig, capacity_report
from pdserve.perf.perf_model import PerfModel, perf_model_for

_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class InstanceProfile:
    """What one prefill and one decode instance of a deployment can do.

    ``decode_num_blocks`` is the KV blocks of one decode instance (``kv_budget``); ``speedup``
    is simulated seconds per wall second of the instances (sim workers run faster than the
    hardware they model; 1 on real GPUs), so capacities are per second of the caller's clock.
    """

    prefill_perf: PerfModel
    decode_perf: PerfModel
    decode_num_blocks: int
    block_size_tokens: int = 16
    max_batch_size: int = 256
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.decode_num_blocks < 1:
            raise InvalidArgumentError(
                f"decode_num_blocks must be >= 1, got {self.decode_num_blocks}",
                field="decode_num_blocks")
        if self.block_size_tokens < 1:
            raise InvalidArgumentError(
                f"block_size_tokens must be >= 1, got {self.block_size_tokens}",
                field="block_size_tokens")
        if self.max_batch_size < 1:
            raise InvalidArgumentError(
                f"max_batch_size must be >= 1, got {self.max_batch_size}", field="max_batch_size")
        if not (math.isfinite(self.speedup) and self.speedup > 0):
            raise InvalidArgumentError(f"speedup must be > 0, got {self.speedup}", field="speedup")

    @property
    def num_gpus_per_prefill(self) -> int:
        return self.prefill_perf.tp_size

    @property
    def num_gpus_per_decode(self) -> int:
        return self.decode_perf.tp_size

    @classmethod
    def from_catalog(cls, model: str, gpu: str, *, prefill_tp_size: int = 1,
                     decode_tp_size: int = 1, block_size_tokens: int = 16,
                     max_batch_size: int = 256, gpu_memory_utilization: float = 0.9,
                     max_num_blocks: int = 0, speedup: float = 1.0) -> InstanceProfile:
        """A profile from catalog names: calibrated performance models, estimated KV capacity
        (capped at ``max_num_blocks`` when > 0, as sim workers may be)."""
        report = capacity_report(get_model(model), get_gpu(gpu), CapacityConfig(
            tp_size=decode_tp_size, block_size_tokens=block_size_tokens,
            gpu_memory_utilization=gpu_memory_utilization))
        num_blocks = report.num_blocks
        if max_num_blocks > 0:
            num_blocks = min(num_blocks, max_num_blocks)
        return cls(
            prefill_perf=perf_model_for(model, gpu, prefill_tp_size),
            decode_perf=perf_model_for(model, gpu, decode_tp_size),
            decode_num_blocks=num_blocks, block_size_tokens=block_size_tokens,
            max_batch_size=max_batch_size, speedup=speedup,
        )


@dataclass(frozen=True, slots=True)
class SizingConfig:
    """How demand becomes instances.

    ``tpot_slo_s`` bounds the decode batch (the step time of a full batch must meet it);
    ``*_target_utilization`` is the share of an instance's throughput the plan uses at the
    forecast demand (the rest absorbs arrivals bunching within an interval: TTFT includes queue
    wait; decode throughput at the TPOT-limited batch). ``kv_growth_fraction``: share of the
    output a sequence's KV reservation covers (1 = the whole output, as the router reserves an
    expected length up front; 0.5 = the average footprint of sequences that grow block by
    block).
    """

    tpot_slo_s: float = 0.1
    prefill_target_utilization: float = 0.75
    decode_target_utilization: float = 0.8
    kv_growth_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tpot_slo_s) and self.tpot_slo_s > 0):
            raise InvalidArgumentError(f"tpot_slo_s must be > 0, got {self.tpot_slo_s}",
                                       field="tpot_slo_s")
        for name in ("prefill_target_utilization", "decode_target_utilization"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InvalidArgumentError(f"{name} must be in (0, 1], got {value}", field=name)
        if not 0.0 <= self.kv_growth_fraction <= 1.0:
            raise InvalidArgumentError(
                f"kv_growth_fraction must be in [0, 1], got {self.kv_growth_fraction}",
                field="kv_growth_fraction")


class DecodeLimit(enum.StrEnum):
    """What caps the batch of a decode instance."""

    MAX_BATCH = "max_batch"
    KV = "kv"
    TPOT = "tpot"


@dataclass(frozen=True, slots=True)
class SizingDemand:
    """Demand to size for at one decision: request rate (per second of the caller's clock), mean
    lengths, and work already waiting (prompt tokens queued for prefill; sequences waiting for
    decode KV). Means only, unlike the planner's ``plan_inputs.Demand``, which carries a sample
    of the length distribution for its queueing model."""

    arrival_rate_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    num_queued_prefill_tokens: float = 0.0
    num_queued_decode_seqs: float = 0.0
    backlog_horizon_s: float = 60.0
    """Backlog is served within this long (the autoscaler uses its lead time)."""
    mean_squared_prompt_tokens: float = 0.0
    """Mean of the squared prompt lengths (0: unknown, taken as the mean's square: no spread).
    Prefill time grows with it: on traces with a long tail of prompts the mean time is well
    above the time of the mean prompt (the Mooncake conversation trace, Llama-3.1-70B at TP4 on
    H100: 1.12x)."""
    mean_cubed_prompt_tokens: float = 0.0
    """Mean of the cubed prompt lengths (0: unknown, taken as the least the first two moments
    allow). The decode KV a prompt holds while it is prefilled grows with it."""
    mean_squared_output_tokens: float = 0.0
    """Mean of the squared output lengths (0: unknown, taken as the mean's square)."""
    mean_prompt_output_tokens: float = 0.0
    """Mean of prompt length x output length (0: unknown, taken as independent)."""

    def moments(self) -> LengthMoments:
        return LengthMoments.of(self.mean_prompt_tokens, self.mean_output_tokens,
                                self.mean_squared_prompt_tokens, self.mean_cubed_prompt_tokens,
                                self.mean_squared_output_tokens, self.mean_prompt_output_tokens)


@dataclass(frozen=True, slots=True)
class LengthMoments:
    """The moments of prompt (P) and output (O) lengths that decode sizing reads, each at least
    its floor: ``E[P^2] >= E[P]^2``, ``E[P^3] >= E[P^2]^2 / E[P]`` (Cauchy-Schwarz),
    ``E[O^2] >= E[O]^2``; an unknown ``E[PO]`` (0) is ``E[P] E[O]`` (independent lengths). With
    only the means (``of(prompt, output)``) every request is taken to have the mean lengths.

    On the four public traces in the repository's data, ``E[PO] / (E[P] E[O])`` is 0.46-1.07
    and ``E[O^2] / E[O]^2`` 1.5-5.6, so neither default is safe to rely on where the moments
    can be measured."""

    prompt: float
    output: float
    prompt_squared: float
    prompt_cubed: float
    output_squared: float
    prompt_output: float

    @classmethod
    def of(cls, mean_prompt_tokens: float, mean_output_tokens: float,
           mean_squared_prompt_tokens: float = 0.0, mean_cubed_prompt_tokens: float = 0.0,
           mean_squared_output_tokens: float = 0.0,
           mean_prompt_output_tokens: float = 0.0) -> LengthMoments:
        prompt, output = max(1.0, mean_prompt_tokens), max(1.0, mean_output_tokens)
        squared = max(mean_squared_prompt_tokens, prompt * prompt)
        cubed = max(mean_cubed_prompt_tokens, squared * squared / prompt)
        return cls(prompt, output, squared, cubed, max(mean_squared_output_tokens, output * output),
                   mean_prompt_output_tokens if mean_prompt_output_tokens > 0 else prompt * output)

    @classmethod
    def measured(cls, prompt_tokens: Sequence[int] | np.ndarray,
                 output_tokens: Sequence[int] | np.ndarray) -> LengthMoments:
        """The moments of these requests' lengths (one prompt and one output length each)."""
        prompt = np.asarray(prompt_tokens, dtype=np.float64)
        output = np.asarray(output_tokens, dtype=np.float64)
        if prompt.shape != output.shape or prompt.size == 0:
            raise InvalidArgumentError("one prompt and one output length per request, at least "
                                       "one request", field="output_tokens")
        return cls.of(float(prompt.mean()), float(output.mean()), float(np.mean(prompt ** 2)),
                      float(np.mean(prompt ** 3)), float(np.mean(output ** 2)),
                      float(np.mean(prompt * output)))

    def demand(self, arrival_rate_per_s: float) -> SizingDemand:
        """Demand of ``arrival_rate_per_s`` requests per second with these lengths (no
        backlog)."""
        return SizingDemand(arrival_rate_per_s, self.prompt, self.output,
                            mean_squared_prompt_tokens=self.prompt_squared,
                            mean_cubed_prompt_tokens=self.prompt_cubed,
                            mean_squared_output_tokens=self.output_squared,
                            mean_prompt_output_tokens=self.prompt_output)

    @property
    def running_context_tokens(self) -> float:
        """Mean context of a sequence in a decode batch: ``E[O (P + O / 2)] / E[O]`` (a request
        is in the batch for as many steps as it has output tokens, so long outputs weigh
        more)."""
        return (self.prompt_output + self.output_squared / 2.0) / self.output


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """Instances each pool needs for a ``SizingDemand`` (fractional: round up to decide) and the
    per-instance capacities behind them (requests per second at the target utilisation)."""

    num_prefill: float
    num_decode: float
    prefill_rate_per_instance: float
    decode_rate_per_instance: float
    decode_batch_size: float
    decode_limit: DecodeLimit


def prefill_rate_per_instance(profile: InstanceProfile, sizing: SizingConfig,
                              mean_prompt_tokens: float,
                              mean_squared_prompt_tokens: float = 0.0) -> float:
    """Requests per second one prefill instance serves at the target utilisation.

    Costed as each prompt prefilled alone, at the mean prefill time over the lengths' first two
    moments (``PerfModel.mean_prefill_time_s``; with no mean square, a prompt of the mean
    length): slightly pessimistic, as batching shares the fixed overhead and weight reads.
    """
    prompt = max(1.0, mean_prompt_tokens)
    seconds = (profile.prefill_perf.mean_prefill_time_s(prompt, mean_squared_prompt_tokens)
               / profile.speedup)
    return sizing.prefill_target_utilization / seconds


def decode_kv_blocks_held(profile: InstanceProfile, sizing: SizingConfig, batch: float,
                          moments: LengthMoments) -> float:
    """KV blocks one decode instance holds while it runs ``batch`` sequences (Little's law on
    the blocks).

    The instance then completes ``rate = batch / (E[O] x step)`` requests per second, and each
    holds its reservation (``P + kv_growth_fraction x O`` tokens) from routing to its last
    token: while its prompt is prefilled (``prefill_time(P)``, as the prefill instance runs it
    alone; queueing there is left out) and for its ``O`` decode steps. Blocks held =
    ``rate x E[reservation x hold]`` over the lengths' moments: the prefill part weighs long
    prompts by their length (``PerfModel.token_weighted_prefill_time_s``), the decode part
    is ``batch`` sequences of ``E[O x reservation] / E[O]`` tokens each, plus half a block each
    for the partly used last one. Prefill times are in the model's seconds, like the step."""
    if batch <= 0:
        return 0.0
    growth, block = sizing.kv_growth_fraction, profile.block_size_tokens
    step_s = profile.decode_perf.decode_step_time_s(
        batch, math.ceil(batch * moments.running_context_tokens))
    rate = batch / (moments.output * step_s)
    prefill = profile.prefill_perf
    weighted_s = prefill.token_weighted_prefill_time_s(
        moments.prompt, moments.prompt_squared, moments.prompt_cubed)
    mean_s = prefill.mean_prefill_time_s(moments.prompt, moments.prompt_squared)
    prefilling_tokens = moments.prompt * weighted_s + growth * moments.output * mean_s
    running_tokens = (moments.prompt_output + growth * moments.output_squared) / moments.output
    return (rate * (prefilling_tokens / block + 0.5 * mean_s)
            + batch * (running_tokens / block + 0.5))


def decode_batch_limit(profile: InstanceProfile, sizing: SizingConfig, mean_prompt_tokens: float,
                       mean_output_tokens: float,
                       moments: LengthMoments | None = None) -> tuple[int, DecodeLimit]:
    """The largest batch one decode instance can run, and what limits it.

    KV: the largest batch whose blocks held (``decode_kv_blocks_held``: the running sequences'
    and those of the requests still being prefilled for it) fit the instance. TPOT: the largest
    batch whose step time (sequences at their mean running context) meets ``tpot_slo_s`` (at
    least 1: a lone sequence that misses it cannot be helped by more instances). ``moments``
    None: every request of the mean lengths.
    """
    moments = moments or LengthMoments.of(mean_prompt_tokens, mean_output_tokens)
    perf = profile.decode_perf
    num_blocks = profile.decode_num_blocks

    def fits(batch: int) -> bool:
        return decode_kv_blocks_held(profile, sizing, batch, moments) <= num_blocks

    limit, cap = DecodeLimit.MAX_BATCH, profile.max_batch_size
    if not fits(cap):
        limit, cap = DecodeLimit.KV, _largest_batch(fits, cap)
    context = moments.running_context_tokens
    tpot_s = sizing.tpot_slo_s * profile.speedup  # the model's own seconds

    def meets(batch: int) -> bool:
        return perf.decode_step_time_s(batch, math.ceil(batch * context)) <= tpot_s

    if meets(cap):
        return cap, limit
    return _largest_batch(meets, cap), DecodeLimit.TPOT


def _largest_batch(holds: Callable[[int], bool], cap: int) -> int:
    """The largest batch in ``[1, cap)`` for which ``holds`` (true up to some batch, false from
    there; false at ``cap``), or 1 if none."""
    low, high = 1, cap
    while high - low > 1:
        middle = (low + high) // 2
        if holds(middle):
            low = middle
        else:
            high = middle
    return low


def decode_rate_per_instance(profile: InstanceProfile, sizing: SizingConfig,
                             mean_prompt_tokens: float, mean_output_tokens: float,
                             moments: LengthMoments | None = None,
                             ) -> tuple[float, float, DecodeLimit]:
    """Requests per second one decode instance serves at the target utilisation, the batch it
    runs then, and what limits the batch.

    A request holds a batch slot for ``output x step_time`` seconds, so an instance running
    ``batch`` sequences completes ``batch / (E[O] x step)`` requests per second (Little's
    law). The target utilisation applies to that *throughput* at the largest allowed batch,
    not to the batch: decode steps of large models grow almost linearly with the batch once
    compute-bound, so a batch at 80% of the TPOT limit can deliver nearly 100% of the
    throughput, and an instance offered more than its maximum throughput does not degrade
    gently: its batch grows until every sequence on it misses the TPOT SLO (or, KV-bound, its
    router queue grows without bound).
    """
    moments = moments or LengthMoments.of(mean_prompt_tokens, mean_output_tokens)
    max_batch, limit = decode_batch_limit(profile, sizing, mean_prompt_tokens,
                                          mean_output_tokens, moments)
    context, output = moments.running_context_tokens, moments.output

    def rate_at(batch: int) -> float:
        step_s = profile.decode_perf.decode_step_time_s(
            batch, math.ceil(batch * context)) / profile.speedup
        return batch / (output * step_s)

    rate = sizing.decode_target_utilization * rate_at(max_batch)
    low, high = 1, max_batch  # the smallest batch that sustains ``rate`` (rate_at increases)
    while low < high:
        middle = (low + high) // 2
        if rate_at(middle) >= rate:
            high = middle
        else:
            low = middle + 1
    return rate, float(low), limit


def size_pools(profile: InstanceProfile, sizing: SizingConfig,
               demand: SizingDemand) -> PoolSizing:
    """Instances each pool needs for ``demand`` (pure; the oracle in ``bench/autoscale.py`` and
    the planner's callers use the same arithmetic)."""
    prefill_rate = prefill_rate_per_instance(profile, sizing, demand.mean_prompt_tokens,
                                             demand.mean_squared_prompt_tokens)
    decode_rate, batch, limit = decode_rate_per_instance(
        profile, sizing, demand.mean_prompt_tokens, demand.mean_output_tokens, demand.moments())
    horizon_s = max(demand.backlog_horizon_s, _EPSILON)
    prefill_backlog_rate = (demand.num_queued_prefill_tokens
                            / max(1.0, demand.mean_prompt_tokens) / horizon_s)
    decode_backlog_rate = demand.num_queued_decode_seqs / horizon_s
    rate = max(0.0, demand.arrival_rate_per_s)
    return PoolSizing(
        num_prefill=(rate + prefill_backlog_rate) / prefill_rate,
        num_decode=(rate + decode_backlog_rate) / decode_rate,
        prefill_rate_per_instance=prefill_rate,
        decode_rate_per_instance=decode_rate,
        decode_batch_size=batch,
        decode_limit=limit,
    )


def instances_for(need: float) -> int:
    """Whole instances for a fractional need (a hair over an integer does not add one)."""
    return max(0, math.ceil(need - 1e-6))

