"""Colocated instances in the simulator: chunked prefill inside decode steps, timed by the same
engine model as the disaggregated pools."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import TICKET_TRANSITIONS, TicketState
from pdserve.sim import ClusterSpec, Failure, RequestStatus, SimConfig, SimResult, simulate
from pdserve.sim.config import colocated_cluster
from pdserve.sim.engine_model import instance_model
from pdserve.sim.traces import LengthSpec, Trace, synthetic_trace

MODEL = {"model": "llama-3.1-8b", "gpu": "h100-sxm-80gb", "tp_size": 1}
INSTANCE = instance_model("llama-3.1-8b", "h100-sxm-80gb", 1)


def assert_conserved(result: SimResult) -> None:
    """Every request ended one way; every reserved block came back; tickets moved legally."""
    assert result.num_free_blocks_at_end == result.num_total_blocks_at_end
    opened = sum(n for (src, _), n in result.ticket_transitions.items() if src == "open")
    ended = sum(n for (_, dst), n in result.ticket_transitions.items()
                if dst in ("done", "aborted"))
    assert opened == ended
    for src, dst in result.ticket_transitions:
        assert TicketState(dst) in TICKET_TRANSITIONS[TicketState(src)]
    completed = result.status == RequestStatus.COMPLETED
    assert np.all(result.ttft_s[completed] > 0)
    assert np.allclose(result.queue_s + result.compute_s + result.transfer_s, result.ttft_s)


def run(trace: Trace, cluster: ClusterSpec, **kw: object) -> SimResult:
    return simulate(trace, SimConfig(cluster=cluster, **kw),  # type: ignore[arg-type]
                    instance=INSTANCE)


def two_requests(second_arrival_s: float, prompt: int = 1000, output: int = 50) -> Trace:
    return Trace(np.array([0.0, second_arrival_s]), np.array([prompt, prompt]),
                 np.array([output, output]))


def test_mixed_step_is_continuous_with_both_pure_phases() -> None:
    assert INSTANCE.mixed_step_s(0, 0, [(700, 0)]) == pytest.approx(INSTANCE.prefill_s([700]))
    assert INSTANCE.mixed_step_s(8, 8000, []) == pytest.approx(INSTANCE.decode_step_s(8, 8000))
    # Two fresh prompts in one step cost the FLOPs of two prompts, not of one of their total.
    assert INSTANCE.mixed_step_s(0, 0, [(300, 0), (400, 0)]) == pytest.approx(
        INSTANCE.prefill_s([300, 400]))


def test_a_lone_prompt_is_prefilled_chunk_by_chunk() -> None:
    budget, prompt = 256, 1000
    result = run(Trace(np.array([0.0]), np.array([prompt]), np.array([3])),
                 colocated_cluster(1, budget, **MODEL))
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]
    expected_ttft = sum(INSTANCE.mixed_step_s(0, 0, [chunk]) for chunk in chunks)
    assert result.ttft_s[0] == pytest.approx(expected_ttft)
    unchunked = run(Trace(np.array([0.0]), np.array([prompt]), np.array([3])),
                    colocated_cluster(1, 8192, **MODEL))
    assert unchunked.ttft_s[0] == pytest.approx(INSTANCE.prefill_s([prompt]))
    assert result.ttft_s[0] > unchunked.ttft_s[0]  # each chunk pays the step overhead again


def test_a_prompt_slows_the_running_batch_instead_of_stalling_it() -> None:
    trace = two_requests(second_arrival_s=0.3)
    chunked = run(trace, colocated_cluster(1, 512, **MODEL))
    alone = run(Trace(trace.arrival_s[:1], trace.prompt_tokens[:1], trace.output_tokens[:1]),
                colocated_cluster(1, 512, **MODEL))
    stalled = run(trace, ClusterSpec(0, 1, **MODEL))  # local prefill as a step of its own
    assert np.all(chunked.status == RequestStatus.COMPLETED)
    # The first request's decode steps carry the second's chunks: slower than alone...
    assert chunked.tpot_s[0] > alone.tpot_s[0]
    # ... and the second's prompt takes longer than one stalled prefill step would.
    assert chunked.ttft_s[1] > stalled.ttft_s[1] - 1e-9


def test_the_token_budget_trades_ttft_for_tpot() -> None:
    trace = synthetic_trace(1500, 12.0, seed=3, prompt=LengthSpec(1500, 1.0, 1, 8000),
                            output=LengthSpec(120, 1.0, 2, 1000))
    small = run(trace, colocated_cluster(2, 256, **MODEL))
    large = run(trace, colocated_cluster(2, 4096, **MODEL))
    done = (small.status == RequestStatus.COMPLETED) & (large.status == RequestStatus.COMPLETED)
    assert done.mean() > 0.99
    assert np.median(small.ttft_s[done]) > np.median(large.ttft_s[done])
    assert np.percentile(small.tpot_s[done], 99) < np.percentile(large.tpot_s[done], 99)


def test_colocated_conserves_requests_blocks_and_tickets_through_a_failure() -> None:
    trace = synthetic_trace(2000, 30.0, seed=5, prompt=LengthSpec(1500, 1.0, 1, 16_000),
                            output=LengthSpec(120, 1.0, 1, 2000))
    result = run(trace, colocated_cluster(3, 1024, **MODEL), failures=(Failure(20.0, "d1"),))
    assert_conserved(result)
    assert (result.status == RequestStatus.COMPLETED).mean() > 0.9
    assert (result.status == RequestStatus.FAILED).sum() > 0  # the failure hit running work


def test_chunk_budget_must_not_be_negative() -> None:
    with pytest.raises(InvalidArgumentError, match="chunked_prefill_tokens"):
        ClusterSpec(0, 1, chunked_prefill_tokens=-1)
