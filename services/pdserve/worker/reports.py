"""What a worker tells the coordinator about its tickets, and how: off the token path, in order.

``ControlPlane`` is the coordinator as an agent sees it (``worker.control.GrpcControlPlane`` over
gRPC, ``NullControlPlane`` for a worker on its own). ``TicketReports`` runs those calls in the
background, one ticket's calls in the order they were made (a DONE before its release), so a
slow or failing coordinator never holds a token back; a failed call is logged and dropped (the
coordinator learns the same through leases and heartbeats).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable
from typing import Protocol

from pdserve.common.types import FencingToken, TicketState
from pdserve.worker.runtime import TransferTiming

logger = logging.getLogger(__name__)


class ControlPlane(Protocol):
    """What the agent tells the coordinator. Calls are best effort and off the token path."""

    async def report(self, token: FencingToken, state: TicketState,
                     timing: TransferTiming | None) -> None: ...

    async def renew(self, token: FencingToken, lease_s: float) -> None: ...

    async def release(self, token: FencingToken) -> None: ...


class NullControlPlane:
    """A coordinator that is not there (a worker driven directly, as in tests and benches)."""

    async def report(self, token: FencingToken, state: TicketState,
                     timing: TransferTiming | None) -> None:
        return None

    async def renew(self, token: FencingToken, lease_s: float) -> None:
        return None

    async def release(self, token: FencingToken) -> None:
        return None


class TicketReports:
    """Control-plane calls of many tickets, each ticket's in order, none awaited by the caller."""

    def __init__(self) -> None:
        self._chains: dict[FencingToken, asyncio.Future[None]] = {}
        self._pending: dict[asyncio.Future[None], Awaitable[None]] = {}

    def send(self, token: FencingToken, call: Awaitable[None]) -> None:
        """Run ``call`` after every call sent for ``token`` before it has ended."""
        previous = self._chains.get(token)

        async def chained() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                await call
            except Exception as exc:  # noqa: BLE001 - best effort by design
                logger.debug("control-plane call for %s failed: %s", token, exc)

        future = asyncio.ensure_future(chained())
        self._chains[token] = future
        self._pending[future] = call

        def done(finished: asyncio.Future[None]) -> None:
            self._pending.pop(finished, None)
            if self._chains.get(token) is finished:
                del self._chains[token]

        future.add_done_callback(done)

    async def close(self) -> None:
        """Cancel every call not yet made (the worker is going away)."""
        pending = list(self._pending.items())
        for future, _ in pending:
            future.cancel()
        await asyncio.gather(*(future for future, _ in pending), return_exceptions=True)
        for _, call in pending:  # a call cancelled before it started is closed, not leaked
            if inspect.iscoroutine(call):
                call.close()
