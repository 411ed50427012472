"""The simulator sheds exactly where the live admission policy does: the same requests through
the live router (``Router.generate`` over fake workers, so its ``AdmissionPolicy`` decides) and
through the simulator (which calls that policy, ``SimConfig.admission``) are refused alike."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2
from pdserve.common.errors import CapacityError
from pdserve.common.types import (
    FencingToken,
    TicketSpec,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)
from pdserve.router.admission import AdmissionConfig, AdmissionOutcome
from pdserve.router.core import Router, RouterConfig
from pdserve.router.policy import RoutingConfig
from pdserve.router.pool_view import PoolView
from pdserve.router.types import GenerationRequest
from pdserve.sim import ClusterSpec, RequestStatus, SimConfig, simulate
from pdserve.sim.engine_model import instance_model
from pdserve.sim.traces import Trace

MODEL, GPU = "llama-3.1-8b", "h100-sxm-80gb"
INSTANCE = instance_model(MODEL, GPU, 1)
# Every prompt prefilled remotely (never "saturated"), so admission predicts on prefill workers.
ROUTING = RoutingConfig(local_prefill_threshold_tokens=0, prefill_saturation_tokens=10**9)
ADMISSION = AdmissionConfig(slo_ttft_s=0.5, max_pending=30,
                            tenant_max_in_flight=(("heavy", 14),))


class _Tickets:
    async def open(self, spec: TicketSpec, timeout_s: float) -> FencingToken:
        return FencingToken.new()

    async def abort(self, token: FencingToken, reason: str, timeout_s: float) -> None:
        raise AssertionError(f"no attempt should fail here: {reason}")


class _GatedWorkers:
    """Workers that hold every prefill and decode until ``gate`` opens, so that the router sees
    the whole burst in flight, as the simulator does at one instant."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.prefilling: set[str] = set()

    async def admit(self, address: str, token: FencingToken, num_prompt_tokens: int,
                    num_blocks: int, lease_s: float, transport: str,
                    timeout_s: float) -> pb.KvDestination:
        return pb.KvDestination()

    async def prefill(self, address: str, token: FencingToken, prompt_token_ids: list[int],
                      destination: pb.KvDestination, lease_s: float, request_id: str,
                      timeout_s: float) -> worker_pb2.PrefillResponse:
        self.prefilling.add(request_id)
        await self.gate.wait()
        return worker_pb2.PrefillResponse()

    def decode(self, address: str, request: worker_pb2.DecodeRequest,
               timeout_s: float) -> AsyncIterator[worker_pb2.DecodeResponse]:
        async def stream() -> AsyncIterator[worker_pb2.DecodeResponse]:
            await self.gate.wait()
            yield worker_pb2.DecodeResponse(token_ids=[7] * request.sampling.max_tokens,
                                            finish_reason=pb.FINISH_REASON_LENGTH)
        return stream()


def _record(worker_id: str, role: WorkerRole) -> WorkerRecord:
    info = pb.WorkerInfo(worker_id=worker_id, model=MODEL, gpu=GPU, tp_size=1,
                         kv_layout=pb.KvLayout(num_layers=32, num_blocks=INSTANCE.num_blocks,
                                               block_size_tokens=16, block_nbytes=1024))
    load = (WorkerLoad(num_free_blocks=INSTANCE.num_blocks, num_total_blocks=INSTANCE.num_blocks)
            if role is WorkerRole.DECODE else WorkerLoad())
    return WorkerRecord(worker_id=worker_id, deployment="m", role=role, state=WorkerState.READY,
                        address=f"{worker_id}:1", load=load, spec=info.SerializeToString())


async def live_shed(trace: Trace) -> set[int]:
    """Rows the live router refused (RESOURCE_EXHAUSTED), the burst sent in trace order."""
    assert trace.tenant is not None
    view = PoolView()
    view.replace("m", [_record(w, WorkerRole.DECODE) for w in ("d0", "d1")]
                 + [_record(w, WorkerRole.PREFILL) for w in ("p0", "p1")])
    workers = _GatedWorkers()
    router = Router(RouterConfig(routing=ROUTING, admission=ADMISSION), view,
                    _Tickets(), workers, clock=lambda: 0.0)  # type: ignore[arg-type]
    shed: set[int] = set()

    async def one(i: int) -> None:
        request = GenerationRequest(
            request_id=f"r{i}", model="m", tenant=str(trace.tenant[i]),  # type: ignore[index]
            prompt_token_ids=tuple(range(1, int(trace.prompt_tokens[i]) + 1)),
            max_tokens=int(trace.output_tokens[i]))
        try:
            async for _ in router.generate(request):
                pass
        except CapacityError:
            shed.add(i)

    tasks = []
    for i in range(trace.num_requests):
        task = asyncio.create_task(one(i))
        tasks.append(task)
        while not task.done() and f"r{i}" not in workers.prefilling:
            await asyncio.sleep(0)  # admitted and holding its prefill, or refused
    workers.gate.set()
    await asyncio.gather(*tasks)
    return shed


def burst() -> Trace:
    """40 requests at one instant: a heavy tenant sending three of every four."""
    rng = np.random.default_rng(7)
    n = 40
    tenants = np.array(["light" if i % 4 == 3 else "heavy" for i in range(n)], dtype=object)
    return Trace(np.zeros(n), rng.integers(200, 3000, n), rng.integers(2, 60, n),
                 tenant=tenants)


async def test_the_simulator_sheds_exactly_where_the_live_admission_policy_does() -> None:
    trace = burst()
    live = await live_shed(trace)
    result = simulate(trace, SimConfig(ClusterSpec(2, 2, model=MODEL, gpu=GPU, tp_size=1),
                                       routing=ROUTING, admission=ADMISSION), instance=INSTANCE)
    simulated = set(np.flatnonzero(result.status == RequestStatus.REJECTED).tolist())
    assert simulated == live
    assert set(result.shed) == simulated
    outcomes = set(result.shed.values())
    # The burst exercises the tenant cap, the TTFT budget and the fair share, not one of them.
    assert len(outcomes) >= 2, outcomes
    assert 0 < len(live) < trace.num_requests
    light = {i for i in range(trace.num_requests) if trace.tenant[i] == "light"}  # type: ignore[index]
    assert len(light - live) > len(light) / 2  # the light tenant mostly gets in
    assert AdmissionOutcome.ADMITTED.value not in outcomes
    assert result.extra["admission_admitted"] == trace.num_requests - len(live)


def test_without_admission_the_simulator_keeps_its_own_queue() -> None:
    trace = burst()
    result = simulate(trace, SimConfig(ClusterSpec(2, 2, model=MODEL, gpu=GPU, tp_size=1),
                                       routing=ROUTING), instance=INSTANCE)
    assert not result.shed
    assert np.all(result.status == RequestStatus.COMPLETED)
