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
