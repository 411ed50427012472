"""The interface between the autoscaler (a pure policy) and whatever runs it: the governor's live
loop, or the discrete-event simulator. Both hand it the same observation and act on the same
decision, which is how a plan checked in simulation is the plan that runs.

Time is seconds on the caller's clock (simulated seconds in the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PoolObservation:
    """One pool (prefill or decode) of one deployment, as seen at ``now_s``."""

    num_ready: int
    """Instances serving."""
    num_starting: int
    """Instances launched and still loading (they serve after their cold start)."""
    num_draining: int
    """Instances finishing their work before they leave."""
    utilization: float
    """Busy fraction over the last interval: prefill = compute busy time; decode = KV blocks in
    use / total (the binding resource), in [0, 1]."""
    num_queued_tokens: int = 0
    """Prefill: prompt tokens waiting; decode: tokens of sequences waiting for KV room."""


@dataclass(frozen=True, slots=True)
class ScalingObservation:
    """Everything the autoscaler may look at. ``arrival_rates_per_s`` are the mean arrival
    rates of the last ``len(...)`` intervals of ``interval_s`` each, oldest first."""

    now_s: float
    deployment: str
    interval_s: float
    arrival_rates_per_s: tuple[float, ...]
    mean_prompt_tokens: float
    mean_output_tokens: float
    prefill: PoolObservation
    decode: PoolObservation
    cold_start_s: float
    """Time from launching an instance to it serving (the look-ahead the policy needs)."""
    slo_attainment: float = 1.0
    """Fraction of requests finished in the last interval that met both SLOs."""
    mean_squared_prompt_tokens: float = 0.0
    """Mean of the squared prompt lengths over the same requests as ``mean_prompt_tokens`` (0:
    unknown; sizing then assumes no spread)."""
    mean_cubed_prompt_tokens: float = 0.0
    """Mean of the cubed prompt lengths, the same requests (0: unknown; the least spread the
    first two moments allow)."""
    mean_squared_output_tokens: float = 0.0
    """Mean of the squared output lengths, the same requests (0: unknown; no spread)."""
    mean_prompt_output_tokens: float = 0.0
    """Mean of prompt x output length, the same requests (0: unknown; independent)."""


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """Target instance counts per pool (including instances already starting), and why.

    ``inputs`` holds the figures the decision used (forecast, headroom, ...) as plain JSON-able
    values; the governor stores them with the decision in Postgres.
    """

    num_prefill: int
    num_decode: int
    reason: str = ""
    inputs: dict[str, float | int | str] = field(default_factory=dict)


class ScalingPolicy(Protocol):
    """A synchronous policy: observation in, decision out; no I/O. It may keep state (forecast
    history) between calls, but no clock other than ``observation.now_s``."""

    def decide(self, observation: ScalingObservation) -> ScalingDecision: ...
