"""The discrete-event simulator: determinism, conservation, queueing against M/D/1, failures,
admission, SLO-miss reasons, and exactness of its shortcuts (coalesced steps, shortlists)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pdserve.common.types import TICKET_TRANSITIONS, TicketState
from pdserve.perf.catalog import get_gpu
from pdserve.router.policy import RoutingConfig
from pdserve.sim import (
    ClusterSpec,
    Failure,
    MissReason,
    RequestStatus,
    SimConfig,
    SimResult,
    SloSpec,
    simulate,
)
from pdserve.sim.engine_model import InstanceModel, instance_model
from pdserve.sim.traces import LengthSpec, Trace, parse_mooncake_jsonl, synthetic_trace

MODEL = {"model": "llama-3.1-8b", "gpu": "h100-sxm-80gb", "tp_size": 1}
INSTANCE = instance_model("llama-3.1-8b", "h100-sxm-80gb", 1)


def cluster(num_prefill: int, num_decode: int, **kw: object) -> ClusterSpec:
    return ClusterSpec(num_prefill, num_decode, **MODEL, **kw)  # type: ignore[arg-type]


def busy_trace(seed: int = 0, num: int = 3000, rate: float = 40.0) -> Trace:
    return synthetic_trace(num, rate, seed=seed, prompt=LengthSpec(1500, 1.0, 1, 16_000),
                           output=LengthSpec(120, 1.0, 1, 2000))


def run(trace: Trace, config: SimConfig, **kw: object) -> SimResult:
    return simulate(trace, config, instance=INSTANCE, **kw)  # type: ignore[arg-type]


def assert_conserved(result: SimResult) -> None:
    """Every request ended one way; every reserved block came back; tickets moved legally."""
    assert set(np.unique(result.status)) <= {s.value for s in RequestStatus}
    assert result.num_free_blocks_at_end == result.num_total_blocks_at_end
    opened = sum(n for (src, _), n in result.ticket_transitions.items() if src == "open")
    ended = sum(n for (_, dst), n in result.ticket_transitions.items()
                if dst in ("done", "aborted"))
    assert opened == ended  # every ticket reached a terminal state exactly once
    for src, dst in result.ticket_transitions:
        assert TicketState(dst) in TICKET_TRANSITIONS[TicketState(src)]
    completed = result.status == RequestStatus.COMPLETED
    assert np.all(result.finish_s[completed] >= result.arrival_s[completed])
    assert np.all(result.ttft_s[completed] > 0)
    assert np.allclose(result.queue_s + result.compute_s + result.transfer_s, result.ttft_s)


def test_same_seed_same_result_and_another_seed_differs() -> None:
    config = SimConfig(cluster(2, 2))
    one, two = run(busy_trace(1), config), run(busy_trace(1), config)
    for name in ("ttft_s", "tpot_s", "finish_s", "decode_instance", "prefill_instance"):
        assert np.array_equal(getattr(one, name), getattr(two, name))
    assert one.gpu_hours == two.gpu_hours
    other = run(busy_trace(2), config)
    assert not np.array_equal(one.ttft_s, other.ttft_s)


def test_every_request_completes_and_the_ledger_returns_to_all_free() -> None:
    result = run(busy_trace(3), SimConfig(cluster(2, 2)))
    assert_conserved(result)
    assert np.all(result.status == RequestStatus.COMPLETED)
    assert result.ticket_transitions[("open", "prefilling")] == np.count_nonzero(
        ~result.is_local_prefill)
    assert result.ticket_transitions.get(("open", "done"), 0) == np.count_nonzero(
        result.is_local_prefill)
    # TPOT from decode steps: at least the step time of a batch of one.
    multi = result.output_tokens > 1
    assert np.all(result.tpot_s[multi] >= INSTANCE.decode_step_s(1, 2) * 0.999)
    # GPU-hours: 4 instances x 1 GPU for the whole run.
    assert result.gpu_hours == pytest.approx(4 * result.end_s / 3600)


def test_prefill_queue_wait_matches_m_d_1() -> None:
    """One prefill instance, one fixed-size prompt per batch, Poisson arrivals: an M/D/1 queue
    whose mean wait is rho D / (2 (1 - rho))."""
    prompt = 2000
    service_s = INSTANCE.prefill_s([prompt])
    rho = 0.6
    trace = synthetic_trace(30_000, rho / service_s, seed=11, prompt=LengthSpec(prompt),
                            output=LengthSpec(1))
    config = SimConfig(cluster(1, 4, prefill_batch_tokens=1),
                       routing=RoutingConfig(prefill_saturation_tokens=10**9))
    result = run(trace, config)
    assert not result.is_local_prefill.any()
    assert np.allclose(result.compute_s, service_s)
    expected_wait = rho * service_s / (2 * (1 - rho))
    assert np.mean(result.queue_s) == pytest.approx(expected_wait, rel=0.15)
    # Little's law on the server: busy fraction = arrival rate x service time.
    assert result.extra["prefill_busy_fraction"] == pytest.approx(rho, rel=0.03)


def test_coalesced_decode_steps_equal_single_steps() -> None:
    """A run of k steps is one event; cutting it when a sequence arrives must give the same
    times as stepping one at a time (here: a batch limit of 1 forbids coalescing's benefit
    without changing the arithmetic, so compare against a tiny-batch-free reference run)."""
    trace = busy_trace(4, num=1500, rate=25.0)
    config = SimConfig(cluster(2, 2))
    coalesced = run(trace, config)
    from pdserve.sim import simulator
    from pdserve.sim.state import DecodeInstance

    original = simulator.Simulator._start_run

    def one_step_runs(self: simulator.Simulator, dec: DecodeInstance) -> None:
        original(self, dec)
        if dec.run_steps > 1:  # replace the run by its first step
            dec.epoch += 1
            dec.run_steps = 1
            self._push(self.now + dec.run_first_s, simulator.EV_DECODE_STEP, (dec, dec.epoch))

    simulator.Simulator._start_run = one_step_runs  # type: ignore[method-assign]
    try:
        stepped = run(trace, config)
    finally:
        simulator.Simulator._start_run = original  # type: ignore[method-assign]
    assert stepped.num_events > coalesced.num_events * 1.5
    assert np.array_equal(stepped.decode_instance, coalesced.decode_instance)
    assert np.allclose(stepped.finish_s, coalesced.finish_s, rtol=0, atol=1e-9)
    assert np.allclose(stepped.tpot_s, coalesced.tpot_s, rtol=0, atol=1e-9)


def _hashed_trace(num: int, seed: int) -> Trace:
    """Mooncake-style requests: a shared system prompt, per-conversation prefixes, new turns."""
    rng = np.random.default_rng(seed)
    rows = []
    next_id = 1000
    conversations: list[list[int]] = [[0] for _ in range(30)]
    t_ms = 0.0
    for _ in range(num):
        t_ms += rng.exponential(40.0)
        conv = conversations[int(rng.integers(len(conversations)))]
        conv.extend(range(next_id, next_id + int(rng.integers(1, 4))))
        next_id += 4
        length = 512 * (len(conv) - 1) + int(rng.integers(1, 512))
        rows.append(json.dumps({"timestamp": t_ms, "input_length": length,
                                "output_length": int(rng.integers(1, 200)),
                                "hash_ids": list(conv)}) + "\n")
        if len(conv) > 12:
            conv[1:] = []
    return parse_mooncake_jsonl(rows)


@pytest.mark.parametrize("trace_kind", ["plain", "hashed"])
def test_shortlisted_candidates_decide_exactly_like_all_candidates(trace_kind: str) -> None:
    trace = busy_trace(5, num=2000, rate=30.0) if trace_kind == "plain" else _hashed_trace(1500, 5)
    config = SimConfig(cluster(4, 5, max_batch_size=32),
                       routing=RoutingConfig(local_prefill_threshold_tokens=300))
    short = run(trace, config)
    full = run(trace, dataclasses.replace(config, is_shortlisted=False))
    assert np.array_equal(short.decode_instance, full.decode_instance)
    assert np.array_equal(short.prefill_instance, full.prefill_instance)
    assert np.array_equal(short.ttft_s, full.ttft_s)
    assert len(set(short.decode_instance.tolist())) == 5  # every instance was used
    if trace_kind == "hashed":
        assert np.mean(short.cached_tokens > 0) > 0.3  # prefix-aware routing found the caches
        assert_conserved(short)


def test_prefix_cache_hits_cut_prefill_compute() -> None:
    trace = _hashed_trace(1500, 6)
    config = SimConfig(cluster(3, 3))
    cached = run(trace, config)
    tiny = run(trace, dataclasses.replace(config, cluster=cluster(3, 3, prefix_cache_blocks=8)))
    remote = ~cached.is_local_prefill
    assert np.sum(cached.cached_tokens) > 5 * np.sum(tiny.cached_tokens)
    assert np.mean(cached.compute_s[remote]) < np.mean(tiny.compute_s[~tiny.is_local_prefill])
    assert np.all(cached.cached_tokens < cached.prompt_tokens)


def test_failed_prefill_instance_work_is_retried_elsewhere() -> None:
    trace = busy_trace(7, num=800, rate=60.0)  # prefill-bound: queues build on both instances
    config = SimConfig(cluster(2, 2), failures=(Failure(5.0, "p0"),),
                       routing=RoutingConfig(prefill_saturation_tokens=10**9))
    result = run(trace, config)
    assert_conserved(result)
    assert np.all(result.status == RequestStatus.COMPLETED)  # nothing was past its first token
    retried = result.num_attempts > 1
    assert retried.sum() > 5
    assert np.all(result.prefill_instance[retried & ~result.is_local_prefill] == 1)
    assert np.all(result.arrival_s[retried] <= 5.0)
    assert not np.any((result.prefill_instance == 0) & (result.arrival_s > 5.0))
    assert result.ticket_transitions[("prefilling", "aborted")] + result.ticket_transitions.get(
        ("open", "aborted"), 0) >= retried.sum()
    failed_events = [e for e in result.instance_events if e.event == "failed"]
    assert [(e.instance_id, e.time_s) for e in failed_events] == [("p0", 5.0)]


def test_failed_decode_instance_fails_streams_and_retries_the_rest() -> None:
    trace = busy_trace(8, num=800, rate=40.0)
    result = run(trace, SimConfig(cluster(2, 2), failures=(Failure(6.0, "d1"),)))
    assert_conserved(result)
    failed = result.status == RequestStatus.FAILED
    assert failed.sum() > 0
    first_token = result.arrival_s + result.ttft_s
    retried = result.num_attempts > 1
    assert retried.sum() > 0
    # Retried requests finished on the survivor; failed ones had their first token before 6 s.
    assert np.all(result.decode_instance[retried & ~failed] == 0)
    assert not np.any((result.decode_instance == 1) & (result.finish_s > 6.0) & ~failed)
    assert np.all(result.arrival_s[failed] < 6.0)
    assert np.all(result.miss_reasons()[failed] == MissReason.FAILED)
    assert result.gpu_hours == pytest.approx((3 * result.end_s + 6.0) / 3600)
    del first_token


def test_admission_queue_bounds_and_rejects_beyond_it() -> None:
    # Reservations of ~200 blocks on a 600-block decode: three fit at once.
    small = dataclasses.replace(INSTANCE, num_blocks=600)
    trace = synthetic_trace(300, 20.0, seed=9, prompt=LengthSpec(3000),
                            output=LengthSpec(200))
    queued = simulate(trace, SimConfig(cluster(1, 1), max_queued_requests=20), instance=small)
    assert_conserved(queued)
    rejected = queued.status == RequestStatus.REJECTED
    assert 0 < rejected.sum() < 300
    assert np.all(queued.miss_reasons()[rejected] == MissReason.REJECTED)
    assert queued.timeline["num_queued"].max() <= 20
    assert np.max(queued.queue_s[~rejected]) > 10 * np.max(queued.compute_s)  # waited for room
    refused = simulate(trace, SimConfig(cluster(1, 1), max_queued_requests=0), instance=small)
    assert (refused.status == RequestStatus.REJECTED).sum() > rejected.sum()
    # A request that can never fit is rejected at once.
    huge = synthetic_trace(3, 1.0, seed=1, prompt=LengthSpec(20_000), output=LengthSpec(10))
    alone = simulate(huge, SimConfig(cluster(1, 1)), instance=small)
    assert np.all(alone.status == RequestStatus.REJECTED)


def test_miss_reasons_name_queueing_transfer_and_compute() -> None:
    trace = synthetic_trace(400, 30.0, seed=10, prompt=LengthSpec(4000), output=LengthSpec(50))
    # Queueing: one prefill instance far beyond its capacity.
    overloaded = run(trace, SimConfig(cluster(1, 2), slo=SloSpec(ttft_ms=1000, tpot_ms=1000),
                                      routing=RoutingConfig(prefill_saturation_tokens=10**9)))
    reasons = overloaded.ttft_reasons()
    assert np.mean(reasons == MissReason.QUEUEING) > 0.5
    assert not np.any(reasons == MissReason.TRANSFER)
    # Compute: a TTFT target below one prefill of the prompt.
    tight = run(trace, SimConfig(cluster(4, 2), slo=SloSpec(
        ttft_ms=INSTANCE.prefill_s([4000]) * 1000 * 0.5, tpot_ms=1000)))
    assert np.all(tight.ttft_reasons() == MissReason.COMPUTE)
    # Transfer: a NIC so slow that the exposed transfer alone breaks the target.
    slow_nic = dataclasses.replace(get_gpu("h100-sxm-80gb"), nic_bytes_per_s=2e8)
    slow = dataclasses.replace(INSTANCE, perf=dataclasses.replace(INSTANCE.perf, gpu=slow_nic))
    transfer_s = slow.exposed_transfer_s(4000, slow.prefill_s([4000]))
    limit_ms = (slow.prefill_s([4000]) + transfer_s / 2) * 1000
    far = simulate(synthetic_trace(50, 1.0, seed=3, prompt=LengthSpec(4000), output=LengthSpec(5)),
                   SimConfig(cluster(2, 2), slo=SloSpec(ttft_ms=limit_ms, tpot_ms=1000)),
                   instance=slow)
    assert np.all(far.ttft_reasons() == MissReason.TRANSFER)
    assert np.allclose(far.transfer_s, transfer_s)


def test_tpot_misses_split_into_batch_slot_waits_and_slow_steps() -> None:
    trace = synthetic_trace(300, 20.0, seed=12, prompt=LengthSpec(500), output=LengthSpec(100))
    step_s = INSTANCE.decode_step_s(1, 600)
    # Batch of one: sequences wait for the slot -> queueing.
    waited = run(trace, SimConfig(cluster(3, 1, max_batch_size=1),
                                  slo=SloSpec(ttft_ms=10_000, tpot_ms=step_s * 1000 * 1.5)))
    reasons = waited.tpot_reasons()
    assert np.mean(reasons == MissReason.QUEUEING) > 0.5
    assert np.all(waited.slot_wait_s[reasons == MissReason.QUEUEING] > 0)
    # A target below a single step: compute.
    fast = run(trace, SimConfig(cluster(3, 2), slo=SloSpec(ttft_ms=10_000,
                                                          tpot_ms=step_s * 1000 * 0.5)))
    assert np.all(fast.tpot_reasons() == MissReason.COMPUTE)
    assert fast.attainment() == 0.0


def test_local_prefill_runs_on_the_decode_instance_without_transfer() -> None:
    trace = synthetic_trace(500, 10.0, seed=13, prompt=LengthSpec(100, 1.0), output=LengthSpec(20))
    result = run(trace, SimConfig(cluster(2, 2), routing=RoutingConfig(
        local_prefill_threshold_tokens=100)))
    local = result.is_local_prefill
    assert 0.3 < local.mean() < 0.9
    assert np.all(result.prompt_tokens[local] <= 100)
    assert np.all(result.prompt_tokens[~local] > 100)
    assert np.all(result.transfer_s[local] == 0) and np.all(result.transfer_s[~local] > 0)
    assert np.all(result.prefill_instance[local] == -1)
    assert_conserved(result)


def test_instance_model_matches_the_catalog() -> None:
    big = instance_model("llama-3.1-70b", "h100", 8)
    assert isinstance(big, InstanceModel)
    assert big.num_blocks > 50_000 and big.num_layers == 80
    # Layer-wise streaming hides all but about one layer when the NIC keeps up.
    compute_s = big.prefill_s([2000])
    assert big.exposed_transfer_s(2000, compute_s) == pytest.approx(
        big.perf.kv_transfer_time_s(2000) / 80)
    assert big.exposed_transfer_s(2000, 0.0) == pytest.approx(big.perf.kv_transfer_time_s(2000))


def test_a_fixed_max_tokens_reserves_for_it_and_caps_the_output() -> None:
    trace = synthetic_trace(400, 10.0, seed=14, prompt=LengthSpec(100), output=LengthSpec(300, 1.0))
    capped = run(trace, SimConfig(cluster(2, 2), max_tokens=256))
    assert capped.output_tokens.max() == 256
    assert np.array_equal(capped.output_tokens, np.minimum(trace.output_tokens, 256))
    assert_conserved(capped)
    # The same generation with each request reserving only its own length uses less KV.
    same_lengths = Trace(trace.arrival_s, trace.prompt_tokens, capped.output_tokens)
    exact = run(same_lengths, SimConfig(cluster(2, 2)))
    assert np.allclose(exact.tpot_s, capped.tpot_s, rtol=0.2)
    assert capped.extra["decode_kv_used_fraction"] > 1.1 * exact.extra["decode_kv_used_fraction"]
