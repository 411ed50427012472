"""What the autoscaler expects: the arrival rate over the next lead time (``lead_s =
cold_start_s + interval_s``) and the headroom its forecast error calls for.

1. **Forecast.** Holt's linear trend (double exponential smoothing, with a damped trend after
   Gardner & McKenzie 1985) on the per-interval arrival rates: ``level`` follows the rate,
   ``trend`` its change per interval; the forecast ``h`` intervals ahead is ``level + (phi + ... +
   phi^h) x trend``. The policy sizes for the highest forecast on the path from now to the lead
   (a falling forecast keeps today's level). Holt's trend is smoothed to stay quiet on noise, so
   it learns a steep ramp slowly; a **surge test** covers that case: a least-squares slope over
   the last ``surge_window`` rates whose t statistic against the one-interval noise reaches
   ``surge_t_stat`` is projected over the lead (``surge_horizon_s``), and the larger forecast
   wins. No daily (seasonal) term: learning one takes at least a day of history per deployment,
   and over a 10-minute lead the daily envelope is a near-linear ramp (a 10:1 sine day changes
   by under 4% in 10 minutes), which the trend term follows.
2. **Headroom** from forecast error: the ``headroom_quantile`` of the absolute errors of the
   forecasts this policy made one lead time earlier, scored against the smoothed level when
   their target interval arrives (the sampling noise of one short interval is not forecast
   error; bunching within an interval is what the target utilisation is for), over the last
   ``error_window`` intervals. Until enough of those exist, the same quantile of one-interval
   errors times ``sqrt(lead in intervals)`` (the random-walk growth of error with horizon);
   before any error is known, ``initial_headroom_fraction`` of the forecast. Never less than
   ``min_headroom_fraction`` of the forecast: a burst that nothing forecasts has to be met by
   what already runs until new instances are ready, a lead time later (``bench/autoscale.py``
   measures the trade-off this floor makes).

``DemandForecaster`` keeps this state between decisions (learned from each
``ScalingObservation``, on the caller's clock only); ``HoltForecaster`` is the smoothing itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.capacity.controls import AutoscalerConfig
from pdserve.capacity.scaling import ScalingObservation

_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Forecast:
    """What the forecaster says at a decision: the path maximum over the lead, its headroom,
    and where the headroom came from (``lead`` errors, ``step`` errors x sqrt(lead), or
    ``initial``)."""

    rate_per_s: float
    level_per_s: float
    trend_per_s_per_interval: float
    lead_rate_per_s: float
    headroom_per_s: float
    headroom_source: str
    lead_s: float
    lead_intervals: int
    num_lead_errors: int


class HoltForecaster:
    """Holt's linear trend with a damped trend, in error-correction form, on values observed
    once per interval. ``forecast(h)`` is the value expected ``h`` intervals after the last one
    observed; never negative (rates)."""

    def __init__(self, alpha: float, beta: float, damping: float) -> None:
        self.alpha = alpha
        self.beta = beta
        self.damping = damping
        self.level: float | None = None
        self.trend = 0.0
        self.num_observed = 0

    def update(self, value: float) -> float | None:
        """Observe the next interval's value; returns the one-interval error (None at first)."""
        self.num_observed += 1
        if self.level is None:
            self.level = value
            return None
        expected = self.level + self.damping * self.trend
        error = value - expected
        self.level = expected + self.alpha * error
        self.trend = self.damping * self.trend + self.alpha * self.beta * error
        return error

    def forecast(self, num_intervals: int) -> float:
        if self.level is None:
            return 0.0
        phi = self.damping
        weight = (num_intervals if phi == 1.0
                  else phi * (1.0 - phi ** num_intervals) / (1.0 - phi))
        return max(0.0, self.level + weight * self.trend)

    def path_max(self, num_intervals: int) -> float:
        """Highest forecast from now (``h = 0``) to ``num_intervals`` ahead: the damped trend
        is monotone, so one end or the other."""
        return max(self.forecast(0), self.forecast(num_intervals))


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between order statistics."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


