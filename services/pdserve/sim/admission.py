"""Admission at the simulated router: a request that no decode instance has room for waits in a
FIFO queue (at most ``max_queued_requests``; beyond it, rejected: RESOURCE_EXHAUSTED; 0 rejects
at once, as the live router does today). The simulator retries the head whenever KV blocks are
freed or an instance becomes ready; requests whose attempt a failure ended go back in front,
oldest first."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from pdserve.sim.state import SimRequest

RouteFn = Callable[[SimRequest], bool]
"""Route and dispatch a request now; False if no decode instance has room for it."""


class AdmissionQueue:
    """The router's queue of requests waiting for decode KV room, over ``route``."""

    __slots__ = ("_max_queued", "_route", "waiting")

    def __init__(self, max_queued_requests: int, route: RouteFn) -> None:
        self._max_queued = max_queued_requests
        self._route = route
        self.waiting: deque[SimRequest] = deque()

    def __len__(self) -> int:
        return len(self.waiting)

    def admit(self, req: SimRequest) -> bool:
        """A new request: routed now if nothing waits and there is room, else queued behind the
        others; False if it is rejected (the queue is full)."""
        waiting = self.waiting
        if waiting:
            if len(waiting) >= self._max_queued:
                return False
            waiting.append(req)
            return True
        if self._route(req):
            return True
        if self._max_queued == 0:
            return False
        waiting.append(req)
        return True

    def drain(self) -> None:
        """Route waiting requests, first come first served, until one does not fit."""
        waiting = self.waiting
        while waiting and self._route(waiting[0]):
            waiting.popleft()

    def retry_first(self, requests: Iterable[SimRequest]) -> None:
        """Put ``requests`` (oldest first) at the head of the queue, in that order."""
        for req in reversed(list(requests)):
            self.waiting.appendleft(req)

    def take_all(self) -> list[SimRequest]:
        """Empty the queue (no decode instance will ever have room), oldest first."""
        taken = list(self.waiting)
        self.waiting.clear()
        return taken

    def queued_prompt_tokens(self) -> int:
        return sum(req.prompt for req in self.waiting)
