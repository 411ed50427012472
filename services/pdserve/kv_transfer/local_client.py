"""The coordinator as the router's ``TicketClient`` inside one process (``pdserve up`` and tests):
the router depends only on the protocol, and whoever assembles the process wires this in."""

from __future__ import annotations

from pdserve.common.types import FencingToken, Ticket, TicketSpec
from pdserve.kv_transfer.coordinator import KvTransferCoordinator


class LocalTicketClient:
    """The coordinator in the same process (``pdserve up``)."""

    def __init__(self, coordinator: KvTransferCoordinator) -> None:
        self._coordinator = coordinator

    async def open(self, spec: TicketSpec, timeout_s: float) -> FencingToken:
        ticket: Ticket = await self._coordinator.open_ticket(spec)
        return ticket.token

    async def abort(self, token: FencingToken, reason: str, timeout_s: float) -> None:
        await self._coordinator.abort(token, reason)
