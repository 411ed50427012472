"""What one simulated instance can do, from the capacity and performance models.

``InstanceModel`` bundles, for one (model, GPU, TP) instance type: the KV block budget
(``capacity_report``, vLLM's block arithmetic), prefill batch time and decode step time (the
calibrated roofline, ``perf_model_for``) and the *exposed* KV transfer time of layer-wise streaming.

Exposed transfer. Prefill computes ``L`` layers in ``C`` seconds (``C / L`` each); layer ``l``'s KV
(``T / L`` seconds of NIC time, ``T = kv_transfer_time_s``) starts moving once layer ``l`` is done
and the NIC is free. The last layer lands ``max(T / L, T - C (L - 1) / L)`` after compute ends:
one layer's transfer when the NIC keeps up with compute, otherwise the part of ``T`` that
compute could not hide. Every prompt of a prefill batch shares the instance's NICs, so ``T`` and
``C`` are the batch's. Cached prefix KV is counted in ``T`` (it is sent too) although it could
start moving earlier: a slight over-estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.capacity.colocated import mixed_step_time_s
from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import get_gpu, get_model
from pdserve.perf.kv_budget import CapacityConfig, capacity_report
from pdserve.perf.perf_model import PerfModel, perf_model_for


@dataclass(frozen=True, slots=True)
class InstanceModel:
    """Timing and KV capacity of one instance type. ``num_blocks`` is per instance."""

    perf: PerfModel
    num_blocks: int
    block_size_tokens: int
    num_layers: int
    tp_size: int

    def prefill_s(self, uncached_tokens: Sequence[int]) -> float:
        """One prefill batch of prompts with ``uncached_tokens`` each still to compute."""
        return self.perf.prefill_time_s(uncached_tokens)

    def decode_step_s(self, batch_size: int, total_context_tokens: int) -> float:
        return self.perf.decode_step_time_s(batch_size, total_context_tokens)

    def decode_step_lines(self, batch_size: int) -> tuple[float, float, float, float] | None:
        """``(base_a, slope_a, base_b, slope_b)`` with ``decode_step_s(batch_size, c) ==
        max(base_a + slope_a c, base_b + slope_b c)`` for every context ``c`` (seconds, per
        token), or None if the performance model is not of that shape.

        The roofline is the larger of a compute and a memory bound, each linear in the context
        for a fixed batch; the lines are read off the model near zero context and far out, then
        checked against it at contexts from 0 to 10^8 tokens and around their crossing.
        """
        step = self.perf.decode_step_time_s
        n = batch_size
        near, far = 1024.0 * n, 1e9
        slope_a = (step(n, int(near)) - step(n, 0)) / near
        base_a = step(n, 0)
        slope_b = (step(n, int(2 * far)) - step(n, int(far))) / far
        base_b = step(n, int(far)) - slope_b * far
        points = [0, 16, 1000, 10**4, 10**5, 10**6, 10**7, 10**8]
        if abs(slope_b - slope_a) > 1e-30:
            crossing = (base_a - base_b) / (slope_b - slope_a)
            if 0 < crossing < 1e9:
                points += [int(crossing) + d for d in (-n, -1, 0, 1, n) if crossing + d >= 0]
        for context in points:
            exact = step(n, context)
            modelled = max(base_a + slope_a * context, base_b + slope_b * context)
            if abs(modelled - exact) > 1e-9 * exact:
                return None
        return base_a, slope_a, base_b, slope_b

    def mixed_step_s(self, batch_size: int, context_tokens: int,
                     chunks: Sequence[tuple[int, int]]) -> float:
        """One chunked-prefill step: ``batch_size`` decode tokens reading ``context_tokens`` of
        KV, plus prompt chunks ``(chunk_tokens, offset_tokens)`` (a chunk follows
        ``offset_tokens`` already-computed tokens of its prompt), timed by the colocated mixed
        step of ``pdserve.capacity.colocated`` (the roofline the planner's colocated baseline
        uses). Several chunks are passed as one chunk of their total length at the offset that
        gives the same causal-attention work (``sum c (2 o + c) == C (2 o_eq + C)``; ``o_eq`` is
        negative for several fresh prompts, which is still exact for the FLOPs)."""
        total = 0
        pair_work = 0
        for chunk_tokens, offset_tokens in chunks:
            total += chunk_tokens
            pair_work += chunk_tokens * (2 * offset_tokens + chunk_tokens)
        if total == 0:
            return self.perf.decode_step_time_s(batch_size, context_tokens)
        offset = (pair_work / total - total) / 2.0
        return mixed_step_time_s(self.perf, batch_size, context_tokens, total, offset)

    def exposed_transfer_s(self, prompt_tokens: int, compute_s: float) -> float:
        """Seconds from the end of prefill compute until the last layer's KV has landed."""
        total_s = self.perf.kv_transfer_time_s(prompt_tokens)
        layers = self.num_layers
        return max(total_s / layers, total_s - compute_s * (layers - 1) / layers)


