"""Router metrics that dashboards and alerts read beside the outcome histograms of
``router.outcomes``: SLO misses by where the time went, and admission refusals by tenant."""

from __future__ import annotations

from pdserve.common.metrics import counter

SLO_MISSES = counter(
    "router", "slo_missed", "requests",
    "Finished requests that missed the TTFT or TPOT SLO, by reason (queueing, transfer, "
    "compute: where the time went).", ["model", "reason"])
REFUSALS = counter(
    "router", "refused", "requests",
    "Requests admission refused before any work, by tenant and reason (router_full, "
    "tenant_full, queue_full, slo, fair_share).", ["model", "tenant", "reason"])
FAILOVERS = counter(
    "router", "failovers", "requests",
    "Mid-stream failovers (a decode stream broke after its first token), by outcome: resumed "
    "(the next token came from another decode worker), max_failovers, max_time, no_worker "
    "(the client got UNAVAILABLE) or cancelled (the client left meanwhile).",
    ["model", "outcome"])
CLIENT_RESUMES = counter(
    "router", "client_resumed", "requests",
    "Requests a client resumed here with the tokens it already had (resume_token_ids: its "
    "router replica died mid-stream).", ["model"])