class DemandForecaster:
    """The autoscaler's view of demand over time: the smoothed arrival rate, the errors of its
    own past forecasts (for headroom), the last few rates (for the surge test) and the latest
    mean request lengths. ``observe`` then ``forecast`` once per decision."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self._forecaster = HoltForecaster(config.alpha, config.beta, config.damping)
        self._step_errors: deque[float] = deque(maxlen=config.error_window)
        self._lead_errors: deque[float] = deque(maxlen=config.error_window)
        self._pending: deque[tuple[int, float]] = deque()  # (target interval index, forecast)
        self._recent: deque[float] = deque(maxlen=max(2, config.surge_window))
        self._last_now_s: float | None = None
        self.mean_prompt_tokens = 0.0
        """Mean prompt length of the latest requests (0 before any; see ``_learn_lengths``)."""
        self.mean_output_tokens = 0.0
        """Mean output length of the latest requests (0 before any)."""
        self.mean_squared_prompt_tokens = 0.0
        """Their mean squared prompt length (0 before any, or when not observed)."""
        self.mean_cubed_prompt_tokens = 0.0
        self.mean_squared_output_tokens = 0.0
        self.mean_prompt_output_tokens = 0.0
        """Their other moments (0 before any, or when not observed)."""

    def observe(self, observation: ScalingObservation) -> None:
        """Learn the intervals ``observation`` adds to what was seen (none if it repeats the
        last one) and its lengths' moments."""
        rates = observation.arrival_rates_per_s
        if self._last_now_s is None:
            new = rates
        elif observation.now_s <= self._last_now_s:
            new = ()  # the same interval again: nothing new to learn
        else:
            elapsed = (observation.now_s - self._last_now_s) / observation.interval_s
            new = rates[-max(1, min(len(rates), round(elapsed))):] if rates else ()
        for rate in new:
            self._learn(max(0.0, float(rate)))
        is_new = self._last_now_s is None or observation.now_s > self._last_now_s
        if is_new:
            self._last_now_s = observation.now_s
            num_requests = sum(max(0.0, float(rate)) for rate in new) * observation.interval_s
            self._learn_lengths(observation, num_requests)

    def _learn_lengths(self, observation: ScalingObservation, num_requests: float) -> None:
        """Blend the observation's moments (those of ``num_requests`` new requests) into the
        running ones, weighted by requests: ``num / (num + length_memory_requests)``, so the
        moments are those of about the last ``length_memory_requests`` requests whatever the
        rate (the first observation, or a memory of 0, takes them as they are). One interval's
        moments are noisy where prompts have a long tail: on the Mooncake conversation trace
        the decode need from 60 requests' moments has a 27% standard deviation, from 2,000
        requests' 4% (resampled; Llama-3.1-70B at TP4 on H100). A moment the observation does
        not know (0) is unknown from then on."""
        memory = self.config.length_memory_requests

        def blend(current: float, observed: float, weight: float) -> float:
            if observed <= 0:
                return 0.0
            return observed if current <= 0 else current + weight * (observed - current)

        if observation.mean_prompt_tokens > 0:
            weight = (1.0 if self.mean_prompt_tokens <= 0 or memory <= 0
                      else num_requests / (num_requests + memory))
            self.mean_prompt_tokens = blend(self.mean_prompt_tokens,
                                            observation.mean_prompt_tokens, weight)
            self.mean_squared_prompt_tokens = blend(
                self.mean_squared_prompt_tokens, observation.mean_squared_prompt_tokens, weight)
            self.mean_cubed_prompt_tokens = blend(
                self.mean_cubed_prompt_tokens, observation.mean_cubed_prompt_tokens, weight)
        if observation.mean_output_tokens > 0:
            weight = (1.0 if self.mean_output_tokens <= 0 or memory <= 0
                      else num_requests / (num_requests + memory))
            self.mean_output_tokens = blend(self.mean_output_tokens,
                                            observation.mean_output_tokens, weight)
            self.mean_squared_output_tokens = blend(
                self.mean_squared_output_tokens, observation.mean_squared_output_tokens, weight)
            self.mean_prompt_output_tokens = blend(
                self.mean_prompt_output_tokens, observation.mean_prompt_output_tokens, weight)

    def _learn(self, rate: float) -> None:
        self._recent.append(rate)
        error = self._forecaster.update(rate)
        if error is not None:
            self._step_errors.append(error)
        index = self._forecaster.num_observed
        while self._pending and self._pending[0][0] <= index:
            target_index, predicted = self._pending.popleft()
            if target_index == index:
                # Scored against the smoothed level, not the raw count of one interval: the
                # sampling noise of a short interval is not forecast error, and the target
                # utilisation already covers arrivals bunching within an interval.
                self._lead_errors.append(self._forecaster.forecast(0) - predicted)

    def forecast(self, observation: ScalingObservation) -> Forecast:
        """The rate to size for over the lead ``observation`` implies, with its headroom (the
        module docstring); records the lead forecast to score it when its interval comes."""
        config = self.config
        lead_s = observation.cold_start_s + observation.interval_s
        lead = max(1, math.ceil(lead_s / observation.interval_s - 1e-9))
        forecaster = self._forecaster
        lead_rate = forecaster.forecast(lead)
        index = forecaster.num_observed
        if forecaster.level is not None and (
                not self._pending or self._pending[-1][0] < index + lead):
            self._pending.append((index + lead, lead_rate))
        rate = forecaster.path_max(lead)
        surge_slope, surge_t = self._surge()
        if surge_t >= config.surge_t_stat:
            horizon = lead if config.surge_horizon_s is None else min(
                lead, config.surge_horizon_s / observation.interval_s)
            rate = max(rate, self._recent[-1] + surge_slope * horizon)
        if len(self._lead_errors) >= config.min_lead_errors:
            error = _quantile([abs(e) for e in self._lead_errors], config.headroom_quantile)
            source = "lead"
        elif len(self._step_errors) >= 3:
            error = (_quantile([abs(e) for e in self._step_errors], config.headroom_quantile)
                     * math.sqrt(lead))
            source = "step"
        else:
            error = config.initial_headroom_fraction * rate
            source = "initial"
        headroom = max(error, config.min_headroom_fraction * rate)
        return Forecast(
            rate_per_s=rate, level_per_s=forecaster.forecast(0),
            trend_per_s_per_interval=forecaster.trend, lead_rate_per_s=lead_rate,
            headroom_per_s=headroom, headroom_source=source, lead_s=lead_s,
            lead_intervals=lead, num_lead_errors=len(self._lead_errors),
        )

    def _surge(self) -> tuple[float, float]:
        """Slope (per interval) of a least-squares line through the last ``surge_window``
        rates and its t statistic against the one-interval noise (``_step_noise``). (0, 0)
        while either is unknown."""
        num = len(self._recent)
        window = self.config.surge_window
        if not window or num < window or len(self._step_errors) < 5:
            return 0.0, 0.0
        mean_x = (num - 1) / 2.0
        mean_y = sum(self._recent) / num
        sxx = sum((x - mean_x) ** 2 for x in range(num))
        slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(self._recent)) / sxx
        sigma = self._step_noise()
        if sigma <= _EPSILON:
            return slope, math.inf if slope > 0 else 0.0
        return slope, slope / (sigma / math.sqrt(sxx))

    def noise_fraction(self) -> float:
        """The one-interval noise of the rate (``_step_noise``) relative to its level, 0 while
        unknown."""
        level = self._forecaster.forecast(0)
        if len(self._step_errors) < 5 or level <= _EPSILON:
            return 0.0
        return self._step_noise() / level

    def _step_noise(self) -> float:
        """The rate's one-interval noise: 1.4826 x the median absolute one-interval error (the
        standard deviation of a normal law with that median deviation; robust to bursts)."""
        return 1.4826 * _quantile([abs(e) for e in self._step_errors], 0.5)
