"""Plans checked by replay: the SLO planner's candidate is replayed through the simulator on the
trace it was made for, and grown until the replay meets the target percentile.

The planner (``pdserve.capacity.planner``) predicts with an analytic model of the trace's
arrival process (``pdserve.capacity.arrival_process``), which approximates what bursts do to
the queues. The replay runs the live policies (routing, admission) over the trace's own
timestamps, so it sees what the model misses: the backlog a burst leaves, the router's
balancing, prefix-cache placement. The plan offered is the first candidate whose replay meets
the target; both figures are kept, so an operator sees how far the model was off.

Growing a plan. Each request the replay counts as a miss is blamed on one pool: on the decode
pool when its TPOT missed or its TTFT would have met the bound without the wait for decode KV
room (``SimResult.admission_wait_s``), otherwise on the prefill pool; a request the router sent
to decode for prefill because the prefill pool was saturated is the prefill pool's, and so are
TPOT misses while such overflow is common (``blame``). The pool (or both pools)
with at least a quarter of the misses grows by a tenth of its size (at least one instance), and
the candidate is replayed again, until the target is met, ``max_replays`` replays have run or
the GPU cap is reached.

The prefix-hit rate the planner starts from is an unbounded cache's (``trace_prefix_hit_rate``);
the replay's caches are per instance, bounded and reached through the router's choices, so
after the first replay the rate it measured replaces it (once) and the plan is made again.

Replays use the live worker agent's settings: one prompt per prefill batch, the shape's batch
cap, the plan's local-prefill threshold. ``demand_from_trace`` and ``at_rate`` give the demand
and the trace at a rate (the trace's own timestamps compressed or stretched: never jittered
copies, which would smooth its bursts away).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.capacity.arrival_process import ArrivalProfile
from pdserve.capacity.disaggregated import with_threshold
from pdserve.capacity.plan_inputs import Demand, DisaggConfig, InstanceShape, Slo
from pdserve.capacity.planner import ArrivalModel, Plan, evaluate_plan, plan
from pdserve.common.errors import InvalidArgumentError
from pdserve.router.policy import RoutingConfig
from pdserve.sim.config import ClusterSpec, SimConfig, SloSpec
from pdserve.sim.result import RequestStatus, SimResult
from pdserve.sim.simulator import simulate
from pdserve.sim.traces import Trace, time_scale

GROWTH_FRACTION = 0.1
"""A pool that is short grows by this fraction of its size per replay (at least 1 instance)."""

BLAME_SHARE = 0.25
"""A pool grows when at least this share of the replay's misses is blamed on it."""


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """One candidate and its replay: instances per pool, the arrival model's attainment, the
    replay's, the misses blamed on each pool and the replay's wall time (seconds)."""

    num_prefill: int
    num_decode: int
    predicted_attainment: float
    replayed_attainment: float
    num_prefill_misses: int
    num_decode_misses: int
    wall_s: float


@dataclass(frozen=True, slots=True)
class CheckedPlan:
    """The plan offered (``plan``: configuration, the arrival model's prediction and goodput),
    its replayed attainment, the last replay, and every candidate replayed on the way."""

    plan: Plan
    replayed_attainment: float
    target: float
    replay: SimResult
    steps: tuple[ReplayStep, ...]

    @property
    def is_met(self) -> bool:
        return self.replayed_attainment >= self.target

    @property
    def predicted_attainment(self) -> float:
        return self.plan.prediction.attainment


def at_rate(trace: Trace, rate_per_s: float) -> Trace:
    """``trace`` with its timestamps compressed (or stretched) to mean rate ``rate_per_s``: the
    same requests, every gap scaled by one factor, so bursts keep their shape."""
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise InvalidArgumentError(f"rate must be > 0, got {rate_per_s}", field="rate")
    if trace.mean_rate_per_s <= 0:
        raise InvalidArgumentError("the trace needs two requests at different times to set "
                                   "its rate", field="trace")
    return time_scale(trace, trace.mean_rate_per_s / rate_per_s)


def trace_prefix_hit_rate(trace: Trace) -> float:
    """Fraction of prompt tokens an unbounded prefix cache would hold, from a trace's prefix
    block ids (Mooncake): a request's leading blocks whose ids an earlier request carried."""
    if (trace.hash_row is None or trace.hash_offsets is None or trace.hash_ids is None):
        return 0.0
    seen: set[int] = set()
    hit_tokens = 0
    total = int(trace.prompt_tokens.sum())
    for index in range(trace.num_requests):
        row = int(trace.hash_row[index])
        if row < 0:
            continue
        ids = trace.hash_ids[trace.hash_offsets[row]:trace.hash_offsets[row + 1]].tolist()
        prompt = int(trace.prompt_tokens[index])
        leading = 0
        for block_id in ids:
            if block_id not in seen:
                break
            leading += 1
        seen.update(ids)
        hit_tokens += min(leading * trace.hash_block_tokens, prompt - 1)
    return hit_tokens / total if total else 0.0


