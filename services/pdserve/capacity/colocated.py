"""The colocated baseline: continuous batching with chunked prefill on the same GPUs.

This is what disaggregation is measured against, so it is modelled as well as the disaggregated
plan, with the same calibrated performance model, and where a choice had to be made it was made
in the baseline's favour.

**Scheduler** (vLLM's chunked prefill / Sarathi-Serve's stall-free batching; Agrawal et al.,
"Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve", OSDI'24): every step
runs all ``n`` decoding sequences plus up to ``c = token_budget - n`` prompt tokens, taken FCFS
from waiting prompts (one prompt's chunks, or several short prompts). Decodes are never paused,
but a step that carries a chunk takes longer, so every running sequence's TPOT absorbs the
prefill work; TTFT is the wait for earlier prompts' chunks plus the prompt's own chunks (DistServe,
Zhong et al., OSDI'24, sec. 2.2, describes this interference; both papers' models are restated
here, no code is taken from either).

**Mixed step** (``mixed_step_time_s``) with the roofline of ``perf_model``: the linear layers and
attention of the ``c`` chunk tokens cost prefill FLOPs at the prefill MFU, the ``n`` decode tokens
decode FLOPs at the decode MFU (each class at the efficiency it was calibrated at, so the step is
continuous with both pure phases); compute times add (the tensor cores are shared), while memory
traffic is shared: weights are read once per step for both, plus the decode KV and the prefix KV
the chunk attends to; one step overhead (the larger of the two). ``time = max(compute, memory) +
all-reduce + overhead``, equal to ``decode_step_time_s`` with no chunk and to ``prefill_time_s``
with no decodes. So a chunk is nearly free while the step is memory-bound -- Sarathi-Serve's
point -- and costs its full compute once the step is compute-bound.

**Queueing, per instance** (``num_instances`` instances, arrivals split evenly):
- the chunk scheduler is a server that, while prompts wait, processes ``c`` prompt tokens per
  mixed step ``tau_m``; prompt ``i`` takes ``S_i = u_i tau_m / c``. The busy fraction is ``rho =
  lambda_i E[u] tau_m / c``; a fraction ``rho`` of the time runs mixed steps, the rest
  decode-only steps ``tau_0``, so the mean step (what TPOT averages) is ``1 / (rho / tau_m +
  (1 - rho) / tau_0)``. Prompts queue as in M/G/c across instances (the router is assumed to
  send each prompt to the instance with the least queued prompt work, as for the prefill pool:
  generous, since it pools the instances' queues).
- decoding sequences: ``n = lambda_i E[m] x mean step`` (Little), solved as a fixed point since
  ``c`` and both step times depend on ``n``.
- TTFT ``= W + S_i + step / 2`` (an arrival waits for the running step) ``+ W_kv``; KV slots and
  ``W_kv`` as in the planner (prompt + output blocks held from arrival to the last token).
- TPOT of a request of ``m`` steps: a window of ``m`` steps sees a compound-Poisson number of
  mixed steps (each arriving prompt brings ``S_j / tau_m`` of them), so short outputs see a
  wider spread; plus the batch-size spread of the planner.

``best_colocated`` searches TP size and token budget (chunk size) for the highest goodput per GPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.capacity.latency_model import (
    Prediction,
    TtftGroup,
    batch_step_moments,
    batch_variance,
    kv_admission,
    tpot_attainment,
    tpot_percentile,
    ttft_cdf,
    ttft_percentile,
    unstable_prediction,
)
from pdserve.capacity.plan_inputs import Demand, InstanceShape, Slo
from pdserve.capacity.planner import GoodputPoint, max_rate
from pdserve.capacity.queueing import mgc_wait, moments, smallest_fixed_point
from pdserve.capacity.workload import (
    Workload,
    averaging_factor,
    context_per_sequence,
    decode_step_grid_s,
)
from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.perf_model import PerfModel

DEFAULT_TOKEN_BUDGETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Token budgets (``max_num_batched_tokens``) searched: vLLM's chunked-prefill default is 512
(2048 in later versions); Sarathi-Serve uses 512-2048; budgets below the decode batch leave no
room for prefill and are skipped by the model (unstable); 8192 is close to unchunked prefill
for chat prompts."""


@dataclass(frozen=True, slots=True)
class ColocatedConfig:
    """``num_instances`` identical instances, each prefilling and decoding, with a per-step token
    budget (decode tokens + prefill chunk tokens)."""

    shape: InstanceShape
    num_instances: int
    token_budget: int

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise InvalidArgumentError(
                f"num_instances must be >= 1, got {self.num_instances}", field="num_instances")
        if self.token_budget < 2:
            raise InvalidArgumentError(
                f"token_budget must be >= 2, got {self.token_budget}", field="token_budget")

    @property
    def num_gpus(self) -> int:
        return self.num_instances * self.shape.tp_size


