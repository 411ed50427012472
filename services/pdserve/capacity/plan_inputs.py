"""What the SLO planner is asked: a ``Demand`` (arrival rate and a sample of paired prompt/output
lengths), an ``Slo``, the ``InstanceShape`` of each pool, and the ``DisaggConfig`` it sizes.

Values only (frozen, validated on construction); the performance and capacity models of a shape
are cached per shape, since every prediction the planner makes reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from pdserve.capacity.arrival_process import ArrivalProfile
from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import get_gpu, get_model
from pdserve.perf.kv_budget import CapacityConfig, CapacityReport, capacity_report
from pdserve.perf.perf_model import PerfModel, perf_model_for


@dataclass(frozen=True, slots=True)
class Demand:
    """What arrives: requests at mean rate ``rate_per_s``; request ``i`` of the sample has
    ``prompt_tokens[i]`` prompt and ``output_tokens[i]`` output tokens (pairs, e.g. trace rows).

    ``prefix_hit_rate`` is the fraction of prompt tokens found in a prefix cache, in [0, 1).
    ``arrivals``: the observed arrival pattern (e.g. a trace's timestamps), rescaled to
    ``rate_per_s`` (``arrival_process``); None means Poisson arrivals.
    """

    rate_per_s: float
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    prefix_hit_rate: float = 0.0
    arrivals: ArrivalProfile | None = None

    def __post_init__(self) -> None:
        if not (self.rate_per_s >= 0.0 and math.isfinite(self.rate_per_s)):
            raise InvalidArgumentError(
                f"rate_per_s must be a finite number >= 0, got {self.rate_per_s}", field="rate")
        if not self.prompt_tokens or len(self.prompt_tokens) != len(self.output_tokens):
            raise InvalidArgumentError(
                f"need the same non-zero number of prompt and output lengths, got "
                f"{len(self.prompt_tokens)} and {len(self.output_tokens)}", field="lengths")
        if min(self.prompt_tokens) < 1 or min(self.output_tokens) < 1:
            raise InvalidArgumentError("prompt and output lengths must be >= 1 token",
                                       field="lengths")
        if not 0.0 <= self.prefix_hit_rate < 1.0:
            raise InvalidArgumentError(
                f"prefix_hit_rate must be in [0, 1), got {self.prefix_hit_rate}",
                field="prefix_hit_rate")

    @classmethod
    def from_means(cls, rate_per_s: float, mean_prompt_tokens: float, mean_output_tokens: float,
                   prefix_hit_rate: float = 0.0, num_points: int = 256) -> Demand:
        """Lengths known only by their means: taken as exponential (the maximum-entropy law of
        a positive quantity with a given mean; real chat traces have a coefficient of variation
        near 1), as ``num_points`` evenly spaced quantiles, prompt and output independent."""
        if not (mean_prompt_tokens >= 1 and mean_output_tokens >= 1):
            raise InvalidArgumentError(
                f"mean lengths must be >= 1 token, got {mean_prompt_tokens} and "
                f"{mean_output_tokens}", field="lengths")
        quantiles = (np.arange(num_points) + 0.5) / num_points
        shape = -np.log1p(-quantiles)
        prompts = np.maximum(1, np.rint(shape * mean_prompt_tokens)).astype(int)
        outputs = np.maximum(1, np.rint(shape * mean_output_tokens)).astype(int)
        # Pair prompt quantile k with output quantile (k x stride) mod N: independent lengths.
        stride = next(s for s in range(num_points // 2 + 1, num_points) if math.gcd(s, num_points)
                      == 1) if num_points > 2 else 1
        outputs = outputs[(np.arange(num_points) * stride) % num_points]
        return cls(rate_per_s, tuple(int(x) for x in prompts), tuple(int(x) for x in outputs),
                   prefix_hit_rate)

    def with_rate(self, rate_per_s: float) -> Demand:
        return dataclasses.replace(self, rate_per_s=rate_per_s)

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(self.prompt_tokens) / len(self.prompt_tokens)

    @property
    def mean_output_tokens(self) -> float:
        return sum(self.output_tokens) / len(self.output_tokens)


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency bounds: TTFT and TPOT (mean time per output token after the first), both met by
    at least ``percentile`` percent of requests (DistServe's goodput uses 90)."""

    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise InvalidArgumentError(
                f"SLO bounds must be > 0, got ttft {self.ttft_s} s and tpot {self.tpot_s} s",
                field="slo")
        if not 0.0 < self.percentile < 100.0:
            raise InvalidArgumentError(
                f"percentile must be in (0, 100), got {self.percentile}", field="percentile")

    @property
    def attainment_target(self) -> float:
        return self.percentile / 100.0


@dataclass(frozen=True, slots=True)
class InstanceShape:
    """One engine instance: ``model`` on ``tp_size`` GPUs of type ``gpu`` (catalog names), with
    the engine settings capacity depends on. ``max_batch_size`` caps running sequences."""

    model: str
    gpu: str
    tp_size: int
    block_size_tokens: int = 16
    gpu_memory_utilization: float = 0.9
    max_batch_size: int = 256

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise InvalidArgumentError(
                f"max_batch_size must be >= 1, got {self.max_batch_size}", field="max_batch_size")

    def perf(self) -> PerfModel:
        """The calibrated performance model (cached per shape)."""
        return _perf_for(self.model, self.gpu, self.tp_size)

    def capacity(self) -> CapacityReport:
        """KV capacity; raises ``InvalidArgumentError`` for an unknown name, a TP that cannot
        shard the model, or a model that does not fit."""
        return _capacity_for(self)

    def check(self) -> None:
        """Raise ``InvalidArgumentError`` unless the shape is usable (see ``capacity``)."""
        self.capacity()


@functools.cache
def _perf_for(model: str, gpu: str, tp_size: int) -> PerfModel:
    return perf_model_for(model, gpu, tp_size)


@functools.cache
def _capacity_for(shape: InstanceShape) -> CapacityReport:
    config = CapacityConfig(tp_size=shape.tp_size, block_size_tokens=shape.block_size_tokens,
                            gpu_memory_utilization=shape.gpu_memory_utilization)
    return capacity_report(get_model(shape.model), get_gpu(shape.gpu), config)


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """A disaggregated deployment: ``num_prefill`` prefill and ``num_decode`` decode instances."""

    prefill: InstanceShape
    decode: InstanceShape
    num_prefill: int
    num_decode: int
    local_prefill_threshold_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise InvalidArgumentError(
                f"need >= 1 instance per pool, got {self.num_prefill} prefill and "
                f"{self.num_decode} decode", field="num_instances")

    @property
    def num_prefill_gpus(self) -> int:
        return self.num_prefill * self.prefill.tp_size

    @property
    def num_decode_gpus(self) -> int:
        return self.num_decode * self.decode.tp_size

    @property
    def num_gpus(self) -> int:
        return self.num_prefill_gpus + self.num_decode_gpus

    @property
    def pd_ratio(self) -> float:
        """Prefill GPUs per decode GPU."""
        return self.num_prefill_gpus / self.num_decode_gpus

