"""Roofline performance model and its calibration (synthetic profiles, and the SplitwiseSim CSV)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.errors import InvalidArgumentError
from pdserve.perf import calibration as cal
from pdserve.perf.catalog import default_catalog, get_gpu, get_model
from pdserve.perf.kv_budget import kv_bytes_per_token
from pdserve.perf.perf_model import (
    Efficiency,
    PerfModel,
    calibrated_efficiency,
    perf_model_for,
)

CASES = [("llama-3.1-8b", "h100", 1), ("llama-3.1-70b", "h100", 4), ("qwen2.5-7b", "a100-80g", 2),
         ("qwen2.5-72b", "h200", 8), ("mixtral-8x7b", "h100", 2), ("deepseek-v3", "h200", 8),
         ("llama2-70b", "a100-80gb", 2), ("bloom-176b", "h100-80gb-pcap", 8),
         ("llama-3.1-70b", "b200", 2), ("llama-3.1-8b", "a100-40g", 1), ("mixtral", "h800", 8)]


def _model(case: tuple[str, str, int], efficiency: Efficiency | None = None) -> PerfModel:
    return perf_model_for(*case, efficiency=efficiency)


@pytest.mark.parametrize("case", CASES)
def test_prefill_time_grows_with_tokens_and_prompts(case: tuple[str, str, int]) -> None:
    perf = _model(case)
    times = [perf.prefill_time_s([n]) for n in (1, 64, 512, 2048, 8192, 32768)]
    assert all(a < b for a, b in zip(times, times[1:], strict=False))
    batches = [perf.prefill_time_s([512] * b) for b in (1, 2, 8, 32)]
    assert all(a < b for a, b in zip(batches, batches[1:], strict=False))
    assert perf.prefill_time_s([]) == 0.0


@pytest.mark.parametrize("case", CASES)
def test_decode_step_grows_with_context_and_batch(case: tuple[str, str, int]) -> None:
    perf = _model(case)
    by_context = [perf.decode_step_time_s(32, 32 * c) for c in (128, 1024, 8192, 65536)]
    assert all(a < b for a, b in zip(by_context, by_context[1:], strict=False))
    by_batch = [perf.decode_step_time_s(b, b * 2048) for b in (1, 8, 64, 256)]
    assert all(a < b for a, b in zip(by_batch, by_batch[1:], strict=False))
    assert perf.decode_step_time_s(0, 0) == 0.0


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(min_value=1, max_value=20_000), min_size=1, max_size=16),
       extra=st.integers(min_value=1, max_value=4096))
def test_adding_a_prompt_never_makes_prefill_faster(lens: list[int], extra: int) -> None:
    perf = _model(CASES[1])
    assert perf.prefill_time_s([*lens, extra]) > perf.prefill_time_s(lens)


def test_attention_makes_one_long_prompt_dearer_than_many_short_ones() -> None:
    perf = _model(CASES[1], Efficiency())
    assert perf.prefill_time_s([32768]) > perf.prefill_time_s([512] * 64)


def test_mean_prefill_time_from_two_moments_is_the_mean_over_the_prompts() -> None:
    perf = perf_model_for("llama-3.1-70b", "h100", 4)
    rng = np.random.default_rng(3)
    prompts = np.clip(rng.lognormal(np.log(4000), 1.0, 2000), 600, 60_000).astype(int)
    eff = perf.efficiency

    def is_compute_bound(prompt: int) -> bool:
        work = perf.prefill_work([prompt])
        return (work.flops / (perf.peak_flops_per_s * eff.prefill_mfu)
                > work.memory_bytes / (perf.gpu.hbm_bytes_per_s * eff.mbu))
    assert all(is_compute_bound(int(p)) for p in prompts)  # where the two moments are exact
    exact = float(np.mean([perf.prefill_time_s([int(p)]) for p in prompts]))
    mean, mean_squared = float(prompts.mean()), float(np.mean(prompts.astype(float) ** 2))
    assert perf.mean_prefill_time_s(mean, mean_squared) == pytest.approx(exact, rel=1e-9)
    # The mean prompt alone is well under it: the tail's attention is what it misses.
    assert perf.prefill_time_s([round(mean)]) < 0.97 * exact
    # No mean square (or one below the mean's square, impossible): a prompt of the mean length.
    assert perf.mean_prefill_time_s(mean) == pytest.approx(perf.mean_prefill_time_s(mean, 1.0))
    assert perf.mean_prefill_time_s(mean) == pytest.approx(perf.prefill_time_s([round(mean)]),
                                                          rel=1e-3)
    assert perf.mean_prefill_time_s(0.0, 5.0) == 0.0
    # Weighted by the prompt's length (the KV a prompt holds while it is prefilled), from three.
    as_float = prompts.astype(float)
    weighted = float(np.mean([p * perf.prefill_time_s([int(p)]) for p in prompts]) / mean)
    cubed = float(np.mean(as_float ** 3))
    assert perf.token_weighted_prefill_time_s(mean, mean_squared, cubed) == pytest.approx(
        weighted, rel=1e-9)
    assert weighted > 1.2 * exact  # long prompts take longer and hold more
    # Without a third moment: the least the first two allow, so never above the exact value.
    assert perf.token_weighted_prefill_time_s(mean, mean_squared) < weighted
    assert perf.token_weighted_prefill_time_s(mean) == pytest.approx(
        perf.mean_prefill_time_s(mean), rel=1e-12)
    assert perf.token_weighted_prefill_time_s(0.0, 1.0, 1.0) == 0.0


def test_decode_is_memory_bound_at_batch_one_and_tp_shortens_it() -> None:
    model, gpu = get_model("llama-3.1-70b"), get_gpu("h100")
    times = [PerfModel(model, gpu, tp).decode_step_time_s(1, 1000) for tp in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(times, times[1:], strict=False))
    weights_s = model.num_params * model.dtype_bytes / (gpu.hbm_bytes_per_s * Efficiency().mbu)
    assert times[0] > weights_s


def test_fp8_weights_use_the_fp8_peak_where_the_gpu_has_one() -> None:
    deepseek, llama = get_model("deepseek-v3"), get_model("llama-3.1-70b")
    h200, a100 = get_gpu("h200"), get_gpu("a100-80g")
    assert PerfModel(deepseek, h200, 8).peak_flops_per_s == h200.peak_fp8_flops_per_s
    assert PerfModel(llama, h200, 8).peak_flops_per_s == h200.peak_bf16_flops_per_s
    assert PerfModel(deepseek, a100, 8).peak_flops_per_s == a100.peak_bf16_flops_per_s


def test_moe_small_batches_read_only_the_experts_they_touch() -> None:
    perf = _model(("mixtral-8x7b", "h100", 1))
    model = perf.model
    total_bytes = model.num_params * model.dtype_bytes
    one = perf.decode_work(1, 1000).memory_bytes - 1000 * perf.kv_bytes_per_token_per_gpu
    many = perf.decode_work(512, 1000).memory_bytes - 1000 * perf.kv_bytes_per_token_per_gpu
    assert one == pytest.approx(model.num_active_params * model.dtype_bytes, rel=0.01)
    assert many == pytest.approx(total_bytes, rel=0.01)


def test_prompt_kv_bytes_follow_the_capacity_model() -> None:
    perf = _model(("llama-3.1-70b", "h100", 4))
    per_gpu = kv_bytes_per_token(perf.model, 4)
    assert perf.prompt_kv_bytes_per_gpu(1000) == 1000 * per_gpu
    assert perf.prompt_kv_bytes(1000) == 4 * 1000 * per_gpu
    assert perf.kv_transfer_time_s(1000) == pytest.approx(1000 * per_gpu / perf.gpu.nic_bytes_per_s)


@pytest.mark.parametrize("case", CASES[:6])
def test_work_terms_reproduce_the_hot_path(case: tuple[str, str, int]) -> None:
    perf = _model(case)
    lens = [300, 2000, 7]
    assert perf.time_for_s(perf.prefill_work(lens), is_prefill=True) == pytest.approx(
        perf.prefill_time_s(lens), rel=1e-12)
    assert perf.time_for_s(perf.decode_work(24, 50_000), is_prefill=False) == pytest.approx(
        perf.decode_step_time_s(24, 50_000), rel=1e-12)


def test_vectorised_calibration_predictions_match_the_hot_path() -> None:
    perf = _model(("llama2-70b", "a100-80gb", 4))
    samples = [cal.ProfileSample("llama-2-70b", "a100-sxm-80gb",
                                 cal.ProfilePoint(cal.Phase.PREFILL, 700, 3, 1.0, 4)),
               cal.ProfileSample("llama-2-70b", "a100-sxm-80gb",
                                 cal.ProfilePoint(cal.Phase.DECODE, 900, 16, 1.0, 4))]
    predicted = cal.predict_s(samples, perf.efficiency)
    assert predicted[0] == pytest.approx(perf.prefill_time_s([700] * 3), rel=1e-12)
    assert predicted[1] == pytest.approx(perf.decode_step_time_s(16, 16 * 900), rel=1e-12)


@pytest.mark.parametrize("bad", [{"prefill_mfu": 0.0}, {"mbu": 1.2}, {"decode_overhead_s": -1.0}])
def test_bad_efficiency_is_rejected(bad: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        Efficiency(**bad)


def test_bad_names_and_tp_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="known GPUs"):
        perf_model_for("llama-3.1-8b", "v100")
    with pytest.raises(InvalidArgumentError, match="tp_size 3"):
        perf_model_for("llama-3.1-8b", "h100", 3)


def test_calibrated_factors_are_found_by_pair_gpu_or_proxy() -> None:
    assert calibrated_efficiency("llama2-70b", "a100-80gb")[1] == (
        "model_gpu:llama-2-70b:a100-sxm-80gb")
    assert calibrated_efficiency("llama-3.1-70b", "h100")[1] == "gpu:h100-sxm-80gb"
    assert calibrated_efficiency("qwen2.5-7b", "h200")[1] == "gpu:h100-sxm-80gb"
    assert calibrated_efficiency("llama-3.1-8b", "a100-40g")[1] == "gpu:a100-sxm-80gb"
    factors, _ = calibrated_efficiency("llama2-70b", "h100")
    assert factors != Efficiency()


# -- fitting -----------------------------------------------------------------------------------

TRUTH = Efficiency(prefill_mfu=0.38, decode_mfu=0.2, mbu=0.62, prefill_overhead_s=0.02,
                   decode_overhead_s=0.006, allreduce_latency_s=5e-6, link_efficiency=0.7)


def _synthetic_profile(perf: PerfModel) -> tuple[list, list]:
    truth = perf.with_efficiency(TRUTH)
    prefill = [(n, b, truth.prefill_time_s([n] * b)) for n in (128, 512, 2048, 8192)
               for b in (1, 4)]
    decode = [(c, b, truth.decode_step_time_s(b, b * c)) for c in (256, 4096)
              for b in (1, 16, 64, 256)]
    return prefill, decode


def test_worker_profile_fit_recovers_the_factors_that_generated_it() -> None:
    perf = _model(("llama-3.1-8b", "h100", 1))
    prefill, decode = _synthetic_profile(perf)
    fitted = cal.fit_worker_profile("llama-3.1-8b", "h100", 1, prefill, decode)
    refit = perf.with_efficiency(fitted)
    for n, b, measured in prefill:
        assert refit.prefill_time_s([n] * b) == pytest.approx(measured, rel=0.03)
    for c, b, measured in decode:
        assert refit.decode_step_time_s(b, b * c) == pytest.approx(measured, rel=0.03)
    assert fitted.prefill_mfu == pytest.approx(TRUTH.prefill_mfu, rel=0.1)
    assert fitted.mbu == pytest.approx(TRUTH.mbu, rel=0.1)


def test_profile_of_one_phase_leaves_the_other_phase_alone() -> None:
    perf = _model(("llama-3.1-8b", "h100", 1))
    prefill, _ = _synthetic_profile(perf)
    start, _ = calibrated_efficiency("llama-3.1-8b", "h100")
    fitted = cal.fit_worker_profile("llama-3.1-8b", "h100", 1, prefill_points=prefill)
    assert (fitted.decode_mfu, fitted.decode_overhead_s) == (start.decode_mfu,
                                                             start.decode_overhead_s)
    assert fitted.allreduce_latency_s == start.allreduce_latency_s  # one TP size: not fitted


def test_bad_profile_points_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        cal.fit_worker_profile("llama-3.1-8b", "h100", 1, prefill_points=[(512, 1, 0.0)])
    with pytest.raises(InvalidArgumentError, match="no profile points"):
        cal.fit_worker_profile("llama-3.1-8b", "h100", 1)


# -- the SplitwiseSim profile ----------------------------------------------------------------


@pytest.fixture(scope="module")
def splitwise(shared_data_dir: Path | None) -> tuple[list, cal.CalibrationResult]:
    path = (shared_data_dir / "traces" / "splitwise_sim_perf_model.csv"
            if shared_data_dir else None)
    if path is None or not path.exists():
        pytest.skip("shared/data/traces/splitwise_sim_perf_model.csv is absent")
    samples = cal.load_splitwise_csv(path)
    return samples, cal.calibrate(samples)


def _mean_abs_log_error(samples: list, efficiency: Efficiency, phase: cal.Phase) -> float:
    chosen = [s for s in samples if s.point.phase is phase]
    measured = np.array([s.point.measured_s for s in chosen])
    return float(np.mean(np.abs(np.log(cal.predict_s(chosen, efficiency) / measured))))


def test_calibration_lowers_the_error_of_every_phase(splitwise) -> None:
    _, result = splitwise
    for (phase, before), (_, after) in zip(result.overall_before, result.overall_after,
                                           strict=True):
        assert after.median < before.median, phase
        assert after.p90 < before.p90, phase


def test_each_model_gpu_fit_beats_the_defaults_on_its_own_points(splitwise) -> None:
    samples, result = splitwise
    for model_name, gpu_name, fitted in result.by_model_gpu:
        pair = [s for s in samples if (s.model_name, s.gpu_name) == (model_name, gpu_name)]
        for phase in cal.Phase:
            assert (_mean_abs_log_error(pair, fitted, phase)
                    < _mean_abs_log_error(pair, Efficiency(), phase)), (model_name, gpu_name)


def test_shipped_factors_are_as_good_as_a_fresh_fit(splitwise) -> None:
    """Guards catalog/efficiency.json against going stale when the model changes
    (regenerate with ``bench/calibration.py --write-catalog``)."""
    samples, result = splitwise
    shipped = {(e["model"], e["gpu"]): Efficiency(**e["factors"])
               for e in default_catalog().efficiency["by_model_gpu"]}
    for model_name, gpu_name, fresh in result.by_model_gpu:
        pair = [s for s in samples if (s.model_name, s.gpu_name) == (model_name, gpu_name)]
        for phase in cal.Phase:
            assert _mean_abs_log_error(pair, shipped[(model_name, gpu_name)], phase) <= (
                _mean_abs_log_error(pair, fresh, phase) * 1.05 + 0.005)


def test_fitted_factors_are_physical(splitwise) -> None:
    _, result = splitwise
    for _, _, efficiency in result.by_model_gpu:
        values = dataclasses.asdict(efficiency)
        assert 0.2 < values["prefill_mfu"] <= 1.0 and 0.2 < values["mbu"] <= 1.0
        assert values["prefill_overhead_s"] < 0.1 and values["decode_overhead_s"] < 0.05
