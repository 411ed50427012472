"""The simulator runs the live policy objects: a routing knob moves the live router and the
simulator the same way, and any ScalingPolicy is called on schedule and actuated with cold
starts and drains."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2
from pdserve.capacity.scaling import ScalingDecision, ScalingObservation
from pdserve.common.types import (
    FencingToken,
    TicketSpec,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)
from pdserve.router.core import Router, RouterConfig
from pdserve.router.policy import RoutingConfig
from pdserve.router.pool_view import PoolView
from pdserve.router.types import GenerationRequest
from pdserve.sim import ClusterSpec, RequestStatus, SimConfig, simulate
from pdserve.sim.engine_model import instance_model
from pdserve.sim.traces import LengthSpec, Trace, synthetic_trace

INSTANCE = instance_model("llama-3.1-8b", "h100-sxm-80gb", 1)


def cluster(num_prefill: int, num_decode: int) -> ClusterSpec:
    return ClusterSpec(num_prefill, num_decode, model="llama-3.1-8b", gpu="h100-sxm-80gb",
                       tp_size=1)


# -- the live side: the real router core over fake worker clients ------------------------------


class _Tickets:
    def __init__(self) -> None:
        self.specs: list[TicketSpec] = []

    async def open(self, spec: TicketSpec, timeout_s: float) -> FencingToken:
        self.specs.append(spec)
        return FencingToken.new()

    async def abort(self, token: FencingToken, reason: str, timeout_s: float) -> None:
        raise AssertionError(f"no attempt should fail here: {reason}")


class _Workers:
    """Workers that answer at once: admission, prefill, then every token in one message."""

    async def admit(self, address: str, token: FencingToken, num_prompt_tokens: int,
                    num_blocks: int, lease_s: float, transport: str,
                    timeout_s: float) -> pb.KvDestination:
        return pb.KvDestination()

    async def prefill(self, address: str, token: FencingToken, prompt_token_ids: list[int],
                      destination: pb.KvDestination, lease_s: float, request_id: str,
                      timeout_s: float) -> worker_pb2.PrefillResponse:
        return worker_pb2.PrefillResponse()

    def decode(self, address: str, request: worker_pb2.DecodeRequest,
               timeout_s: float) -> AsyncIterator[worker_pb2.DecodeResponse]:
        async def stream() -> AsyncIterator[worker_pb2.DecodeResponse]:
            yield worker_pb2.DecodeResponse(token_ids=[7] * request.sampling.max_tokens,
                                            finish_reason=pb.FINISH_REASON_LENGTH)
        return stream()


def _record(worker_id: str, role: WorkerRole, num_blocks: int) -> WorkerRecord:
    info = pb.WorkerInfo(worker_id=worker_id, kv_layout=pb.KvLayout(
        num_layers=32, num_blocks=num_blocks, block_size_tokens=16, block_nbytes=1024))
    load = WorkerLoad(num_free_blocks=num_blocks, num_total_blocks=num_blocks) \
        if role is WorkerRole.DECODE else WorkerLoad()
    return WorkerRecord(worker_id=worker_id, deployment="m", role=role, state=WorkerState.READY,
                        address=f"{worker_id}:1", load=load, spec=info.SerializeToString())


async def live_local_prefill(trace: Trace, routing: RoutingConfig) -> np.ndarray:
    """Per request: did the live router (``Router.generate``) choose local prefill?"""
    view = PoolView()
    view.replace("m", [_record("d0", WorkerRole.DECODE, INSTANCE.num_blocks),
                       _record("d1", WorkerRole.DECODE, INSTANCE.num_blocks),
                       _record("p0", WorkerRole.PREFILL, 0),
                       _record("p1", WorkerRole.PREFILL, 0)])
    tickets = _Tickets()
    router = Router(RouterConfig(routing=routing), view, tickets, _Workers())  # type: ignore[arg-type]
    is_local = []
    for i in range(trace.num_requests):
        request = GenerationRequest(
            request_id=f"r{i}", model="m",
            prompt_token_ids=tuple(range(1, int(trace.prompt_tokens[i]) + 1)),
            max_tokens=int(trace.output_tokens[i]))
        chunks = [chunk async for chunk in router.generate(request)]
        timing = chunks[-1].timing
        assert timing is not None and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == request.max_tokens
        is_local.append(timing.is_local_prefill)
    # The live router reserved what the policy said: prompt + max_tokens, in blocks.
    assert [s.num_blocks for s in tickets.specs] == [
        -(-int(p + o) // 16) for p, o in zip(trace.prompt_tokens, trace.output_tokens, strict=True)]
    return np.asarray(is_local)


async def test_raising_the_local_prefill_threshold_moves_live_and_simulated_alike() -> None:
    trace = synthetic_trace(150, 2.0, seed=21, prompt=LengthSpec(200, 1.2, 1, 4000),
                            output=LengthSpec(20, 0.5, 1, 200))
    fractions = {}
    for threshold in (64, 512):
        routing = RoutingConfig(local_prefill_threshold_tokens=threshold)
        live = await live_local_prefill(trace, routing)
        simulated = simulate(trace, SimConfig(cluster(2, 2), routing=routing),
                             instance=INSTANCE).is_local_prefill
        # At this light load both see idle pools, so the policy decides each request alike.
        assert np.array_equal(live, simulated)
        fractions[threshold] = (live.mean(), simulated.mean())
    assert fractions[512][0] > fractions[64][0] + 0.2
    assert fractions[512][1] > fractions[64][1] + 0.2


# -- scaling hook ---------------------------------------------------------------------------------


class _StepPolicy:
    """Asks for ``(num_prefill, num_decode)`` from each time in ``plan`` on; records calls."""

    def __init__(self, plan: list[tuple[float, int, int]]) -> None:
        self.plan = plan
        self.observations: list[ScalingObservation] = []

    def decide(self, observation: ScalingObservation) -> ScalingDecision:
        self.observations.append(observation)
        num_prefill, num_decode = self.plan[0][1:]
        for time_s, p, d in self.plan:
            if observation.now_s >= time_s:
                num_prefill, num_decode = p, d
        return ScalingDecision(num_prefill, num_decode, reason="step")


def _trace() -> Trace:
    return synthetic_trace(1200, 20.0, seed=22, prompt=LengthSpec(800, 1.0, 1, 8000),
                           output=LengthSpec(150, 1.0, 1, 1000))


def test_a_scaling_policy_is_asked_on_schedule_and_new_instances_serve_after_cold_start() -> None:
    policy = _StepPolicy([(0.0, 2, 2), (10.0, 2, 3)])
    config = SimConfig(cluster(2, 2), scaling_interval_s=5.0, cold_start_s=30.0)
    result = simulate(_trace(), config, policy, instance=INSTANCE)
    times = [o.now_s for o in policy.observations]
    assert times[:4] == [5.0, 10.0, 15.0, 20.0]
    assert all(o.cold_start_s == 30.0 and o.interval_s == 5.0 for o in policy.observations)
    events = [(e.time_s, e.event) for e in result.instance_events if e.instance_id == "d2"]
    assert events == [(10.0, "launched"), (40.0, "ready")]
    by_time = {o.now_s: o for o in policy.observations}
    assert (by_time[15.0].decode.num_starting, by_time[15.0].decode.num_ready) == (1, 2)
    assert (by_time[45.0].decode.num_starting, by_time[45.0].decode.num_ready) == (0, 3)
    # Arrival rates per interval, oldest first: the trace's rate.
    assert np.mean(by_time[45.0].arrival_rates_per_s) == pytest.approx(20.0, rel=0.15)
    assert by_time[45.0].mean_prompt_tokens == pytest.approx(800, rel=0.3)
    on_new = result.decode_instance == 2
    assert on_new.sum() > 50  # the idle newcomer takes work once ready...
    first_token_s = result.arrival_s + result.ttft_s
    assert first_token_s[on_new].min() >= 40.0  # ...and not before
    assert result.gpu_hours == pytest.approx((4 * result.end_s + (result.end_s - 10.0)) / 3600)
    assert np.all(result.status == RequestStatus.COMPLETED)


def test_scale_down_drains_the_least_useful_instance_first() -> None:
    # +1 decode at 10 s, then back to 2 at 20 s while it is still loading: the loading one goes.
    policy = _StepPolicy([(0.0, 2, 2), (10.0, 2, 3), (20.0, 2, 2), (30.0, 2, 1)])
    config = SimConfig(cluster(2, 2), scaling_interval_s=5.0, cold_start_s=30.0,
                       sample_interval_s=0.5)
    result = simulate(_trace(), config, policy, instance=INSTANCE)
    d2 = [(e.time_s, e.event) for e in result.instance_events if e.instance_id == "d2"]
    assert d2 == [(10.0, "launched"), (20.0, "left")]
    assert not np.any(result.decode_instance == 2)
    # At 30 s one of the two serving instances drains: no new work after, leaves when done.
    drained = [e for e in result.instance_events if e.event == "draining"]
    assert [e.time_s for e in drained] == [30.0]
    victim = int(drained[0].instance_id[1:])
    mine = result.decode_instance == victim
    left = next(e.time_s for e in result.instance_events
                if e.instance_id == drained[0].instance_id and e.event == "left")
    assert left == pytest.approx(result.finish_s[mine].max())
    assert np.all(result.arrival_s[mine] <= 30.0)
    assert np.all(result.status == RequestStatus.COMPLETED)  # scale-down never kills a request
    timeline = result.timeline
    draining = (timeline["time_s"] > 30.0) & (timeline["time_s"] < left)
    assert draining.any() and np.all(timeline["decode_draining"][draining] == 1)
    assert np.all(timeline["decode_ready"][timeline["time_s"] > 30.0] == 1)
    # GPU-hours: two decode and two prefill from 0; d2 for 10 s; the victim until it left.
    assert result.gpu_hours == pytest.approx((3 * result.end_s + 10.0 + left) / 3600)
