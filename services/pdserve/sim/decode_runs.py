"""Continuous batching on a simulated decode instance, one event per *run* of steps.

Each step advances every sequence in the batch by one token in ``decode_step_s(batch, total
context)``. A sequence's finishing step is known when it joins the batch (``join step + output -
1``), so the batch is a heap keyed by finishing step and a run lasts until the next one finishes:
``start_run`` sums the run's steps in closed form (``num_steps`` steps, each reading ``n`` more
context tokens than the one before), ``finish_run`` applies it, and ``cut_run`` ends it early at
a step boundary when the batch must change sooner (a sequence arrives to join it, or a local
prefill arrives). Local prefill runs as a step of its own between decode steps (the batch
stalls for it), ``take_local_batch`` forming it; or, with chunked prefill, as prompt chunks
carried by single decode steps (``take_chunks``).

Functions of a ``DecodeInstance`` and the clock; the caller schedules the events they return.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from pdserve.sim.engine_model import InstanceModel
from pdserve.sim.state import STEP_DECODE, DecodeInstance, SimRequest


class DecodeTiming:
    """Decode step times of one instance type, for the hot path: per batch size the two lines
    of the roofline in the context length (``InstanceModel.decode_step_lines``, cached, None
    when the performance model is of another shape) and the step-time function itself."""

    __slots__ = ("lines_by_batch", "model", "step_s")

    def __init__(self, model: InstanceModel) -> None:
        self.model = model
        self.step_s: Callable[[int, int], float] = model.perf.decode_step_time_s
        self.lines_by_batch: dict[int, tuple[float, float, float, float] | None] = {}


def start_run(dec: DecodeInstance, now: float, timing: DecodeTiming) -> float:
    """Start decode steps until the batch's next completion, as one event; returns when the
    run ends.

    Step ``i`` reads ``n`` more context tokens than step ``i - 1``. For a batch of ``n`` the
    step time is the larger of two lines in the context length (the roofline's compute and
    memory bounds; ``InstanceModel.decode_step_lines``, checked against the performance model),
    so while one line dominates the steps sum in closed form; a run in which the dominant line
    changes is cut to one step. Without lines (a performance model of another shape), three
    calls check that the run is linear.
    """
    n = dec.n_batch
    context = dec.ctx_base + n * dec.steps
    num_steps = dec.heap[0][0] - dec.steps
    try:
        lines = timing.lines_by_batch[n]
    except KeyError:
        lines = timing.lines_by_batch[n] = timing.model.decode_step_lines(n)
    delta_s = 0.0
    if lines is not None:  # step time = the larger of two lines in the context length
        base_a, slope_a, base_b, slope_b = lines
        line_a = base_a + slope_a * context
        line_b = base_b + slope_b * context
        first_s = line_a if line_a >= line_b else line_b  # noqa: FURB136 - hot path
        if num_steps > 1:
            end = context + (num_steps - 1) * n
            if (line_a >= line_b) == (base_a + slope_a * end >= base_b + slope_b * end):
                delta_s = (slope_a if line_a >= line_b else slope_b) * n
            else:
                num_steps = 1  # the roofline regime changes inside the run
    else:
        step_s = timing.step_s
        first_s = step_s(n, context)
        if num_steps > 1:
            last_s = step_s(n, context + (num_steps - 1) * n)
            delta_s = (last_s - first_s) / (num_steps - 1)
            mid = num_steps // 2
            if num_steps > 2 and abs(step_s(n, context + mid * n)
                                     - (first_s + mid * delta_s)) > 1e-9 * last_s:
                num_steps = 1
    dec.step_kind = STEP_DECODE
    dec.busy = True
    dec.run_steps = num_steps
    dec.run_start = now
    dec.run_first_s = first_s
    dec.run_delta_s = delta_s
    duration = num_steps * first_s + delta_s * (num_steps * (num_steps - 1) / 2)
    return now + duration


def cut_run(dec: DecodeInstance, now: float) -> float | None:
    """End ``dec``'s decode run at the first step boundary at or after ``now``: the time of that
    boundary (the run's event in flight is voided: ``epoch`` moves on), or None if the run ends
    there anyway (or ``dec`` is not in a run of several steps)."""
    num_steps = dec.run_steps
    if num_steps <= 1 or dec.step_kind != STEP_DECODE:
        return None
    first_s, delta_s = dec.run_first_s, dec.run_delta_s
    elapsed = now - dec.run_start

    def ends_s(j: int) -> float:
        return j * first_s + delta_s * (j * (j - 1) / 2)

    if delta_s > 0:
        b = first_s - delta_s / 2
        j = math.ceil((-b + math.sqrt(b * b + 2 * delta_s * elapsed)) / delta_s)
    else:
        j = math.ceil(elapsed / first_s)
    j = max(1, min(num_steps, j))
    while j < num_steps and ends_s(j) < elapsed:
        j += 1
    while j > 1 and ends_s(j - 1) >= elapsed:
        j -= 1
    if j >= num_steps:
        return None
    dec.run_steps = j
    dec.epoch += 1
    return dec.run_start + ends_s(j)


def finish_run(dec: DecodeInstance) -> list[SimRequest]:
    """Apply the run that just ended: the sequences that produced their last token in it, taken
    out of the batch."""
    dec.steps += dec.run_steps
    steps = dec.steps
    heap = dec.heap
    finished = []
    while heap and heap[0][0] <= steps:
        req = heapq.heappop(heap)[2]
        dec.n_batch -= 1
        dec.ctx_base -= req.prompt + 1 - req.join_step
        finished.append(req)
    return finished


def join_waiting(dec: DecodeInstance, max_batch_size: int, now: float) -> None:
    """Sequences waiting for a batch slot join the batch at this step boundary, oldest first,
    up to ``max_batch_size`` (the caller checks that some wait and the batch has room)."""
    waiting = dec.waiting
    room = max_batch_size - dec.n_batch
    steps = dec.steps
    heap = dec.heap
    for _ in range(min(room, len(waiting))):
        req = waiting.popleft()
        req.join_step = steps
        req.join_s = now
        heapq.heappush(heap, (steps + req.output - 1, req.i, req))
        dec.ctx_base += req.prompt + 1 - steps
    dec.n_batch = len(heap)


def take_local_batch(dec: DecodeInstance,
                     budget_tokens: int) -> tuple[list[tuple[SimRequest, int]], list[int]]:
    """The next local prefill batch: queued prompts first come first served while they fit in
    ``budget_tokens`` (at least one), stale entries (an older attempt) dropped; returns the
    ``(request, attempt)`` pairs and their prompt lengths."""
    local = dec.local
    batch: list[tuple[SimRequest, int]] = []
    lengths: list[int] = []
    total = 0
    while local:
        req, attempt = local[0]
        if req.attempt != attempt:
            local.popleft()
            continue
        if batch and total + req.prompt > budget_tokens:
            break
        local.popleft()
        batch.append((req, attempt))
        lengths.append(req.prompt)
        total += req.prompt
    return batch, lengths


def take_chunks(dec: DecodeInstance, room_tokens: int
                ) -> tuple[list[tuple[int, int]], list[tuple[SimRequest, int]]]:
    """The prompt chunks one chunked-prefill step carries: queued local prompts first come first
    served, each taking what is left of it or of ``room_tokens`` (only the last may be partial,
    as vLLM's scheduler does), stale entries dropped. Each request's ``prefilled`` advances now;
    returns the ``(chunk_tokens, offset_tokens)`` of every chunk and the ``(request, attempt)``
    of the prompts this step completes (taken off ``dec.local``; a partial one stays at its
    head)."""
    local = dec.local
    chunks: list[tuple[int, int]] = []
    completed: list[tuple[SimRequest, int]] = []
    while local and room_tokens > 0:
        req, attempt = local[0]
        if req.attempt != attempt:
            local.popleft()
            continue
        take = min(req.prompt - req.prefilled, room_tokens)
        chunks.append((take, req.prefilled))
        req.prefilled += take
        room_tokens -= take
        if req.prefilled < req.prompt:
            break
        local.popleft()
        completed.append((req, attempt))
    return chunks, completed
