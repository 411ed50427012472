"""The pure routing policy: decode choice by KV room and pressure, local vs remote prefill,
prefill choice by queued plus uncached tokens."""

from __future__ import annotations

import pytest

from pdserve.common.errors import CapacityError, UnavailableError
from pdserve.router.policy import (
    DecodeCandidate,
    PrefillCandidate,
    RouteRequest,
    RoutingConfig,
    num_blocks_to_reserve,
    route,
)
from pdserve.router.types import PrefillMode

CONFIG = RoutingConfig(local_prefill_threshold_tokens=32, prefill_saturation_tokens=10_000)


def decode(worker_id: str, free: int, total: int = 1000, running: int = 0,
           cached: int = 0) -> DecodeCandidate:
    return DecodeCandidate(worker_id, free, total, running, 16, cached)


def test_reservation_covers_prompt_and_max_tokens_rounded_up_to_blocks() -> None:
    assert num_blocks_to_reserve(RouteRequest(100, 20), 16, CONFIG) == 8  # ceil(120 / 16)
    assert num_blocks_to_reserve(RouteRequest(16, 16), 16, CONFIG) == 2
    expected = RoutingConfig(growth_policy_max_tokens=False, expected_output_tokens=4)
    assert num_blocks_to_reserve(RouteRequest(100, 20), 16, expected) == 7  # ceil(104 / 16)


def test_decode_prefers_free_memory_and_skips_workers_without_room() -> None:
    request = RouteRequest(num_prompt_tokens=1000, max_tokens=100)  # 69 blocks
    decision = route(request, [decode("a", 60), decode("b", 500), decode("c", 300)],
                     [PrefillCandidate("p", 0)], CONFIG)
    assert decision.decode_worker_id == "b"
    assert decision.num_blocks == 69


def test_batch_pressure_breaks_near_ties_in_memory() -> None:
    request = RouteRequest(1000, 10)
    decision = route(request, [decode("busy", 510, running=250), decode("idle", 500, running=0)],
                     [PrefillCandidate("p", 0)], CONFIG)
    assert decision.decode_worker_id == "idle"


def test_no_room_anywhere_is_resource_exhausted_with_retry_hint() -> None:
    with pytest.raises(CapacityError) as info:
        route(RouteRequest(1000, 100), [decode("a", 10), decode("b", 20)], [], CONFIG)
    assert info.value.retry_after_s > 0


def test_no_decode_worker_is_unavailable() -> None:
    with pytest.raises(UnavailableError):
        route(RouteRequest(10, 10), [], [PrefillCandidate("p", 0)], CONFIG)


def test_short_prompt_prefills_locally_long_prompt_remotely() -> None:
    decoders = [decode("d", 900)]
    prefillers = [PrefillCandidate("p", 0)]
    assert route(RouteRequest(20, 10), decoders, prefillers, CONFIG).is_local_prefill
    remote = route(RouteRequest(500, 10), decoders, prefillers, CONFIG)
    assert remote.prefill_worker_id == "p" and not remote.is_local_prefill


def test_prompt_mostly_cached_on_the_decode_worker_prefills_locally() -> None:
    decision = route(RouteRequest(500, 10), [decode("d", 900, cached=480)],
                     [PrefillCandidate("p", 0)], CONFIG)
    assert decision.is_local_prefill and decision.reason == "short prompt"


def test_saturated_prefill_pool_falls_back_to_local() -> None:
    decision = route(RouteRequest(500, 10), [decode("d", 900)],
                     [PrefillCandidate("p1", 20_000), PrefillCandidate("p2", 15_000)], CONFIG)
    assert decision.is_local_prefill and decision.reason == "prefill pool saturated"


def test_forced_modes() -> None:
    decoders, prefillers = [decode("d", 900)], [PrefillCandidate("p", 50_000)]
    assert not route(RouteRequest(5, 1, PrefillMode.REMOTE), decoders, prefillers,
                     CONFIG).is_local_prefill
    assert route(RouteRequest(5000, 1, PrefillMode.LOCAL), decoders, prefillers,
                 CONFIG).is_local_prefill
    with pytest.raises(UnavailableError):
        route(RouteRequest(5, 1, PrefillMode.REMOTE), decoders, [], CONFIG)


def test_prefill_choice_weighs_prefix_overlap_against_queue() -> None:
    request = RouteRequest(4000, 10)
    prefillers = [
        PrefillCandidate("cold", num_queued_prefill_tokens=0),
        PrefillCandidate("warm", num_queued_prefill_tokens=1000, num_cached_prefix_tokens=3500),
        PrefillCandidate("warm-but-busy", num_queued_prefill_tokens=9000,
                         num_cached_prefix_tokens=4000),
    ]
    assert route(request, [decode("d", 900)], prefillers, CONFIG).prefill_worker_id == "warm"


def test_excluded_workers_are_not_chosen_again() -> None:
    request = RouteRequest(500, 10)
    decision = route(request, [decode("d1", 900), decode("d2", 100)],
                     [PrefillCandidate("p1", 0), PrefillCandidate("p2", 5)], CONFIG,
                     excluded=frozenset({"d1", "p1"}))
    assert (decision.decode_worker_id, decision.prefill_worker_id) == ("d2", "p2")
