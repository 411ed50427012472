"""The admission policy: TTFT prediction from the reported queue and the router's own dispatches,
online learning of each worker's prefill rate, shedding thresholds and retry hints, in-flight
caps, the router-queue bound, and max-min fairness between tenants (checked in a small
discrete-event simulation of one FIFO prefill worker). Also the router core's use of it: a shed
request opens no ticket, and local prefill is predicted against the decode worker."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.common.clock import ManualClock
from pdserve.common.errors import CapacityError, ConfigError, InvalidArgumentError
from pdserve.common.settings_fields import parse_settings
from pdserve.common.types import TicketSpec, WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.router.admission import (
    AdmissionConfig,
    AdmissionOutcome,
    AdmissionPolicy,
    AdmissionRequest,
)
from pdserve.router.app import admission_config
from pdserve.router.core import Router, RouterConfig
from pdserve.router.pool_view import PoolView
from pdserve.router.prediction import WorkerSnapshot, prior_tokens_per_s
from pdserve.router.settings import RouterSettings
from pdserve.router.types import GenerationRequest, PrefillMode

RATE = 1000.0  # tokens/s of the simulated worker


def worker(queued: int = 0, report_s: float = 0.0, prior: float = RATE,
           worker_id: str = "p0") -> WorkerSnapshot:
    return WorkerSnapshot(worker_id, queued, report_s, prior)


def request(request_id: str, tokens: int = 100, tenant: str = "") -> AdmissionRequest:
    return AdmissionRequest(request_id, tenant, tokens)


# -- prediction -------------------------------------------------------------------------------


def test_prediction_counts_own_dispatches_the_report_does_not_show_yet() -> None:
    policy = AdmissionPolicy(AdmissionConfig(slo_ttft_s=100.0))
    assert policy.predict_ttft_s(worker(), 500, 0.0) == pytest.approx(0.5)
    for index in range(3):
        assert policy.admit(request(f"r{index}", 500), worker(), 0.0).is_admitted
    # The report still says 0 queued; the router knows of 1,500 tokens it sent.
    assert policy.estimated_queued_tokens(worker(), 0.0) == 1500
    assert policy.predict_ttft_s(worker(), 500, 0.0) == pytest.approx(2.0)


def test_prediction_credits_the_progress_of_the_head_job() -> None:
    policy = AdmissionPolicy(AdmissionConfig(slo_ttft_s=100.0))
    policy.admit(request("a", 1000), worker(), 0.0)
    policy.admit(request("b", 1000), worker(), 0.0)
    assert policy.estimated_queued_tokens(worker(), 0.5) == 1500
    assert policy.estimated_queued_tokens(worker(), 5.0) == 1000  # the head is done, not reported


def test_foreign_work_in_a_report_counts_and_drains_at_the_worker_rate() -> None:
    policy = AdmissionPolicy(AdmissionConfig(slo_ttft_s=100.0))
    policy.admit(request("own", 200), worker(report_s=1.0), 10.0)
    # A new report: 1,200 queued, 200 of them this router's, so 1,000 are other routers'.
    report = worker(queued=1200, report_s=2.0)
    assert policy.estimated_queued_tokens(report, 10.0) == 1200
    assert policy.estimated_queued_tokens(report, 10.5) == 700  # 500 drained, own still waits
    assert policy.estimated_queued_tokens(report, 20.0) == 0  # all of it drained since


def test_prior_comes_from_the_performance_model_and_grows_with_a_faster_gpu() -> None:
    h100 = prior_tokens_per_s("llama-3.1-8b", "h100-sxm-80gb", 1, 1024)
    a100 = prior_tokens_per_s("llama-3.1-8b", "a100-sxm-80gb", 1, 1024)
    assert h100 > a100 > 0
    assert prior_tokens_per_s("no-such-model", "h100-sxm-80gb", 1, 1024) == 0.0


# -- learning ---------------------------------------------------------------------------------


def test_rate_is_learned_from_service_times_reconstructed_from_a_fifo_queue() -> None:
    policy = AdmissionPolicy(AdmissionConfig(slo_ttft_s=1000.0, ewma_alpha=0.5))
    prior = worker(prior=10 * RATE)  # the model thinks the worker is 10x faster than it is
    for index in range(4):  # all sent at once; the worker finishes one per second
        policy.admit(request(f"r{index}", 1000), prior, 0.0)
    for index in range(4):
        policy.prefill_done(f"r{index}", float(index + 1), is_ok=True)
    # Each job took 1 s of service (not 1, 2, 3, 4 s of latency): the estimate moves from
    # 10,000 towards 1,000 tokens/s and is close after four samples at alpha 0.5.
    assert policy.tokens_per_s("p0") == pytest.approx(RATE, rel=0.1)


def test_failed_prefills_teach_nothing_and_free_their_tokens() -> None:
    policy = AdmissionPolicy(AdmissionConfig(slo_ttft_s=1000.0))
    policy.admit(request("r", 1000), worker(), 0.0)
    policy.prefill_done("r", 0.001, is_ok=False)
    assert policy.tokens_per_s("p0") == RATE
    assert policy.estimated_queued_tokens(worker(), 0.001) == 0
    assert policy.num_pending == 0 and policy.num_in_flight == 1
    policy.finish("r")
    assert policy.num_in_flight == 0


def test_a_retry_moves_the_booked_tokens_to_the_new_worker() -> None:
    policy = AdmissionPolicy(AdmissionConfig(slo_ttft_s=1000.0))
    policy.admit(request("r", 400), worker(), 0.0)
    policy.prefill_done("r", 0.1, is_ok=False)
    policy.dispatched("r", worker(worker_id="p1"), 0.2)
    assert policy.num_pending == 1
    assert policy.estimated_queued_tokens(worker(worker_id="p1"), 0.2) == 400
    assert policy.estimated_queued_tokens(worker(), 0.2) == 0


# -- shedding ---------------------------------------------------------------------------------


def test_requests_are_shed_once_the_predicted_ttft_exceeds_the_budget() -> None:
    config = AdmissionConfig(slo_ttft_s=1.0, ttft_budget_fraction=0.8)
    policy = AdmissionPolicy(config)
    decisions = [policy.admit(request(f"r{i}", 100), worker(), 0.0) for i in range(20)]
    admitted = [d for d in decisions if d.is_admitted]
    assert len(admitted) == 8  # 8 x 100 tokens at 1,000 tokens/s = the 0.8 s budget
    assert all(d.predicted_ttft_s <= config.budget_s + 1e-9 for d in admitted)
    shed = decisions[8:]
    assert all(d.outcome is AdmissionOutcome.SLO for d in shed)
    assert all(0 < d.retry_after_s <= config.max_retry_after_s for d in shed)
    # A shed request books nothing: the queue is what the admitted ones put there.
    assert policy.estimated_queued_tokens(worker(), 0.0) == 800
    assert policy.num_in_flight == 8


def test_retry_hints_grow_with_the_queue_and_are_bounded() -> None:
    config = AdmissionConfig(slo_ttft_s=1.0, min_retry_after_s=0.05, max_retry_after_s=5.0)
    hints = []
    for queued in (1_000, 2_000, 4_000, 1_000_000):
        policy = AdmissionPolicy(config)
        decision = policy.admit(request("r"), worker(queued=queued, report_s=1.0), 0.0)
        assert decision.outcome is AdmissionOutcome.SLO
        hints.append(decision.retry_after_s)
    assert hints == sorted(hints) and len(set(hints)) == len(hints)
    assert hints[0] >= config.min_retry_after_s and hints[-1] == config.max_retry_after_s
    # The hint is the time until the queue has drained enough: 1,000 + 100 tokens at 1,000/s
    # predict 1.1 s, 0.3 s over the 0.8 s budget.
    assert hints[0] == pytest.approx(0.3)


def test_with_shedding_disabled_only_the_hard_bounds_refuse() -> None:
    policy = AdmissionPolicy(AdmissionConfig(slo_ttft_s=1.0, is_shedding_enabled=False,
                                             max_pending=5))
    decisions = [policy.admit(request(f"r{i}", 1000), worker(), 0.0) for i in range(7)]
    assert [d.is_admitted for d in decisions] == [True] * 5 + [False] * 2
    assert decisions[4].predicted_ttft_s == pytest.approx(5.0)  # far beyond the SLO, admitted
    assert {d.outcome for d in decisions[5:]} == {AdmissionOutcome.QUEUE_FULL}
    assert all(d.retry_after_s > 0 for d in decisions[5:])


def test_the_router_queue_is_bounded_and_frees_as_prefills_finish() -> None:
    policy = AdmissionPolicy(AdmissionConfig(slo_ttft_s=1000.0, max_pending=2))
    assert policy.admit(request("a"), worker(), 0.0).is_admitted
    assert policy.admit(request("b"), worker(), 0.0).is_admitted
    refused = policy.admit(request("c"), worker(), 0.0)
    assert refused.outcome is AdmissionOutcome.QUEUE_FULL and refused.retry_after_s > 0
    policy.prefill_done("a", 0.1, is_ok=True)  # "a" decodes now: out of the queue, in flight
    assert policy.admit(request("c"), worker(), 0.1).is_admitted
    assert (policy.num_pending, policy.num_in_flight) == (2, 3)


def test_in_flight_caps_per_router_and_per_tenant() -> None:
    config = AdmissionConfig(slo_ttft_s=1000.0, max_in_flight=10, tenant_share=0.3,
                             tenant_max_in_flight=(("vip", 5),))
    policy = AdmissionPolicy(config)
    assert policy.tenant_cap("anyone") == 3 and policy.tenant_cap("vip") == 5
    outcomes = [policy.admit(request(f"a{i}", tenant="a"), worker(), 0.0).outcome for i in range(4)]
    assert outcomes == [AdmissionOutcome.ADMITTED] * 3 + [AdmissionOutcome.TENANT_FULL]
    policy.finish("a0")
    assert policy.admit(request("a4", tenant="a"), worker(), 0.0).is_admitted
    for i in range(5):
        assert policy.admit(request(f"v{i}", tenant="vip"), worker(), 0.0).is_admitted
    assert policy.admit(request("b0", tenant="b"), worker(), 0.0).is_admitted  # 9 in flight
    assert policy.admit(request("b1", tenant="b"), worker(), 0.0).is_admitted  # 10
    assert (policy.admit(request("b2", tenant="b"), worker(), 0.0).outcome
            is AdmissionOutcome.ROUTER_FULL)


def test_router_settings_become_the_admission_config() -> None:
    settings = parse_settings(RouterSettings, [
        "--coordinator-address", "127.0.0.1:1", "--slo-ttft-ms", "1500",
        "--shed-ttft-fraction", "0.9", "--max-pending-requests", "64",
        "--tenant-max-in-flight", "gold=100,=7", "--tenant-weights", "gold=2.5",
        "--is-shedding-enabled", "false"], {})
    config = admission_config(settings)
    assert config.budget_s == pytest.approx(1.35)
    assert config.max_pending == 64 and not config.is_shedding_enabled
    assert AdmissionPolicy(config).tenant_cap("") == 7
    assert config.tenant_weights == (("gold", 2.5),)
    with pytest.raises(ConfigError, match="tenant=value"):
        parse_settings(RouterSettings, ["--coordinator-address", "127.0.0.1:1",
                                        "--tenant-weights", "gold"], {})


def test_duplicate_ids_and_bad_config_are_refused() -> None:
    policy = AdmissionPolicy(AdmissionConfig())
    policy.admit(request("r"), worker(), 0.0)
    with pytest.raises(InvalidArgumentError):
        policy.admit(request("r"), worker(), 0.0)
    with pytest.raises(InvalidArgumentError):
        AdmissionConfig(ttft_budget_fraction=0)
    with pytest.raises(InvalidArgumentError):
        AdmissionConfig(min_retry_after_s=5, max_retry_after_s=1)
    with pytest.raises(InvalidArgumentError):
        AdmissionConfig(tenant_weights=(("a", 0.0),))


# -- fairness: a discrete-event simulation of one FIFO prefill worker --------------------------


@dataclass
class _Result:
    arrivals: dict[str, int] = field(default_factory=dict)
    good: dict[str, int] = field(default_factory=dict)
    shed: dict[str, int] = field(default_factory=dict)
    max_ttft_s: float = 0.0


def _simulate(config: AdmissionConfig, rates_rps: dict[str, float], duration_s: float = 120.0,
              tokens: int = 100, true_rate: float = RATE, prior: float = RATE,
              seed: int = 7) -> _Result:
    """Open-loop Poisson arrivals per tenant into ``AdmissionPolicy``; admitted prefills are
    served first come first served at ``true_rate`` tokens/s; TTFT = completion - arrival."""
    rng = random.Random(seed)
    policy = AdmissionPolicy(config)
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, request id or tenant)
    seq = 0
    for tenant, rate in rates_rps.items():
        t = rng.expovariate(rate)
        while t < duration_s:
            events.append((t, seq, "arrive", tenant))
            seq += 1
            t += rng.expovariate(rate)
    heapq.heapify(events)
    result = _Result()
    arrived_at: dict[str, tuple[str, float]] = {}
    busy_until = 0.0
    snapshot = WorkerSnapshot("p0", 0, 0.0, prior)
    while events:
        now, _, kind, name = heapq.heappop(events)
        if kind == "arrive":
            result.arrivals[name] = result.arrivals.get(name, 0) + 1
            request_id = f"r{seq}"
            seq += 1
            decision = policy.admit(AdmissionRequest(request_id, name, tokens), snapshot, now)
            if not decision.is_admitted:
                result.shed[name] = result.shed.get(name, 0) + 1
                continue
            policy.dispatched(request_id, snapshot, now)
            arrived_at[request_id] = (name, now)
            busy_until = max(busy_until, now) + tokens / true_rate
            heapq.heappush(events, (busy_until, seq, "done", request_id))
            seq += 1
        else:
            tenant, arrival = arrived_at.pop(name)
            policy.prefill_done(name, now, is_ok=True)
            policy.finish(name)
            ttft = now - arrival
            result.max_ttft_s = max(result.max_ttft_s, ttft)
            if ttft <= config.slo_ttft_s:
                result.good[tenant] = result.good.get(tenant, 0) + 1
    return result


def test_at_3x_overload_a_light_tenant_keeps_its_goodput_and_the_heavy_one_is_shed() -> None:
    capacity_rps = RATE / 100  # 10 requests/s of 100 tokens
    rates = {"heavy": 3 * capacity_rps * 10 / 11, "light": 3 * capacity_rps / 11}
    fair = _simulate(AdmissionConfig(slo_ttft_s=1.0), rates)
    light_goodput = fair.good["light"] / fair.arrivals["light"]
    heavy_shed = fair.shed["heavy"] / fair.arrivals["heavy"]
    assert light_goodput >= 0.9, fair
    assert heavy_shed >= 0.6, fair
    total_good = (fair.good["light"] + fair.good["heavy"]) / 120.0
    assert total_good >= 0.9 * capacity_rps, fair  # the worker stays busy
    assert fair.max_ttft_s <= 1.0  # every admitted request met the SLO

    # Without the fair-share band (onset at the budget itself) shedding is blind to tenants:
    # the light tenant loses about as large a fraction as the heavy one.
    blind = _simulate(AdmissionConfig(slo_ttft_s=1.0, fair_share_onset=1.0), rates)
    assert blind.good["light"] / blind.arrivals["light"] < 0.6, blind


def test_weights_give_a_tenant_a_larger_share_of_a_saturated_queue() -> None:
    rates = {"a": 15.0, "b": 15.0}
    config = AdmissionConfig(slo_ttft_s=1.0, tenant_weights=(("a", 3.0),))
    result = _simulate(config, rates)
    assert result.good["a"] > 1.5 * result.good["b"], result


def test_admission_learns_a_slow_worker_and_still_meets_the_slo() -> None:
    # The prior believes the worker is 5x faster than it is (a slowed sim GPU, or a real engine
    # far from its roofline); after a few completions the predictions are right again.
    result = _simulate(AdmissionConfig(slo_ttft_s=1.0), {"": 30.0}, prior=5 * RATE)
    good = result.good[""] / 120.0
    assert good >= 0.85 * RATE / 100, result


# -- the router core --------------------------------------------------------------------------


class _NoTickets:
    """A coordinator that must not be called: a shed request opens no ticket."""

    def __init__(self) -> None:
        self.opened: list[TicketSpec] = []

    async def open(self, spec: TicketSpec, timeout_s: float) -> object:
        self.opened.append(spec)
        raise CapacityError("test coordinator: no tickets today", retry_after_s=0.1)

    async def abort(self, token: object, reason: str, timeout_s: float) -> None:
        raise AssertionError("nothing to abort")


def _record(worker_id: str, role: WorkerRole, queued: int) -> WorkerRecord:
    info = pb.WorkerInfo(worker_id=worker_id, model="llama-3.1-8b", gpu="h100-sxm-80gb",
                         tp_size=1, kv_layout=pb.KvLayout(block_size_tokens=16, num_blocks=4096))
    return WorkerRecord(
        worker_id=worker_id, deployment="m", role=role, state=WorkerState.READY,
        address=f"{worker_id}:1", last_heartbeat_s=1.0, spec=info.SerializeToString(),
        load=WorkerLoad(num_queued_prefill_tokens=queued, num_free_blocks=4096,
                        num_total_blocks=4096))


def _router(decode_queued: int, prefill_queued: int) -> tuple[Router, _NoTickets]:
    view = PoolView()
    view.replace("m", [_record("d0", WorkerRole.DECODE, decode_queued),
                       _record("p0", WorkerRole.PREFILL, prefill_queued)])
    tickets = _NoTickets()
    config = RouterConfig(max_attempts=1, slo_ttft_ms=1000.0)
    return Router(config, view, tickets, workers=None, clock=ManualClock(5.0)), tickets  # type: ignore[arg-type]


async def _generate(router: Router, mode: PrefillMode) -> None:
    request = GenerationRequest(request_id="", model="m", prompt_token_ids=tuple(range(1, 513)),
                                max_tokens=4, prefill_mode=mode)
    async for _ in router.generate(request):
        pass


async def test_a_request_predicted_to_miss_the_slo_is_shed_before_any_ticket() -> None:
    router, tickets = _router(decode_queued=0, prefill_queued=10_000_000)
    with pytest.raises(CapacityError) as caught:
        await _generate(router, PrefillMode.REMOTE)
    assert "predicted TTFT" in caught.value.message
    assert 0 < caught.value.retry_after_s <= 10.0
    assert tickets.opened == []
    assert router.admission.num_in_flight == 0


async def test_local_prefill_is_predicted_against_the_decode_worker() -> None:
    # The prefill pool is swamped but the decode worker is idle: local prefill is admitted (and
    # reaches the coordinator, which this test's refuses); the other way round it is shed.
    router, tickets = _router(decode_queued=0, prefill_queued=10_000_000)
    with pytest.raises(CapacityError, match="no tickets today"):
        await _generate(router, PrefillMode.LOCAL)
    assert len(tickets.opened) == 1 and tickets.opened[0].prefill_worker_id == ""
    assert router.admission.num_in_flight == 0  # released when the request ended

    router, tickets = _router(decode_queued=10_000_000, prefill_queued=0)
    with pytest.raises(CapacityError, match="predicted TTFT"):
        await _generate(router, PrefillMode.LOCAL)
    assert tickets.opened == []
