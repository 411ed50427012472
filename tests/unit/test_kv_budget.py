"""KV capacity: vLLM's block arithmetic, GQA replication, MLA, length distributions, bad input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import get_gpu, get_model
from pdserve.perf.kv_budget import (
    GIB,
    CapacityConfig,
    RankMemory,
    capacity_report,
    kv_bytes_per_token,
    kv_heads_per_gpu,
    weights_bytes_per_gpu,
)


def _gib(value: float) -> int:
    return round(value * GIB)


def test_reproduces_vllm_startup_log_for_llama3_8b_on_a100() -> None:
    """vLLM logged, for Llama-3-8B on an A100 (39.50 GiB total, utilisation 0.9, weights 14.96
    GiB, non-torch 0.10 GiB, activation peak 9.37 GiB): KV cache 11.12 GiB, 5,691 blocks of 16
    tokens, "maximum concurrency for 8,192 tokens per request: 11.12x". Its GiB figures are
    rounded to 0.01, so agreement within 0.1% is the best the log allows."""
    model = get_model("llama-3-8b")
    rank = RankMemory(total_memory_bytes=_gib(39.50), weights_bytes=_gib(14.96),
                      activation_peak_bytes=_gib(9.37), non_torch_bytes=_gib(0.10))
    config = CapacityConfig(tp_size=1, block_size_tokens=16, gpu_memory_utilization=0.9,
                            max_model_len=8192)
    report = capacity_report(model, get_gpu("a100-40g"), config, rank_memories=(rank,))
    assert report.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert report.kv_pool_bytes / GIB == pytest.approx(11.12, abs=0.005)
    assert abs(report.num_blocks - 5691) / 5691 < 0.001
    assert f"{report.max_concurrency:.2f}" == "11.12"
    assert report.num_tokens == report.num_blocks * 16


def _report_holding(num_full_sequences: int, full_length: int, block_size: int):
    """A report whose pool is exactly ``num_full_sequences`` sequences of ``full_length``."""
    model = get_model("llama-3.1-8b")
    bytes_per_token = kv_bytes_per_token(model)
    weights = weights_bytes_per_gpu(model)
    rank = RankMemory(total_memory_bytes=weights + num_full_sequences * full_length
                      * bytes_per_token, weights_bytes=weights, activation_peak_bytes=0,
                      non_torch_bytes=0)
    config = CapacityConfig(block_size_tokens=block_size, gpu_memory_utilization=1.0,
                            max_model_len=full_length)
    return capacity_report(model, get_gpu("h100"), config, rank_memories=(rank,))


def test_47_full_8k_sequences_become_385_requests_of_1k_tokens() -> None:
    exact = _report_holding(47, 8192, block_size=1)
    assert exact.max_concurrency == pytest.approx(47)
    assert exact.num_requests_for_lengths([1000]) == 385


def test_block_rounding_turns_385_into_381() -> None:
    """1,000 tokens hold ceil(1000/16) = 63 blocks of 16, i.e. 1,008 token slots each."""
    rounded = _report_holding(47, 8192, block_size=16)
    assert rounded.max_concurrency == pytest.approx(47)
    assert rounded.num_requests_for_lengths([1000]) == 381


def test_length_distribution_uses_mean_blocks_per_request() -> None:
    report = _report_holding(10, 4096, block_size=16)
    lengths = [100, 1000, 3000]
    mean_blocks = sum(math.ceil(n / 16) for n in lengths) / len(lengths)
    assert report.num_requests_for_lengths(lengths) == math.floor(report.num_blocks / mean_blocks)
    assert (report.num_requests_for_lengths([100]) > report.num_requests_for_lengths(lengths)
            > report.num_requests_for_lengths([3000]))


@given(length=st.integers(min_value=1, max_value=100_000),
       block_size=st.sampled_from([1, 8, 16, 32, 128]))
def test_concurrency_at_one_length_is_blocks_over_blocks_per_request(length: int,
                                                                     block_size: int) -> None:
    report = _report_holding(3, 8192, block_size=block_size)
    blocks = -(-length // block_size)
    assert report.max_concurrency_at(length) == pytest.approx(report.num_blocks / blocks)
    assert report.num_requests_for_lengths([length]) == report.num_blocks // blocks


def test_kv_heads_are_sharded_then_replicated_beyond_the_kv_head_count() -> None:
    model = get_model("llama-3.1-70b")  # 64 heads, 8 KV heads
    assert [kv_heads_per_gpu(model, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert kv_bytes_per_token(model, 2) == kv_bytes_per_token(model, 1) // 2
    assert kv_bytes_per_token(model, 16) == kv_bytes_per_token(model, 8)
    assert kv_bytes_per_token(model, 8) == 2 * model.num_layers * model.head_dim * 2


def test_mla_bytes_per_token_are_the_latent_and_replicated_on_every_rank() -> None:
    model = get_model("deepseek-v3")
    expected = 61 * (512 + 64) * model.kv_dtype_bytes
    assert kv_bytes_per_token(model, 1) == expected
    assert kv_bytes_per_token(model, 8) == expected


@pytest.mark.parametrize(("name", "tp"), [("qwen2.5-7b", 8), ("bloom-176b", 3)])
def test_tp_that_does_not_divide_the_heads_is_rejected(name: str, tp: int) -> None:
    model = get_model(name)
    with pytest.raises(InvalidArgumentError) as error:
        kv_bytes_per_token(model, tp)
    assert str(tp) in error.value.message
    assert str(model.num_attention_heads) in error.value.message
    assert error.value.field == "tp_size"


def test_tp_neither_dividing_nor_a_multiple_of_kv_heads_is_rejected() -> None:
    model = get_model("qwen2.5-7b")  # 28 heads, 4 KV heads: TP 7 divides 28 but not 4
    with pytest.raises(InvalidArgumentError, match="4 KV heads"):
        kv_bytes_per_token(model, 7)


def test_model_that_does_not_fit_names_model_gpu_and_bytes() -> None:
    model = get_model("llama-3.1-70b")
    with pytest.raises(InvalidArgumentError) as error:
        capacity_report(model, get_gpu("a100-40g"), CapacityConfig(tp_size=1))
    message = error.value.message
    assert "llama-3.1-70b" in message and "a100-sxm-40gb" in message
    assert str(weights_bytes_per_gpu(model, 1)) in message


def test_estimated_capacity_grows_with_tp_and_fits_large_models() -> None:
    model, gpu = get_model("llama-3.1-70b"), get_gpu("h100")
    reports = [capacity_report(model, gpu, CapacityConfig(tp_size=tp)) for tp in (2, 4, 8)]
    assert reports[0].num_blocks < reports[1].num_blocks < reports[2].num_blocks
    deepseek = capacity_report(get_model("deepseek-v3"), get_gpu("h200"),
                               CapacityConfig(tp_size=8))
    assert deepseek.num_blocks > 0


def test_instance_capacity_is_the_minimum_over_ranks() -> None:
    model = get_model("llama-3.1-8b")
    roomy = RankMemory(80 * GIB, weights_bytes_per_gpu(model, 2), GIB, GIB)
    tight = RankMemory(80 * GIB, weights_bytes_per_gpu(model, 2), GIB, 5 * GIB)
    config = CapacityConfig(tp_size=2)
    both = capacity_report(model, get_gpu("h100"), config, rank_memories=(roomy, tight))
    only_tight = capacity_report(model, get_gpu("h100"), config, rank_memories=(tight,))
    only_roomy = capacity_report(model, get_gpu("h100"), config, rank_memories=(roomy,))
    assert both.num_blocks == only_tight.num_blocks < only_roomy.num_blocks


def test_rank_memories_must_cover_one_or_all_ranks() -> None:
    rank = RankMemory(80 * GIB, GIB, GIB, GIB)
    with pytest.raises(InvalidArgumentError, match="rank_memories"):
        capacity_report(get_model("llama-3.1-8b"), get_gpu("h100"), CapacityConfig(tp_size=4),
                        rank_memories=(rank, rank))


@pytest.mark.parametrize("kwargs", [{"gpu_memory_utilization": 0.0},
                                    {"gpu_memory_utilization": 1.5},
                                    {"block_size_tokens": 0}, {"max_model_len": 0}])
def test_bad_config_values_are_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        CapacityConfig(**kwargs)
    assert error.value.field == next(iter(kwargs))