def instance_model(model: str, gpu: str, tp_size: int, *, block_size_tokens: int = 16,
                   gpu_memory_utilization: float = 0.9) -> InstanceModel:
    """``InstanceModel`` by catalog names (calibrated efficiency, catalog memory estimates)."""
    model_spec = get_model(model)
    gpu_spec = get_gpu(gpu)
    report = capacity_report(model_spec, gpu_spec, CapacityConfig(
        tp_size=tp_size, block_size_tokens=block_size_tokens,
        gpu_memory_utilization=gpu_memory_utilization))
    return InstanceModel(
        perf=perf_model_for(model_spec.name, gpu_spec.name, tp_size),
        num_blocks=report.num_blocks, block_size_tokens=block_size_tokens,
        num_layers=model_spec.num_layers, tp_size=tp_size)


@dataclass(frozen=True, slots=True)
class PoolSplit:
    """A prefill/decode split of a number of instances and the request rate that loads both
    pools to ``target_utilization`` (by mean work per request; queueing is not modelled)."""

    num_prefill: int
    num_decode: int
    rate_per_s: float
    prefill_s_per_request: float
    decode_requests_per_s_per_instance: float


def balance_pools(prompt_tokens: np.ndarray, output_tokens: np.ndarray, instance: InstanceModel,
                  num_instances: int, *, max_batch_size: int = 256,
                  target_utilization: float = 0.7,
                  prefill_s_per_request: float | None = None) -> PoolSplit:
    """Split ``num_instances`` so prefill and decode are about equally loaded.

    Prefill work per request: ``prefill_s_per_request`` if given (e.g. measured in a pilot
    simulation, where batching makes it cheaper), else the mean of ``prefill_s`` over the
    sampled prompts, one prompt per batch. Decode capacity per instance: a full batch
    (``max_batch_size``, or fewer when KV runs out) of sequences at the mean context (prompt +
    half the output) generates ``batch / step_s`` tokens per second, i.e. that divided by the
    mean decode steps per request (output - 1) requests per second. Both pools then take
    instances in proportion to their work per request.
    """
    if num_instances < 2:
        raise InvalidArgumentError("num_instances must be >= 2 to split", field="num_instances")
    if len(prompt_tokens) == 0:
        raise InvalidArgumentError("no requests to balance", field="trace")
    sample = np.linspace(0, len(prompt_tokens) - 1, min(len(prompt_tokens), 2000)).astype(int)
    prompts = prompt_tokens[sample]
    outputs = output_tokens[sample]
    prefill_s = prefill_s_per_request or float(
        np.mean([instance.prefill_s([int(p)]) for p in prompts]))
    mean_context = float(np.mean(prompts + outputs / 2))
    mean_reserved_blocks = float(np.mean(np.ceil((prompts + outputs) / instance.block_size_tokens)))
    batch = max(1, min(max_batch_size, int(instance.num_blocks / max(1.0, mean_reserved_blocks))))
    step_s = instance.decode_step_s(batch, int(batch * mean_context))
    decode_rps = batch / step_s / float(np.mean(np.maximum(outputs - 1, 1)))
    decode_s_per_request = 1.0 / decode_rps
    share = prefill_s / (prefill_s + decode_s_per_request)
    num_prefill = min(num_instances - 1, max(1, round(num_instances * share)))
    num_decode = num_instances - num_prefill
    rate = target_utilization * min(num_prefill / prefill_s, num_decode * decode_rps)
    return PoolSplit(num_prefill, num_decode, rate, prefill_s, decode_rps)
