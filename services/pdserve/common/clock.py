"""Clocks, injected wherever code needs the time, so tests control time without patching globals.

Every clock is a zero-argument callable returning seconds as a float, so each one is also a
``pdserve.common.types.Clock`` (``Callable[[], float]``). Use ``SystemClock`` for times that cross
processes (lease expiries, record timestamps) and ``MonotonicClock`` for durations measured inside
one process (deadlines, backoff, latency); ``ManualClock`` stands in for either in tests.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """A source of seconds. Wall-clock or monotonic depending on the implementation."""

    def __call__(self) -> float: ...


class SystemClock:
    """Wall-clock seconds since the Unix epoch (``time.time``); jumps when NTP steps the clock."""

    __slots__ = ()

    def __call__(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "SystemClock()"


class MonotonicClock:
    """Seconds from an arbitrary origin that never go backwards (``time.monotonic``).

    Only differences are meaningful, and only inside one process.
    """

    __slots__ = ()

    def __call__(self) -> float:
        return time.monotonic()

    def __repr__(self) -> str:
        return "MonotonicClock()"


class ManualClock:
    """A clock that moves only when told to; for tests and the simulator.

    ``start_s`` is the first reading. Time never goes backwards: ``advance`` refuses negative steps
    and ``set`` refuses earlier times, since the code under test may assume monotonic time.
    """

    __slots__ = ("_now_s",)

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def __call__(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0); returns the new reading."""
        if seconds < 0:
            raise ValueError(f"ManualClock cannot go backwards (advance by {seconds})")
        self._now_s += seconds
        return self._now_s

    def set(self, now_s: float) -> None:
        """Jump to ``now_s``, which must not be earlier than the current reading."""
        if now_s < self._now_s:
            raise ValueError(f"ManualClock cannot go backwards ({now_s} < {self._now_s})")
        self._now_s = float(now_s)

    def __repr__(self) -> str:
        return f"ManualClock({self._now_s!r})"
