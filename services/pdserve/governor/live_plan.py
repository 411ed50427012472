"""The governor's planning on what it observes, checked by replay: the recent window of requests
(the transfer tickets the routers opened, as ``autoscaling`` counts them) becomes a trace, and
the planner sizes and replays it exactly as ``pdserve plan --trace`` does
(``pdserve.sim.plan_check``): the window's own arrival times (its bursts), its prompt lengths,
and the mean output length the governor estimates (the store does not hold output lengths;
``autoscaling.estimate_mean_output_tokens``).

Instances that run ``speedup`` simulated seconds per wall second (sim workers) are planned in
their own time: the window's gaps and the SLO bounds multiplied by ``speedup``.

Pure functions of the tickets and the window; the caller runs ``plan_observed_window`` off the
event loop (it simulates for seconds). ``plan_record`` is what the governor keeps of a plan
(``CapacityPlanRecord``: the plan's ``plan_document`` as its outputs, the window as its inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from pdserve.capacity.plan_inputs import Demand, InstanceShape, Slo
from pdserve.common.types import Ticket
from pdserve.db.records import CapacityPlanRecord
from pdserve.sim.plan_check import CheckedPlan, check_plan, demand_from_trace, plan_document
from pdserve.sim.traces import Trace, time_scale

SOURCE = "observed_window"
"""``outputs["source"]`` of the plans the governor makes from its observed window."""

MIN_REQUESTS = 50
"""Fewer requests than this in the window: too few to plan from (None)."""


def observed_trace(tickets: Sequence[Ticket], deployment: str, start_s: float, end_s: float,
                   mean_output_tokens: float) -> Trace | None:
    """The requests of ``deployment`` first seen in ``(start_s, end_s]`` (one per request id: a
    retry's ticket is not a new request) as a trace: arrival at their first ticket, times from
    the window's first arrival; prompt lengths from the tickets; every output
    ``mean_output_tokens`` long. None with fewer than ``MIN_REQUESTS``."""
    first_s: dict[str, float] = {}
    prompt_tokens: dict[str, int] = {}
    for ticket in tickets:
        if ticket.deployment != deployment or not start_s < ticket.created_s <= end_s:
            continue
        request_id = ticket.request_id or str(ticket.token)
        if request_id not in first_s or ticket.created_s < first_s[request_id]:
            first_s[request_id] = ticket.created_s
            prompt_tokens[request_id] = ticket.num_prompt_tokens
    if len(first_s) < MIN_REQUESTS:
        return None
    order = sorted(first_s, key=lambda rid: (first_s[rid], rid))
    arrival_s = np.array([first_s[rid] for rid in order])
    prompts = np.array([max(1, prompt_tokens[rid]) for rid in order], dtype=np.int64)
    outputs = np.full(len(order), max(1, math.ceil(mean_output_tokens)), dtype=np.int64)
    return Trace(arrival_s - arrival_s[0], prompts, outputs, name=f"{deployment} window")


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """A plan for an observed window: the checked plan, the window's trace, its demand and the
    SLO it was planned against (all in the instances' time)."""

    checked: CheckedPlan
    trace: Trace
    demand: Demand
    slo: Slo
    speedup: float


def plan_observed_window(tickets: Sequence[Ticket], deployment: str, start_s: float,
                         end_s: float, *, mean_output_tokens: float, slo: Slo,
                         shapes: Sequence[InstanceShape], speedup: float = 1.0,
                         max_replays: int = 8, time_budget_s: float = 30.0
                         ) -> WindowPlan | None:
    """The plan for the window's demand, replayed on the window and grown until the replay
    meets ``slo.percentile`` (``check_plan``); None when the window holds too few requests or
    they do not span a positive time. ``slo`` is in wall-clock seconds."""
    trace = observed_trace(tickets, deployment, start_s, end_s, mean_output_tokens)
    if trace is None or trace.mean_rate_per_s <= 0:
        return None
    if speedup != 1.0:
        trace = time_scale(trace, speedup)
        slo = Slo(slo.ttft_s * speedup, slo.tpot_s * speedup, slo.percentile)
    demand = demand_from_trace(trace)
    checked = check_plan(demand, slo, shapes, shapes, trace, max_replays=max_replays,
                         time_budget_s=time_budget_s)
    return WindowPlan(checked, trace, demand, slo, speedup)


def plan_record(deployment: str, window: WindowPlan, start_s: float, end_s: float,
                at_s: float) -> CapacityPlanRecord:
    """The durable record of a window's plan: the plan document (instances and TP per pool,
    predicted and replayed attainment, every replay) as outputs; the window, its demand and
    the SLO as inputs; rates, SLO bounds and predicted TTFT and TPOT in wall-clock units."""
    checked, trace, speedup = window.checked, window.trace, window.speedup
    plan = checked.plan
    prompts = trace.prompt_tokens
    inputs = {
        "window_start_unix_s": start_s, "window_end_unix_s": end_s,
        "num_requests": int(trace.num_requests),
        "arrival_rate_per_s": trace.mean_rate_per_s * speedup,
        "prompt_tokens_mean": float(prompts.mean()),
        "prompt_tokens_p50": float(np.percentile(prompts, 50)),
        "prompt_tokens_p99": float(np.percentile(prompts, 99)),
        "mean_output_tokens": float(trace.output_tokens.mean()),
        "slo_ttft_ms": window.slo.ttft_s / speedup * 1000.0,
        "slo_tpot_ms": window.slo.tpot_s / speedup * 1000.0,
        "slo_percentile": window.slo.percentile, "speedup": speedup,
    }
    outputs = {**plan_document(plan, window.demand, window.slo, checked), "source": SOURCE,
               "rate_per_s": window.demand.rate_per_s * speedup,
               "goodput_rate_per_s": plan.goodput_rate_per_s * speedup,
               "slo": {"ttft_ms": inputs["slo_ttft_ms"], "tpot_ms": inputs["slo_tpot_ms"],
                       "percentile": window.slo.percentile}}
    return CapacityPlanRecord(
        deployment=deployment, num_prefill_instances=plan.config.num_prefill,
        num_decode_instances=plan.config.num_decode,
        predicted_ttft_ms=_finite_ms(plan.prediction.ttft_s / speedup),
        predicted_tpot_ms=_finite_ms(plan.prediction.tpot_s / speedup),
        local_prefill_threshold_tokens=plan.config.local_prefill_threshold_tokens,
        inputs=inputs, outputs=outputs, created_at=datetime.fromtimestamp(at_s, UTC))


def _finite_ms(seconds: float) -> float:
    """Milliseconds for a record; 0 where the model found a pool unable to keep up (``inf``:
    the record's ``outputs`` still hold the predicted attainment)."""
    return seconds * 1000.0 if math.isfinite(seconds) else 0.0