@dataclass(frozen=True, slots=True)
class _StepTerms:
    """Per-GPU constants of a ``PerfModel``, read through its public work functions."""

    flops_per_token: float
    attn_flops_per_token_pair: float
    comm_bytes_per_token: float
    comm_steps: float

    @classmethod
    def of(cls, perf: PerfModel) -> _StepTerms:
        one, two = perf.prefill_work([1]), perf.prefill_work([2])
        # flops(l) = a l + b l^2  =>  b = (flops(2) - 2 flops(1)) / 2, a = flops(1) - b.
        pair = (two.flops - 2.0 * one.flops) / 2.0
        return cls(flops_per_token=one.flops - pair, attn_flops_per_token_pair=pair,
                   comm_bytes_per_token=one.comm_bytes, comm_steps=one.comm_steps)


@functools.lru_cache(maxsize=64)
def _step_terms(perf: PerfModel) -> _StepTerms:
    """``_StepTerms.of``, cached: the simulator costs a mixed step per chunk."""
    return _StepTerms.of(perf)


def mixed_step_time_s(perf: PerfModel, batch_size: float, context_tokens: float,
                      chunk_tokens: float, chunk_offset_tokens: float = 0.0) -> float:
    """Seconds for one step of ``batch_size`` decode tokens (reading ``context_tokens`` of KV in
    all) plus a prefill chunk of ``chunk_tokens`` tokens that follows ``chunk_offset_tokens``
    already-computed tokens of its prompt. The module docstring gives the formula."""
    if chunk_tokens <= 0:
        return perf.decode_step_time_s(batch_size, context_tokens)
    terms = _step_terms(perf)
    eff = perf.efficiency
    peak = perf.peak_flops_per_s
    decode = perf.decode_work(batch_size, context_tokens)
    decode_compute_s = decode.flops / (peak * eff.decode_mfu) if batch_size > 0 else 0.0
    chunk_flops = (terms.flops_per_token * chunk_tokens + terms.attn_flops_per_token_pair
                   * chunk_tokens * (2.0 * chunk_offset_tokens + chunk_tokens))
    compute_s = decode_compute_s + chunk_flops / (peak * eff.prefill_mfu)
    kv = perf.kv_bytes_per_token_per_gpu
    weights = perf.decode_work(batch_size + chunk_tokens, 0).memory_bytes
    memory_bytes = weights + kv * (context_tokens + chunk_offset_tokens + chunk_tokens)
    memory_s = memory_bytes / (perf.gpu.hbm_bytes_per_s * eff.mbu)
    comm_s = (terms.comm_bytes_per_token * (batch_size + chunk_tokens)
              / (perf.gpu.nvlink_bytes_per_s * eff.link_efficiency)
              + terms.comm_steps * eff.allreduce_latency_s)
    overhead_s = (max(eff.prefill_overhead_s, eff.decode_overhead_s) if batch_size > 0
                  else eff.prefill_overhead_s)
    return max(compute_s, memory_s) + comm_s + overhead_s


def chunk_offset_tokens(workload: Workload, chunk_tokens: float) -> float:
    """Offset that makes ``c (2 o + c)`` the mean attention work per chunk: summed over a
    prompt's chunks the causal attention is ``l^2 - h^2`` (``h`` cached tokens) whatever the
    chunking, i.e. ``E[l^2 - h^2] / E[u]`` per prompt token."""
    cached = workload.prompt - workload.uncached
    per_token = float((workload.prompt ** 2 - cached ** 2).sum() / workload.uncached.sum())
    return max(0.0, (per_token - chunk_tokens) / 2.0)


@dataclass(frozen=True, slots=True)
class _InstanceState:
    batch: float
    chunk_tokens: float
    decode_step_s: float
    decode_step_var_s2: float
    mixed_step_s: float
    busy_fraction: float
    mean_step_s: float


def _instance_state(config: ColocatedConfig, workload: Workload, rate_per_s: float
                    ) -> _InstanceState | None:
    """Per-instance steady state. Decode-only steps use the planner's batch law (size-biased,
    balanced by KV blocks); the mixed step is costed at the mean batch plus the same
    size-bias shift, so both configurations see identical batch statistics."""
    perf = config.shape.perf()
    rate = rate_per_s / config.num_instances
    mean_uncached = float(workload.uncached.mean())
    mean_steps = float(workload.steps.mean())
    context = context_per_sequence(workload)
    budget = config.token_budget
    grid = decode_step_grid_s(config.shape, workload)

    def state(batch: float) -> _InstanceState | None:
        chunk = budget - batch
        if chunk < 1.0:
            return None
        variance = batch_variance(workload, batch, config.num_instances,
                                  config.shape.block_size_tokens)
        decode_s, decode_var = batch_step_moments(grid, batch, variance)
        at_mean = perf.decode_step_time_s(max(batch, 1e-6), max(batch, 1e-6) * context)
        mixed_s = mixed_step_time_s(perf, batch, batch * context, chunk,
                                    chunk_offset_tokens(workload, chunk)) + decode_s - at_mean
        busy = rate * mean_uncached * mixed_s / chunk
        if busy >= 1.0:
            return None
        mean_step = 1.0 / (busy / mixed_s + (1.0 - busy) / decode_s)
        return _InstanceState(batch, chunk, decode_s, decode_var, mixed_s, busy, mean_step)

    def excess(batch: float) -> float:
        current = state(batch)
        if current is None:
            return math.inf
        return rate * mean_steps * current.mean_step_s - batch

    upper = float(min(config.shape.max_batch_size, budget - 1))
    batch = smallest_fixed_point(excess, upper)
    return None if batch is None else state(batch)


