"""Helpers shared by tests: a clock the test moves by hand, and a private redis-server."""

from __future__ import annotations


class StepClock:
    """Seconds that move only when the test says so (an injected ``Clock``)."""

    def __init__(self, start_s: float = 1_000_000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> float:
        assert seconds >= 0, "time never goes backwards"
        self.now_s += seconds
        return self.now_s
