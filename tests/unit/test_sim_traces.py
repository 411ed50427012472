"""Trace loading, prefix-hash mapping, scaling and generators for the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.common.errors import InvalidArgumentError
from pdserve.sim.traces import (
    DayDemand,
    DayShape,
    LengthSpec,
    Trace,
    load_trace,
    parse_azure_csv,
    parse_mooncake_jsonl,
    rate_scale,
    synthetic_trace,
    time_scale,
)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319601,3180,8
2023-11-16 23:59:59.9999999,110,27
2023-11-17 00:00:00.5000000,7433,14
"""


def _mooncake(rows: list[dict[str, object]]) -> list[str]:
    return [json.dumps(row) + "\n" for row in rows]


def test_azure_rows_become_seconds_from_the_first_with_every_fractional_digit() -> None:
    trace = parse_azure_csv(AZURE.splitlines(keepends=True))
    assert trace.num_requests == 4
    assert trace.prompt_tokens.tolist() == [4808, 3180, 110, 7433]
    assert trace.output_tokens.tolist() == [10, 8, 27, 14]
    assert trace.arrival_s[0] == 0.0
    assert trace.arrival_s[1] == pytest.approx(0.0520001, abs=1e-9)  # the 7th digit survives
    # Across midnight: 18:17:03.97996 -> 00:00:00.5 next day.
    assert trace.arrival_s[3] == pytest.approx(86400 - (18 * 3600 + 17 * 60 + 3.97996) + 0.5)


def test_azure_accepts_utc_suffixes_and_sorts_unsorted_rows() -> None:
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2024-05-10 00:00:02.000000+00:00,10,1\n"
            "2024-05-10 00:00:01.000000+00:00,20,2\n")
    trace = parse_azure_csv(text.splitlines())
    assert trace.arrival_s.tolist() == [0.0, 1.0]
    assert trace.prompt_tokens.tolist() == [20, 10]


@pytest.mark.parametrize("bad_row", [
    "2023-11-16 18:17:04.1,abc,3",          # non-numeric tokens
    "2023-11-16 18:17:04.1,12",             # missing column
    "2023-11-16 25:17:04.1,12,3",           # hour out of range
    "yesterday,12,3",                       # not a timestamp
    "2023-11-16 18:17:04.1,12,0",           # zero output tokens
])
def test_a_malformed_azure_row_names_its_line(bad_row: str) -> None:
    lines = AZURE.splitlines()[:3] + [bad_row]
    with pytest.raises(InvalidArgumentError, match="line 4"):
        parse_azure_csv(lines)


def test_azure_needs_its_header() -> None:
    with pytest.raises(InvalidArgumentError, match="line 1"):
        parse_azure_csv(["a,b,c", "1,2,3"])


def test_mooncake_rows_keep_lengths_times_and_hash_ids() -> None:
    trace = parse_mooncake_jsonl(_mooncake([
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [0, 3]},
    ]))
    assert trace.arrival_s.tolist() == [0.0, 1.5]
    assert trace.prompt_tokens.tolist() == [1100, 600]
    assert trace.has_prefix_hashes
    assert trace.hash_ids.tolist() == [0, 1, 2, 0, 3]  # type: ignore[union-attr]


@pytest.mark.parametrize("bad_line", [
    "{not json",
    json.dumps({"timestamp": 1, "input_length": 10}),                                 # no output
    json.dumps({"timestamp": 1, "input_length": 10.5, "output_length": 2}),
    json.dumps({"timestamp": 1, "input_length": 600, "output_length": 2,
                "hash_ids": [1, 2, 3]}),                                              # 3 ids > 2
    json.dumps({"timestamp": 1, "input_length": 600, "output_length": 2,
                "hash_ids": ["x"]}),
])
def test_a_malformed_mooncake_row_names_its_line(bad_line: str) -> None:
    good = _mooncake([{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}])
    with pytest.raises(InvalidArgumentError, match="line 3"):
        parse_mooncake_jsonl([*good, "\n", bad_line + "\n"])