def demand_from_trace(trace: Trace, rate_per_s: float | None = None,
                      prefix_hit_rate: float | None = None) -> Demand:
    """The planner's demand for ``trace`` at ``rate_per_s`` (default: the trace's own): its
    length pairs, its arrival pattern (``ArrivalProfile``) and its prefix-hit rate (measured
    from its block hashes unless given)."""
    if trace.num_requests < 2 or trace.mean_rate_per_s <= 0:
        raise InvalidArgumentError("the trace needs at least two requests at different times",
                                   field="trace")
    rate = trace.mean_rate_per_s if rate_per_s is None else rate_per_s
    hit = trace_prefix_hit_rate(trace) if prefix_hit_rate is None else prefix_hit_rate
    # Work per pool: uncached prompt tokens (prefill), output tokens (decode steps).
    arrivals = ArrivalProfile(trace.arrival_s,
                              prefill_work=np.maximum(1.0, trace.prompt_tokens * (1.0 - hit)),
                              decode_work=trace.output_tokens.astype(np.float64))
    return Demand(rate, tuple(trace.prompt_tokens.tolist()), tuple(trace.output_tokens.tolist()),
                  prefix_hit_rate=hit, arrivals=arrivals)


def replay_config(config: DisaggConfig, trace: Trace, slo: Slo) -> SimResult:
    """Simulate ``config`` on ``trace`` (already at the planned rate) with the live worker
    agent's settings. The pools may differ in TP (each simulated at its own), not in model or
    GPU."""
    if (config.prefill.model, config.prefill.gpu) != (config.decode.model, config.decode.gpu):
        raise InvalidArgumentError(
            "a replay needs one model and GPU for both pools; got prefill "
            f"{config.prefill.model} on {config.prefill.gpu} and decode {config.decode.model} "
            f"on {config.decode.gpu}", field="gpu")
    shape = config.decode
    cluster = ClusterSpec(config.num_prefill, config.num_decode, model=shape.model,
                          gpu=shape.gpu, tp_size=shape.tp_size,
                          prefill_tp_size=config.prefill.tp_size,
                          block_size_tokens=shape.block_size_tokens,
                          gpu_memory_utilization=shape.gpu_memory_utilization,
                          max_batch_size=shape.max_batch_size, prefill_batch_tokens=1)
    return simulate(trace, SimConfig(
        cluster=cluster,
        routing=RoutingConfig(
            local_prefill_threshold_tokens=config.local_prefill_threshold_tokens),
        slo=SloSpec(ttft_ms=slo.ttft_s * 1000.0, tpot_ms=slo.tpot_s * 1000.0)))


def blame(result: SimResult) -> tuple[int, int]:
    """Misses of ``result`` blamed on the prefill pool and on the decode pool (module
    docstring); rejected or failed requests are blamed on decode (no KV room)."""
    limit_ttft = result.config.slo.ttft_ms / 1000.0
    limit_tpot = result.config.slo.tpot_ms / 1000.0
    completed = result.status == RequestStatus.COMPLETED
    ttft_missed = completed & (result.ttft_s > limit_ttft)
    tpot_missed = completed & (result.tpot_s > limit_tpot)
    kv_caused = ttft_missed & (result.ttft_s - result.admission_wait_s <= limit_ttft)
    # Prompts above the local-prefill threshold that decode prefilled anyway: the router
    # found the prefill pool saturated and sent them there, stalling decode batches.
    threshold = result.config.routing.local_prefill_threshold_tokens
    overflow = completed & result.is_local_prefill & (result.prompt_tokens > threshold)
    is_overflowing = float(np.mean(overflow)) > OVERFLOW_SHARE if result.num_requests else False
    missed = ttft_missed | tpot_missed | ~completed
    decode = (tpot_missed | kv_caused | ~completed) & ~overflow
    if is_overflowing:
        decode &= ~tpot_missed
    prefill = missed & ~decode
    return int(np.count_nonzero(prefill)), int(np.count_nonzero(decode))


OVERFLOW_SHARE = 0.05
"""When more requests than this were prefilled on decode because the prefill pool was saturated,
the TPOT misses (decode stalled by those prefills) are blamed on the prefill pool."""


def _grown(config: DisaggConfig, num_prefill_misses: int, num_decode_misses: int,
           max_gpus: int) -> DisaggConfig | None:
    total = num_prefill_misses + num_decode_misses
    num_prefill, num_decode = config.num_prefill, config.num_decode
    if total == 0:
        return None
    if num_prefill_misses >= BLAME_SHARE * total:
        num_prefill += max(1, math.ceil(GROWTH_FRACTION * num_prefill))
    if num_decode_misses >= BLAME_SHARE * total:
        num_decode += max(1, math.ceil(GROWTH_FRACTION * num_decode))
    grown = dataclasses.replace(config, num_prefill=num_prefill, num_decode=num_decode)
    return grown if grown.num_gpus <= max_gpus else None


