"""What a scaling policy sees of the simulated cluster: per scaling interval the arrivals (rate,
the lengths' moments), the requests that ended and how many met both SLOs, turned into the same
``ScalingObservation`` the governor's live loop builds."""

from __future__ import annotations

from pdserve.capacity.scaling import PoolObservation, ScalingObservation
from pdserve.sim.config import SimConfig
from pdserve.sim.state import SimRequest
from pdserve.sim.usage import Usage


class ScalingWindow:
    """Counters of the current scaling interval and the arrival-rate history
    (``config.scaling_history`` intervals)."""

    __slots__ = ("_config", "_last_means", "_rates", "_tpot_limit_s", "_ttft_limit_s",
                 "num_arrivals", "num_done", "num_met", "output_tokens", "output_tokens_squared",
                 "prompt_output_tokens", "prompt_tokens", "prompt_tokens_cubed",
                 "prompt_tokens_squared")

    def __init__(self, config: SimConfig) -> None:
        self._config = config
        self._ttft_limit_s = config.slo.ttft_ms / 1000.0
        self._tpot_limit_s = config.slo.tpot_ms / 1000.0
        self._rates: list[float] = []
        # prompt, output, prompt^2, prompt^3, output^2, prompt x output
        self._last_means = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self.num_arrivals = 0
        self.prompt_tokens = self.prompt_tokens_squared = self.prompt_tokens_cubed = 0
        self.output_tokens = self.output_tokens_squared = self.prompt_output_tokens = 0
        self.num_done = 0
        self.num_met = 0

    def arrived(self, req: SimRequest) -> None:
        prompt, output = req.prompt, req.output
        squared = prompt * prompt
        self.num_arrivals += 1
        self.prompt_tokens += prompt
        self.prompt_tokens_squared += squared
        self.prompt_tokens_cubed += squared * prompt
        self.output_tokens += output
        self.output_tokens_squared += output * output
        self.prompt_output_tokens += prompt * output

    def completed(self, ttft_s: float, tpot_s: float) -> None:
        self.num_done += 1
        if ttft_s <= self._ttft_limit_s and tpot_s <= self._tpot_limit_s:
            self.num_met += 1

    def unserved(self) -> None:
        """A request ended without completing: it missed both SLOs."""
        self.num_done += 1

    def observe(self, now: float, counts: tuple[int, ...], usage: Usage,
                queued: tuple[int, int]) -> ScalingObservation:
        """The observation at the end of the interval (``counts``: ready, starting and draining
        instances of each pool, prefill first; ``queued``: prompt tokens queued at the prefill
        instances and at the router), then a new interval starts (``usage``'s too; it must be
        integrated up to ``now``)."""
        config = self._config
        interval = config.scaling_interval_s
        rates = self._rates
        rates.append(self.num_arrivals / interval)
        if len(rates) > config.scaling_history:
            del rates[: len(rates) - config.scaling_history]
        if self.num_arrivals:
            n = self.num_arrivals
            self._last_means = (self.prompt_tokens / n, self.output_tokens / n,
                                self.prompt_tokens_squared / n, self.prompt_tokens_cubed / n,
                                self.output_tokens_squared / n, self.prompt_output_tokens / n)
        observation = ScalingObservation(
            now_s=now, deployment=config.deployment, interval_s=interval,
            arrival_rates_per_s=tuple(rates),
            mean_prompt_tokens=self._last_means[0], mean_output_tokens=self._last_means[1],
            prefill=PoolObservation(
                num_ready=counts[0], num_starting=counts[1], num_draining=counts[2],
                utilization=usage.prefill_utilization(), num_queued_tokens=queued[0]),
            decode=PoolObservation(
                num_ready=counts[3], num_starting=counts[4], num_draining=counts[5],
                utilization=usage.decode_utilization(), num_queued_tokens=queued[1]),
            cold_start_s=config.cold_start_s,
            slo_attainment=self.num_met / self.num_done if self.num_done else 1.0,
            mean_squared_prompt_tokens=self._last_means[2],
            mean_cubed_prompt_tokens=self._last_means[3],
            mean_squared_output_tokens=self._last_means[4],
            mean_prompt_output_tokens=self._last_means[5],
        )
        self.num_arrivals = 0
        self.prompt_tokens = self.prompt_tokens_squared = self.prompt_tokens_cubed = 0
        self.output_tokens = self.output_tokens_squared = self.prompt_output_tokens = 0
        self.num_done = self.num_met = 0
        usage.reset_window()
        return observation
