"""Prometheus metrics of the KV-transfer coordinator."""

from __future__ import annotations

from pdserve.common.metrics import counter, histogram
from pdserve.common.types import Ticket

TICKETS = counter("transfer", "ended", "tickets", "Tickets that reached a terminal state.",
                  ["deployment", "outcome"])
BYTES = counter("transfer", "moved", "bytes", "KV bytes moved by finished transfers.",
                ["deployment"])
TRANSFER_SECONDS = histogram("transfer", "duration", "seconds",
                             "First layer moving to last layer landed.", ["deployment"])
EXPOSED_SECONDS = histogram("transfer", "exposed", "seconds",
                            "Transfer time after prefill ended (what the request saw).",
                            ["deployment"])


def observe_ticket(ticket: Ticket) -> None:
    if ticket.state.is_terminal:
        TICKETS.labels(ticket.deployment, str(ticket.state)).inc()


def observe_transfer(deployment: str, num_bytes: int, transfer_s: float, exposed_s: float) -> None:
    BYTES.labels(deployment).inc(num_bytes)
    TRANSFER_SECONDS.labels(deployment).observe(transfer_s)
    EXPOSED_SECONDS.labels(deployment).observe(exposed_s)
