"""Time integrals of what the simulated cluster holds, for GPU-hours, utilisation figures and
the scaling policy's observation.

Two sets: the current scaling interval's (``*_int``, ``prefill_busy_s``; cleared by
``reset_window``) and the whole run's (``*_total_*``, ``gpu_s``). The lifecycle counts
(instances alive, serving KV blocks, ready prefill instances) change only when an instance
launches, becomes ready, drains, leaves or fails, so they are integrated then (``advance``);
the KV blocks in use change with every request (``change_used``).
"""

from __future__ import annotations


class Usage:
    """Counts and their integrals over simulated seconds (block-seconds, instance-seconds)."""

    __slots__ = (
        "gpu_s",
        "last_t",
        "num_alive",
        "num_gpus_alive",
        "num_prefill_ready",
        "prefill_busy_s",
        "prefill_busy_total_s",
        "prefill_ready_int",
        "prefill_ready_total_int",
        "serving_blocks",
        "serving_int",
        "serving_total_int",
        "used_blocks",
        "used_int",
        "used_t",
        "used_total_int",
    )

    def __init__(self) -> None:
        self.last_t = 0.0
        self.num_alive = 0
        """Instances launched and not gone (GPU-hours count from launch: cold starts cost)."""
        self.num_gpus_alive = 0
        """Their GPUs (prefill and decode instances may differ in TP)."""
        self.gpu_s = 0.0
        """GPU-seconds alive."""
        self.used_blocks = 0
        """Decode KV blocks reserved or held, over all decode instances."""
        self.used_t = 0.0
        self.used_int = 0.0
        self.used_total_int = 0.0
        self.serving_blocks = 0
        """KV blocks of the decode instances that serve (ready or draining)."""
        self.serving_int = 0.0
        self.serving_total_int = 0.0
        self.num_prefill_ready = 0
        self.prefill_ready_int = 0.0
        self.prefill_ready_total_int = 0.0
        self.prefill_busy_s = 0.0
        """Seconds of prefill batches started this interval, over all prefill instances."""
        self.prefill_busy_total_s = 0.0

    def change_used(self, now: float, num_blocks: int) -> None:
        """Reserve (> 0) or release (< 0) decode blocks at ``now``."""
        dt = now - self.used_t
        if dt > 0:
            used_s = self.used_blocks * dt
            self.used_int += used_s
            self.used_total_int += used_s
            self.used_t = now
        self.used_blocks += num_blocks

    def add_prefill_busy(self, duration_s: float) -> None:
        self.prefill_busy_s += duration_s
        self.prefill_busy_total_s += duration_s

    def advance(self, now: float) -> None:
        """Integrate every count up to ``now`` (call before a lifecycle count changes)."""
        self.change_used(now, 0)
        dt = now - self.last_t
        if dt > 0:
            self.gpu_s += self.num_gpus_alive * dt
            self.serving_int += self.serving_blocks * dt
            self.prefill_ready_int += self.num_prefill_ready * dt
            self.serving_total_int += self.serving_blocks * dt
            self.prefill_ready_total_int += self.num_prefill_ready * dt
            self.last_t = now

    def prefill_utilization(self) -> float:
        """Busy fraction of the ready prefill instances over the interval, in [0, 1]."""
        busy = self.prefill_busy_s / self.prefill_ready_int if self.prefill_ready_int else 0.0
        return min(1.0, busy)

    def decode_utilization(self) -> float:
        """KV blocks in use over serving blocks, over the interval, in [0, 1]."""
        return min(1.0, self.used_int / self.serving_int if self.serving_int else 0.0)

    def reset_window(self) -> None:
        """Start the next scaling interval (after ``advance`` to its start)."""
        self.prefill_busy_s = 0.0
        self.prefill_ready_int = self.used_int = self.serving_int = 0.0