def test_shared_leading_512_hashes_share_exactly_the_matching_engine_blocks() -> None:
    trace = parse_mooncake_jsonl(_mooncake([
        {"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [7, 8, 9]},
        {"timestamp": 1, "input_length": 1500, "output_length": 1, "hash_ids": [7, 8, 5]},
        {"timestamp": 2, "input_length": 1500, "output_length": 1, "hash_ids": [6, 8, 9]},
        {"timestamp": 3, "input_length": 40, "output_length": 1, "hash_ids": [7]},
    ]))
    for block_size in (16, 64, 512):
        a, b, c, short = (trace.engine_block_hashes(i, block_size) for i in range(4))
        assert len(a) == 1500 // block_size  # the partial last block is not hashed
        per_chunk = 512 // block_size
        shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        assert shared == min(2 * per_chunk, len(a))  # ids 7, 8 agree: exactly their blocks match
        assert not set(a) & set(c)  # a different first id: the chain differs from the start
        assert short == a[:40 // block_size]
        assert len(set(a)) == len(a)
        assert a == trace.engine_block_hashes(0, block_size)  # deterministic
    with pytest.raises(InvalidArgumentError, match="block_size_tokens"):
        trace.engine_block_hashes(0, 48)


def test_time_scale_stretches_gaps_and_keeps_requests() -> None:
    trace = synthetic_trace(200, 10.0, seed=1)
    fast = time_scale(trace, 0.25)
    assert np.allclose(np.diff(fast.arrival_s), np.diff(trace.arrival_s) * 0.25)
    assert fast.prompt_tokens.tolist() == trace.prompt_tokens.tolist()
    assert fast.mean_rate_per_s == pytest.approx(4 * trace.mean_rate_per_s)
    with pytest.raises(InvalidArgumentError):
        time_scale(trace, 0.0)


def test_rate_scale_multiplies_the_rate_over_the_same_span() -> None:
    trace = synthetic_trace(4000, 20.0, seed=2, prompt=LengthSpec(500, 1.0))
    thinned = rate_scale(trace, 0.25, seed=3)
    assert abs(thinned.num_requests - 1000) < 100
    assert set(thinned.prompt_tokens.tolist()) <= set(trace.prompt_tokens.tolist())
    scaled = rate_scale(trace, 3.5, seed=3, jitter_s=5.0)
    assert abs(scaled.num_requests - 3.5 * 4000) < 150
    assert scaled.duration_s <= trace.duration_s + 1e-9
    assert scaled.mean_rate_per_s == pytest.approx(3.5 * trace.mean_rate_per_s, rel=0.05)
    assert np.all(np.diff(scaled.arrival_s) >= 0)
    # The envelope survives: per-100 s counts scale by 3.5 (jitter 5 s << 100 s bins).
    bins = np.arange(0, trace.duration_s, 50)[:-1]
    before, _ = np.histogram(trace.arrival_s, bins)
    after, _ = np.histogram(scaled.arrival_s, bins)
    assert np.allclose(after[1:-1] / before[1:-1], 3.5, rtol=0.2)
    # Seeded: the same seed replays the same copies.
    again = rate_scale(trace, 3.5, seed=3, jitter_s=5.0)
    assert np.array_equal(again.arrival_s, scaled.arrival_s)


def test_replayed_copies_do_not_share_prefix_blocks_with_their_original() -> None:
    trace = parse_mooncake_jsonl(_mooncake([
        {"timestamp": i * 1000, "input_length": 1024, "output_length": 1, "hash_ids": [i, 100 + i]}
        for i in range(20)
    ]))
    scaled = rate_scale(trace, 2.0, seed=0, jitter_s=1.0)
    by_row: dict[int, list[tuple[int, ...]]] = {}
    for i in range(scaled.num_requests):
        by_row.setdefault(int(scaled.hash_row[i]), []).append(  # type: ignore[index]
            tuple(scaled.engine_block_hashes(i, 16)))
    assert all(len(v) == 2 and v[0][0] != v[1][0] for v in by_row.values())


def test_synthetic_trace_is_poisson_at_the_rate_and_seeded() -> None:
    trace = synthetic_trace(20_000, 50.0, seed=5, prompt=LengthSpec(1000, 0.5),
                            output=LengthSpec(100))
    gaps = np.diff(trace.arrival_s)
    assert np.mean(gaps) == pytest.approx(1 / 50.0, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert np.mean(trace.prompt_tokens) == pytest.approx(1000, rel=0.03)
    assert set(trace.output_tokens.tolist()) == {100}
    same = synthetic_trace(20_000, 50.0, seed=5, prompt=LengthSpec(1000, 0.5),
                           output=LengthSpec(100))
    other = synthetic_trace(20_000, 50.0, seed=6, prompt=LengthSpec(1000, 0.5),
                            output=LengthSpec(100))
    assert np.array_equal(same.arrival_s, trace.arrival_s)
    assert not np.array_equal(other.arrival_s, trace.arrival_s)


def test_day_envelope_has_its_peak_trough_ratio_and_bursts_rise_over_the_ramp() -> None:
    shape = DayShape(peak_rate_per_s=2.0, peak_to_trough=10.0, peak_hour=14.0)
    calm = DayDemand(shape, ())
    assert float(calm.rate_per_s(14 * 3600.0)) == pytest.approx(2.0)
    assert float(calm.rate_per_s(2 * 3600.0)) == pytest.approx(0.2)
    day = calm.rate_per_s(np.arange(0, 86400, 60.0))
    assert day.max() == pytest.approx(2.0) and day.min() == pytest.approx(0.2, rel=1e-4)
    bursty = DayDemand(shape, (3 * 3600.0, 20 * 3600.0))
    start = 3 * 3600.0
    base = calm.rate_per_s(np.asarray([start + 300, start + 900, start + 1700, start + 2700]))
    boosted = bursty.rate_per_s(np.asarray([start + 300, start + 900, start + 1700, start + 2700]))
    # Halfway up the 10-minute ramp, held at +60% until 30 minutes, back to normal after.
    assert boosted / base == pytest.approx([1.3, 1.6, 1.6, 1.0])


def test_random_bursts_are_seeded_and_apart() -> None:
    shape = DayShape(peak_rate_per_s=1.0)
    one = DayDemand.with_random_bursts(shape, seed=4)
    assert one == DayDemand.with_random_bursts(shape, seed=4)
    assert one != DayDemand.with_random_bursts(shape, seed=5)
    assert len(one.burst_starts_s) == 2
    assert abs(one.burst_starts_s[1] - one.burst_starts_s[0]) > 2400
    assert all(0 <= s <= 86400 - 2400 for s in one.burst_starts_s)


def test_day_sample_follows_the_rate_with_sizes_from_a_trace() -> None:
    demand = DayDemand(DayShape(peak_rate_per_s=0.5, peak_to_trough=10.0, peak_hour=14.0), ())
    sizes = synthetic_trace(500, 1.0, seed=1, prompt=LengthSpec(700, 1.0))
    trace = demand.sample(sizes, seed=9)
    expected = float(np.trapezoid(demand.rate_per_s(np.arange(0, 86401.0)), dx=1.0))
    assert abs(trace.num_requests - expected) < 4 * np.sqrt(expected)
    hourly, _ = np.histogram(trace.arrival_s, np.arange(0, 86401, 3600))
    assert 12 <= int(np.argmax(hourly)) <= 15
    assert 0 <= int(np.argmin(hourly)) <= 4
    assert hourly.max() / hourly.min() > 5
    assert set(trace.prompt_tokens.tolist()) <= set(sizes.prompt_tokens.tolist())
    assert np.array_equal(trace.arrival_s, demand.sample(sizes, seed=9).arrival_s)


def test_real_traces_load_with_their_documented_counts(shared_data_dir: Path | None) -> None:
    if shared_data_dir is None:
        pytest.skip("shared data not present")
    traces = shared_data_dir / "traces"
    conv = load_trace(traces / "azure_llm_2023_conv.csv")
    assert conv.num_requests == 19_366
    assert conv.duration_s == pytest.approx(3502, abs=2)
    assert np.mean(conv.prompt_tokens) == pytest.approx(1155, abs=1)
    moon = load_trace(traces / "mooncake_fast25_conversation_trace.jsonl")
    assert moon.num_requests == 12_031
    assert np.mean(moon.prompt_tokens) == pytest.approx(12_035, abs=1)
    # Prefix sharing: with an infinite cache, about 36.6% of 512-token blocks are hits.
    seen: set[int] = set()
    hits = total = 0
    for i in range(moon.num_requests):
        ids = moon.hash_ids[moon.hash_offsets[i]:moon.hash_offsets[i + 1]].tolist()  # type: ignore[index]
        total += len(ids)
        hits += sum(1 for h in ids if h in seen)
        seen.update(ids)
    assert hits / total == pytest.approx(0.366, abs=0.005)


def test_trace_columns_must_agree() -> None:
    with pytest.raises(InvalidArgumentError):
        Trace(np.zeros(2), np.ones(3, dtype=np.int64), np.ones(2, dtype=np.int64))
    with pytest.raises(InvalidArgumentError):
        Trace(np.zeros(1), np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64))
