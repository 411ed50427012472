"""What a simulation returns, collected as it runs: per-request columns (in flat arrays, one
slot per trace row, written when the request ends), every ticket move, instance lifecycle
events, scaling calls and the timeline samples; ``result`` turns them into a ``SimResult``."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from pdserve.common.errors import IllegalTransitionError
from pdserve.common.types import TICKET_TRANSITIONS
from pdserve.sim.config import SimConfig
from pdserve.sim.engine_model import InstanceModel
from pdserve.sim.result import InstanceEvent, RequestStatus, ScalingRecord, SimResult
from pdserve.sim.state import (
    NUM_TICKET_STATES,
    TICKET_STATES,
    DecodeInstance,
    Instance,
    SimRequest,
)
from pdserve.sim.traces import Trace
from pdserve.sim.usage import Usage

TIMELINE_COUNTS = ("prefill_ready", "prefill_starting", "prefill_draining", "decode_ready",
                   "decode_starting", "decode_draining")
"""Instance counts the timeline samples, in the order ``Fleet.counts`` gives them."""


class Recorder:
    """The run's outputs for ``trace`` under ``config`` on instances of ``model``."""

    def __init__(self, trace: Trace, config: SimConfig, model: InstanceModel) -> None:
        self.trace = trace
        self.config = config
        self.model = model
        self._transitions = [0] * (NUM_TICKET_STATES * NUM_TICKET_STATES)
        self._events: list[InstanceEvent] = []
        self._scaling: list[ScalingRecord] = []
        self._timeline: dict[str, array] = {name: array("d") for name in (
            "time_s", *TIMELINE_COUNTS, "num_queued", "kv_used_fraction")}
        n = trace.num_requests
        self._res_f = {name: array("d", bytes(8 * n)) for name in (
            "ttft_s", "tpot_s", "finish_s", "compute_s", "transfer_s", "slot_wait_s",
            "admission_wait_s")}
        self._res_ttft = self._res_f["ttft_s"]
        self._res_tpot = self._res_f["tpot_s"]
        self._res_finish = self._res_f["finish_s"]
        self._res_compute = self._res_f["compute_s"]
        self._res_transfer = self._res_f["transfer_s"]
        self._res_slot_wait = self._res_f["slot_wait_s"]
        self._res_admission_wait = self._res_f["admission_wait_s"]
        self._res_status = array("b", [-1]) * n
        self._res_local = array("b", bytes(n))
        self._res_attempts = array("b", bytes(n))
        self._res_dec = array("i", [-1]) * n
        self._res_pre = array("i", [-1]) * n
        self._res_cached = array("q", bytes(8 * n))

    # -- as it runs ---------------------------------------------------------------------------

    def move_ticket(self, req: SimRequest, state: int) -> None:
        """``req``'s ticket moves to ``state`` (an index into ``TICKET_STATES``); a new ticket
        (``req.ticket`` -1) counts no move."""
        if req.ticket >= 0:
            self._transitions[req.ticket * NUM_TICKET_STATES + state] += 1
        req.ticket = state

    def completed(self, req: SimRequest, dec: DecodeInstance, now: float) -> tuple[float, float]:
        """``req`` produced its last token on ``dec`` at ``now``; returns its TTFT and TPOT."""
        i = req.i
        ttft = req.first_s - req.arrival
        self._res_ttft[i] = ttft
        self._res_finish[i] = now
        self._res_compute[i] = req.compute_s
        self._res_transfer[i] = req.transfer_s
        self._res_admission_wait[i] = req.routed_s - req.arrival
        if req.output > 1:
            tpot = (now - req.first_s) / (req.output - 1)
            self._res_tpot[i] = tpot
            self._res_slot_wait[i] = req.join_s - req.first_s
        else:
            tpot = 0.0
        self._res_status[i] = RequestStatus.COMPLETED
        self._res_local[i] = req.is_local
        self._res_attempts[i] = req.num_attempts
        self._res_dec[i] = dec.idx
        self._res_pre[i] = -1 if req.pre is None else req.pre.idx
        self._res_cached[i] = req.cached
        return ttft, tpot

    def unserved(self, req: SimRequest, status: RequestStatus, now: float) -> None:
        """``req`` ended at ``now`` without completing (rejected, or failed); one that had its
        first token keeps its TTFT."""
        i = req.i
        if req.first_s >= 0:
            self._res_ttft[i] = req.first_s - req.arrival
        self._res_status[i] = status
        self._res_attempts[i] = req.num_attempts
        self._res_finish[i] = now

    def log(self, now: float, inst: Instance, event: str) -> None:
        self._events.append(InstanceEvent(now, inst.wid, inst.role.value, event))

    def scaled(self, record: ScalingRecord) -> None:
        self._scaling.append(record)

    def sample(self, now: float, counts: tuple[int, ...], num_queued: int,
               kv_used_fraction: float) -> None:
        """One timeline sample: instance counts (``TIMELINE_COUNTS`` order), the router queue,
        the KV blocks in use over serving blocks."""
        timeline = self._timeline
        timeline["time_s"].append(now)
        for name, value in zip(TIMELINE_COUNTS, counts, strict=True):
            timeline[name].append(value)
        timeline["num_queued"].append(num_queued)
        timeline["kv_used_fraction"].append(kv_used_fraction)

    # -- at the end ---------------------------------------------------------------------------

    def result(self, usage: Usage, serving: list[DecodeInstance], end_s: float,
               num_events: int, wall_s: float) -> SimResult:
        """The ``SimResult`` (``serving``: the decode instances serving at the end). Raises if a
        ticket moved illegally or a request is unaccounted for: the simulator's own checks."""
        transitions = {}
        legal = TICKET_TRANSITIONS
        for index, count in enumerate(self._transitions):
            if not count:
                continue
            src = TICKET_STATES[index // NUM_TICKET_STATES]
            dst = TICKET_STATES[index % NUM_TICKET_STATES]
            if dst not in legal[src]:
                raise IllegalTransitionError(f"simulated ticket moved {src} -> {dst} ({count}x)")
            transitions[(src.value, dst.value)] = count
        unfinished = int(np.count_nonzero(np.frombuffer(self._res_status, dtype=np.int8) < 0))
        if unfinished:
            raise RuntimeError(f"simulation ended with {unfinished} requests unaccounted for")
        trace, config = self.trace, self.config
        res: dict[str, Any] = {name: np.frombuffer(values, dtype=np.float64).copy()
                               for name, values in self._res_f.items()}
        res["queue_s"] = res["ttft_s"] - res["compute_s"] - res["transfer_s"]
        return SimResult(
            config=config,
            arrival_s=trace.arrival_s, prompt_tokens=trace.prompt_tokens,
            output_tokens=self._output_tokens(),
            status=np.frombuffer(self._res_status, dtype=np.int8).copy(),
            is_local_prefill=np.frombuffer(self._res_local, dtype=np.int8).astype(bool),
            num_attempts=np.frombuffer(self._res_attempts, dtype=np.int8).copy(),
            decode_instance=np.frombuffer(self._res_dec, dtype=np.int32).copy(),
            prefill_instance=np.frombuffer(self._res_pre, dtype=np.int32).copy(),
            cached_tokens=np.frombuffer(self._res_cached, dtype=np.int64).copy(),
            timeline={name: np.frombuffer(values, dtype=np.float64).copy()
                      for name, values in self._timeline.items()},
            instance_events=tuple(self._events), scaling=tuple(self._scaling),
            ticket_transitions=transitions,
            gpu_hours=usage.gpu_s / 3600.0,
            end_s=end_s, num_events=num_events,
            num_free_blocks_at_end=sum(d.free for d in serving),
            num_total_blocks_at_end=sum(d.total for d in serving),
            wall_s=wall_s, extra=self._utilisation(usage), **res)

    def _output_tokens(self) -> np.ndarray:
        """Output lengths as served: the trace's, capped at the client's ``max_tokens``."""
        outputs = self.trace.output_tokens
        if self.config.max_tokens:
            outputs = np.minimum(outputs, self.config.max_tokens)
        return outputs

    def _utilisation(self, usage: Usage) -> dict[str, float]:
        serving = usage.serving_total_int
        prefill_ready = usage.prefill_ready_total_int
        used = usage.used_total_int
        # Time-integral of running sequences = the sum of each one's time from first token to
        # its end (finish or failure).
        ttft = np.frombuffer(self._res_ttft, dtype=np.float64)
        finish = np.frombuffer(self._res_finish, dtype=np.float64)
        outputs = self._output_tokens()
        started = (ttft > 0) & (outputs > 1)
        running = float(np.sum(finish[started] - self.trace.arrival_s[started] - ttft[started]))
        num_blocks = self.model.num_blocks
        decode_ready_s = serving / num_blocks if num_blocks else 0.0
        slots = decode_ready_s * self.config.cluster.max_batch_size
        busy_total_s = usage.prefill_busy_total_s
        return {
            "prefill_busy_fraction": busy_total_s / prefill_ready if prefill_ready else 0.0,
            "decode_kv_used_fraction": used / serving if serving else 0.0,
            "decode_batch_slot_fraction": running / slots if slots else 0.0,
            "mean_running_per_decode": running / decode_ready_s if decode_ready_s else 0.0,
            "prefill_busy_s": busy_total_s,
            "decode_instance_s": decode_ready_s,
            "prefill_instance_s": prefill_ready,
        }