def check_plan(demand: Demand, slo: Slo, prefill_shapes: Sequence[InstanceShape],
               decode_shapes: Sequence[InstanceShape], trace: Trace, *, max_gpus: int = 4096,
               max_replays: int = 12, time_budget_s: float = math.inf,
               clock: Callable[[], float] = time.monotonic) -> CheckedPlan:
    """Plan for ``demand`` (any pair of shapes, mixed TP included), then replay and grow the
    candidate on ``trace`` (at ``demand``'s rate, see ``at_rate``) until the replay meets
    ``slo.percentile`` (module docstring). Stops early, offering the last candidate replayed
    (``is_met`` False), after ``max_replays`` replays, when growing would exceed ``max_gpus``,
    or once ``time_budget_s`` seconds of ``clock`` have passed."""
    if max_replays < 1:
        raise InvalidArgumentError(f"max_replays must be >= 1, got {max_replays}",
                                   field="max_replays")
    started = clock()
    model = ArrivalModel.of(demand, slo)
    config = plan(demand, slo, prefill_shapes, decode_shapes, max_gpus=max_gpus).config
    steps: list[ReplayStep] = []
    is_calibrated = not trace.has_prefix_hashes
    while True:
        replay_started = time.perf_counter()
        result = replay_config(config, trace, slo)
        replayed = result.attainment()
        num_prefill_misses, num_decode_misses = blame(result)
        steps.append(ReplayStep(config.num_prefill, config.num_decode, model.attainment(config),
                                replayed, num_prefill_misses, num_decode_misses,
                                time.perf_counter() - replay_started))
        if replayed >= slo.attainment_target or len(steps) >= max_replays \
                or clock() - started >= time_budget_s:
            break
        if not is_calibrated:
            # Once: the prefix-hit rate the replay's caches reached replaces the unbounded
            # cache's, and the plan is made again with it (never smaller than this one).
            is_calibrated = True
            hit = replayed_prefix_hit_rate(result)
            if abs(hit - demand.prefix_hit_rate) > HIT_RATE_TOLERANCE:
                demand = demand_from_trace(trace, demand.rate_per_s, prefix_hit_rate=hit)
                model = ArrivalModel.of(demand, slo)
                again = plan(demand, slo, prefill_shapes, decode_shapes,
                             max_gpus=max_gpus).config
                if (again.prefill.tp_size, again.decode.tp_size) == (
                        config.prefill.tp_size, config.decode.tp_size):
                    again = dataclasses.replace(
                        again, num_prefill=max(again.num_prefill, config.num_prefill),
                        num_decode=max(again.num_decode, config.num_decode))
                config = _with_threshold(again, model)
                continue
        grown = _grown(config, num_prefill_misses, num_decode_misses, max_gpus)
        if grown is None:
            break
        config = _with_threshold(grown, model)
    return CheckedPlan(evaluate_plan(config, model), replayed, slo.attainment_target, result,
                       tuple(steps))


HIT_RATE_TOLERANCE = 0.02
"""A replayed prefix-hit rate this far from the planned one re-plans with it."""


def replayed_prefix_hit_rate(result: SimResult) -> float:
    """Share of prompt tokens the replay found in a prefix cache (completed requests)."""
    completed = result.status == RequestStatus.COMPLETED
    total = float(result.prompt_tokens[completed].sum())
    return min(0.99, float(result.cached_tokens[completed].sum()) / total) if total else 0.0


def _with_threshold(config: DisaggConfig, model: ArrivalModel) -> DisaggConfig:
    """``config`` with the threshold re-derived for its sizes, as the planner would."""
    return with_threshold(dataclasses.replace(config, local_prefill_threshold_tokens=0),
                          model.workload, model.demand.rate_per_s, model.slo)


def plan_document(result: Plan, demand: Demand, slo: Slo,
                  checked: CheckedPlan | None = None) -> dict[str, Any]:
    """The ``--json`` object: instances and TP per pool, predicted and replayed attainment."""
    config = result.config
    return {
        "model": config.prefill.model, "gpu": config.prefill.gpu,
        "rate_per_s": demand.rate_per_s,
        "arrival_model": "poisson" if demand.arrivals is None else "trace",
        "slo": {"ttft_ms": slo.ttft_s * 1000.0, "tpot_ms": slo.tpot_s * 1000.0,
                "percentile": slo.percentile},
        "prefill": {"tp": config.prefill.tp_size, "instances": config.num_prefill,
                    "gpus": config.num_prefill_gpus},
        "decode": {"tp": config.decode.tp_size, "instances": config.num_decode,
                   "gpus": config.num_decode_gpus},
        "num_gpus": config.num_gpus,
        "local_prefill_threshold_tokens": config.local_prefill_threshold_tokens,
        "predicted_attainment": result.prediction.attainment,
        "replayed_attainment": None if checked is None else checked.replayed_attainment,
        "is_met": None if checked is None else checked.is_met,
        "goodput_rate_per_s": result.goodput_rate_per_s,
        "replays": [] if checked is None else [
            {"num_prefill": s.num_prefill, "num_decode": s.num_decode,
             "predicted_attainment": s.predicted_attainment,
             "replayed_attainment": s.replayed_attainment} for s in checked.steps],
    }
