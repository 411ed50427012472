"""A demand's length sample as arrays (``Workload``), and the per-request quantities the latency
models read from it on a given instance shape: prefill times, exposed KV-transfer times, decode
step times at each batch size, mean decode context, and how much of the batch-size variance a
request's own decode steps average away. Each is cached on the workload (one planning run asks
for the same arrays thousands of times)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from pdserve.capacity.plan_inputs import Demand, InstanceShape
from pdserve.perf.perf_model import PerfModel

MAX_SAMPLES = 4096
"""Length samples the model evaluates (a trace is subsampled evenly to this many)."""


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """A demand's length sample as arrays (``[num_samples]``), subsampled to ``MAX_SAMPLES``.

    ``uncached`` = prompt tokens prefill computes; ``steps`` = decode steps (output - 1).
    ``key`` identifies the sample for caches.
    """

    prompt: np.ndarray
    output: np.ndarray
    uncached: np.ndarray
    steps: np.ndarray
    key: str
    _prefill_s: dict[tuple[str, str, int], np.ndarray] = dataclasses.field(
        default_factory=dict, repr=False)
    _grids: dict[tuple[object, ...], np.ndarray] = dataclasses.field(
        default_factory=dict, repr=False)

    @classmethod
    def of(cls, demand: Demand) -> Workload:
        return _workload(demand.prompt_tokens, demand.output_tokens, demand.prefix_hit_rate)

    @property
    def size(self) -> int:
        return int(self.prompt.size)


@functools.lru_cache(maxsize=16)
def _workload(prompt_tokens: tuple[int, ...], output_tokens: tuple[int, ...],
              prefix_hit_rate: float) -> Workload:
    prompt = np.asarray(prompt_tokens, dtype=float)
    output = np.asarray(output_tokens, dtype=float)
    if prompt.size > MAX_SAMPLES:
        index = np.linspace(0, prompt.size - 1, MAX_SAMPLES).round().astype(int)
        prompt, output = prompt[index], output[index]
    uncached = np.maximum(1.0, np.ceil(prompt * (1.0 - prefix_hit_rate)))
    digest = hashlib.blake2b(prompt.tobytes() + output.tobytes()
                             + repr(prefix_hit_rate).encode(), digest_size=12).hexdigest()
    return Workload(prompt=prompt, output=output, uncached=uncached,
                    steps=np.maximum(output - 1.0, 0.0), key=digest)


def prefill_times_s(shape: InstanceShape, workload: Workload) -> np.ndarray:
    """``prefill_time_s([u_i])`` on ``shape`` for every sample (cached on the workload)."""
    key = (shape.model, shape.gpu, shape.tp_size)
    times = workload._prefill_s.get(key)
    if times is None:
        perf = shape.perf()
        values = np.unique(workload.uncached)
        by_value = np.array([perf.prefill_time_s([int(v)]) for v in values])
        times = by_value[np.searchsorted(values, workload.uncached)]
        workload._prefill_s[key] = times
    return times


def transfer_exposed_s(shape: InstanceShape, workload: Workload,
                       prefill_s: np.ndarray) -> np.ndarray:
    """Transfer time left after layer-by-layer streaming: layer ``l`` moves once it is computed,
    so the last layer lands ``max(T / L, T - S (L - 1) / L)`` after compute ends (``T`` the
    whole prompt's transfer time, ``S`` the prefill time, ``L`` layers)."""
    perf = shape.perf()
    layers = perf.model.num_layers
    total = perf.kv_bytes_per_token_per_gpu * workload.prompt / perf.gpu.nic_bytes_per_s
    return np.maximum(total / layers, total - prefill_s * (layers - 1) / layers)


def context_per_sequence(workload: Workload, mask: np.ndarray | None = None) -> float:
    """Mean context (tokens) a decoding sequence holds, averaged over decode steps: request
    ``i`` contributes ``m_i`` steps at mean context ``l_i + 1 + m_i / 2``."""
    steps = workload.steps if mask is None else workload.steps[mask]
    prompt = workload.prompt if mask is None else workload.prompt[mask]
    total = float(steps.sum())
    if total <= 0.0:
        return float(prompt.mean()) if prompt.size else 0.0
    return float((steps * (prompt + 1.0 + steps / 2.0)).sum() / total)


def decode_step_grid_s(shape: InstanceShape, workload: Workload) -> np.ndarray:
    """Decode step time at batch ``b`` for ``b = 0 .. max_batch_size`` (``[cap + 1]``), each
    sequence holding the workload's mean context; entry 0 is the step of a near-empty batch.
    Cached on the workload."""
    key = ("decode-grid", shape.model, shape.gpu, shape.tp_size, shape.max_batch_size)
    grid = workload._grids.get(key)
    if grid is None:
        perf = shape.perf()
        context = context_per_sequence(workload)
        grid = np.array([_decode_step_s(perf, float(b), context)
                         for b in range(shape.max_batch_size + 1)])
        workload._grids[key] = grid
    return grid


def averaging_factor(workload: Workload) -> np.ndarray:
    """Per request, the variance of the batch size averaged over the request's own ``m_i``
    steps, relative to the variance at one instant (``[num_samples]``, in (0, 1]).

    The occupancy of an M/G/infinity system has autocorrelation ``rho(h) = E[(S - h)+] / E[S]``
    (``S`` = time in the batch, here in steps); averaging over a window ``L`` leaves
    ``(2 / L^2) int_0^L (L - h) rho(h) dh`` of the variance. Short outputs see the full
    variance, outputs much longer than a typical stay see little. Cached on the workload.
    """
    key = ("averaging",)
    cached = workload._grids.get(key)
    if cached is not None:
        return cached
    stays = np.sort(workload.steps[workload.steps > 0])
    if stays.size == 0:
        factor = np.ones(workload.size)
    else:
        h = np.linspace(0.0, float(stays[-1]), 513)
        tail_sum = np.concatenate((np.cumsum(stays[::-1])[::-1], [0.0]))
        above = np.searchsorted(stays, h, side="right")
        excess = (tail_sum[above] - h * (stays.size - above)) / stays.size
        rho = excess / float(stays.mean())
        dh = np.diff(h)
        first = np.concatenate(([0.0], np.cumsum(0.5 * (rho[1:] + rho[:-1]) * dh)))
        second = np.concatenate(([0.0], np.cumsum(0.5 * (h[1:] * rho[1:] + h[:-1] * rho[:-1])
                                                   * dh)))
        window = np.maximum(workload.steps, 1.0)
        i1 = np.interp(window, h, first, right=first[-1])
        i2 = np.interp(window, h, second, right=second[-1])
        factor = np.clip(2.0 * (window * i1 - i2) / (window * window), 0.0, 1.0)
    workload._grids[key] = factor
    return factor


def _decode_step_s(perf: PerfModel, batch: float, context_per_seq: float) -> float:
    """Decode step time at a fractional batch (the roofline is linear in the batch); a batch
    near 0 still pays the weight read and the overheads."""
    batch = max(batch, 1e-6)
    return perf.decode_step_time_s(batch, batch * context_per_seq)
