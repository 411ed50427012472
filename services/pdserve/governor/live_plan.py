"""The governor's planning on what it observes, checked by replay: the recent window of requests
(the transfer tickets the routers opened, as ``autoscaling`` counts them) becomes a trace, and
the planner sizes and replays it exactly as ``pdserve plan --trace`` does
(``pdserve.sim.plan_check``): the window's own arrival times (its bursts), its prompt lengths,
and the mean output length the governor estimates (the store does not hold output lengths;
``autoscaling.estimate_mean_output_tokens``).

Pure functions of the tickets and the window; the caller runs ``plan_observed_window`` off the
event loop (it simulates for seconds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pdserve.capacity.plan_inputs import InstanceShape, Slo
from pdserve.common.types import Ticket
from pdserve.sim.plan_check import CheckedPlan, check_plan, demand_from_trace
from pdserve.sim.traces import Trace

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


def plan_observed_window(tickets: Sequence[Ticket], deployment: str, start_s: float,
                         end_s: float, *, mean_output_tokens: float, slo: Slo,
                         shapes: Sequence[InstanceShape], max_replays: int = 8,
                         time_budget_s: float = 30.0) -> CheckedPlan | None:
    """The plan for the window's demand, replayed on the window and grown until the replay
    meets ``slo.percentile`` (``check_plan``); None when the window holds too few requests or
    they do not span a positive time."""
    trace = observed_trace(tickets, deployment, start_s, end_s, mean_output_tokens)
    if trace is None or trace.mean_rate_per_s <= 0:
        return None
    return check_plan(demand_from_trace(trace), slo, shapes, shapes, trace,
                      max_replays=max_replays, time_budget_s=time_budget_s)
