"""Conditional disaggregation, live, as an operator sees it: ``pdserve up`` runs; its router's
local-prefill decisions (each response's ``timing.is_local_prefill``) follow the threshold the
governor publishes (``pdserve governor threshold --pin`` / ``--unpin``, then the threshold the
governor computes) without a restart. Waits poll the decision with a deadline; nothing is timed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import router_pb2, router_pb2_grpc

from .conftest import ServiceProcess, run_cli

pytestmark = pytest.mark.timeout(240)

MODEL = "llama-3.1-8b"
SETTING_TOKENS = 1000
"""The router's own threshold: not a multiple of 16, so never one the governor computes."""
FOLLOW_TIMEOUT_S = 30.0
"""Longest wait for the router to apply a new threshold (it reads them every second)."""


@pytest.fixture(scope="module")
def stack(processes: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    up = ServiceProcess("pdserve-up", [
        "up", "--grpc-port", "0", "--http-port", "-1", "--speedup", "100",
        "--num-prefill", "1", "--num-decode", "1", "--autoscale-interval-s", "1",
        "--local-prefill-threshold-tokens", str(SETTING_TOKENS),
        "--is-shedding-enabled", "false"])
    processes.append(up.start())
    up.wait_ready()
    yield up


def _is_local(stack: ServiceProcess, num_prompt_tokens: int) -> bool:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        last = None
        for chunk in stub.Generate(router_pb2.GenerateRequest(
                model=MODEL, prompt_token_ids=[65 + i % 26 for i in range(num_prompt_tokens)],
                sampling=pb.SamplingParams(max_tokens=4)), timeout=60):
            last = chunk
    assert last is not None
    return last.timing.is_local_prefill


def _threshold_cli(stack: ServiceProcess, *args: str) -> dict[str, object]:
    done = run_cli(["governor", "threshold", "--address", stack.grpc_address,
                    "--deployment", MODEL, "--json", *args])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _until_decided(stack: ServiceProcess, num_prompt_tokens: int, is_local: bool) -> bool:
    """Send the prompt until the router decides ``is_local`` for it or the deadline passes;
    returns the last decision."""
    deadline = time.monotonic() + FOLLOW_TIMEOUT_S
    while True:
        decided = _is_local(stack, num_prompt_tokens)
        if decided is is_local or time.monotonic() >= deadline:
            return decided
        time.sleep(0.3)


def test_a_pin_changes_the_routers_decisions_without_a_restart(stack: ServiceProcess) -> None:
    assert _is_local(stack, 500), "the router's own setting (1000) prefills 500 tokens locally"
    pinned = _threshold_cli(stack, "--pin", "0")
    assert (pinned["threshold_tokens"], pinned["source"]) == (0, "pinned")
    assert _until_decided(stack, 500, False) is False, "the pin did not reach the router"
    assert _threshold_cli(stack)["source"] == "pinned"  # the governor's passes keep the pin
    pid = stack.pid
    _threshold_cli(stack, "--pin", "2048")
    assert _until_decided(stack, 1500, True) is True
    assert stack.pid == pid and stack.returncode is None


def test_a_computed_threshold_changes_the_routers_decisions(stack: ServiceProcess) -> None:
    for _ in range(5):  # demand for the governor's next pass (it computes even while pinned)
        _is_local(stack, 300)
    deadline = time.monotonic() + FOLLOW_TIMEOUT_S
    while True:
        shown = _threshold_cli(stack)
        if shown["computed_tokens"] is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    assert shown["computed_tokens"] is not None, f"the governor computed nothing: {shown}"
    unpinned = _threshold_cli(stack, "--unpin")
    assert unpinned["source"] == "computed"
    computed = unpinned["threshold_tokens"]
    assert isinstance(computed, int) and computed != SETTING_TOKENS
    assert unpinned["inputs"]["num_requests"] > 0  # the inputs of the value it restores
    # A prompt length the computed threshold and the router's setting decide differently.
    low, high = sorted((computed, SETTING_TOKENS))
    for length in (low + 1, high):
        expected = length <= computed
        assert _until_decided(stack, length, expected) is expected, (length, computed)