def predict_colocated(config: ColocatedConfig, demand: Demand, slo: Slo) -> Prediction:
    """The analytic prediction for the colocated ``config`` under ``demand``."""
    return _predict(config, Workload.of(demand), demand.rate_per_s, slo)


def _predict(config: ColocatedConfig, workload: Workload, rate_per_s: float, slo: Slo,
             with_percentiles: bool = True) -> Prediction:
    current = _instance_state(config, workload, rate_per_s)
    if current is None:
        return unstable_prediction(rate_per_s)
    service = workload.uncached * current.mixed_step_s / current.chunk_tokens
    mean_service, scv = moments(service)
    wait = mgc_wait(rate_per_s, mean_service, scv, config.num_instances)
    if not wait.is_stable:
        return unstable_prediction(rate_per_s)
    fixed = service + current.mean_step_s / 2.0
    residence = fixed + wait.mean_s + workload.steps * current.mean_step_s
    kv = kv_admission(config.shape, workload, rate_per_s, config.num_instances, residence)
    if not kv.wait.is_stable:
        return unstable_prediction(rate_per_s, kv.num_slots)
    everyone = np.ones(workload.size, dtype=bool)
    groups = [TtftGroup(everyone, fixed, wait, kv.wait)]
    has_steps = workload.steps > 0
    tpot_sd = _tpot_sd_s(config, workload, rate_per_s, current, service)
    ttft_ok = ttft_cdf(groups, slo.ttft_s, workload.size)
    tpot_ok = tpot_attainment(current.mean_step_s, tpot_sd, has_steps, slo.tpot_s)
    if with_percentiles:
        ttft_p = ttft_percentile(groups, slo.percentile, workload.size)
        tpot_p = tpot_percentile(current.mean_step_s, tpot_sd, has_steps, slo.percentile)
    else:
        ttft_p = tpot_p = math.nan
    return Prediction(
        rate_per_s=rate_per_s,
        attainment=float((ttft_ok * tpot_ok).mean()),
        ttft_s=ttft_p,
        tpot_s=tpot_p,
        mean_ttft_s=float(fixed.mean()) + wait.mean_s + kv.wait.mean_s,
        mean_tpot_s=current.mean_step_s,
        mean_queue_wait_s=wait.mean_s,
        mean_kv_wait_s=kv.wait.mean_s,
        prefill_utilization=current.busy_fraction,
        decode_batch_size=current.batch,
        num_kv_slots=kv.num_slots,
    )


def _tpot_sd_s(config: ColocatedConfig, workload: Workload, rate_per_s: float,
               current: _InstanceState, service_s: np.ndarray) -> np.ndarray:
    """Per-request TPOT spread: mixed steps in the request's window (compound Poisson: each
    prompt arriving at the instance brings ``S_j / tau_m`` of them) and the batch fluctuation
    averaged over the request's steps (as in the planner)."""
    rate = rate_per_s / config.num_instances
    steps = np.maximum(workload.steps, 1.0)
    window = steps * current.mean_step_s
    busy_sd = np.sqrt(rate * window * float((service_s ** 2).mean()))
    mixed_sd = (current.mixed_step_s - current.decode_step_s) / current.mixed_step_s * busy_sd
    mixed_sd = mixed_sd / steps
    batch_sd = np.sqrt(current.decode_step_var_s2 * averaging_factor(workload))
    return np.sqrt(mixed_sd ** 2 + batch_sd ** 2)


def goodput_rate_per_s(config: ColocatedConfig, demand: Demand, slo: Slo) -> float:
    """Highest rate (req/s) at which ``config`` meets both SLOs for ``slo.percentile`` %."""
    workload = Workload.of(demand)
    return max_rate(lambda rate: _predict(config, workload, rate, slo, False).attainment,
                    slo.attainment_target, max(demand.rate_per_s, 1e-3))


def best_colocated(demand: Demand, slo: Slo, shapes: Sequence[InstanceShape], num_gpus: int,
                   token_budgets: Sequence[int] = DEFAULT_TOKEN_BUDGETS
                   ) -> tuple[GoodputPoint[ColocatedConfig],
                              tuple[GoodputPoint[ColocatedConfig], ...]]:
    """The (shape, token budget) with the highest goodput per GPU on ``num_gpus`` GPUs (as many
    instances of each shape as fit), and every configuration tried, best first."""
    results = []
    for shape in shapes:
        shape.check()
        num_instances = num_gpus // shape.tp_size
        if num_instances < 1:
            continue
        for budget in token_budgets:
            config = ColocatedConfig(shape, num_instances, budget)
            results.append(GoodputPoint(config, goodput_rate_per_s(config, demand, slo)))
    if not results:
        raise InvalidArgumentError(f"no shape fits in {num_gpus} GPUs", field="num_gpus")
    results.sort(key=lambda r: -r.goodput_per_gpu)
    return results[0], tuple(results)
