"""Calibrate the roofline performance model against the SplitwiseSim measured profile.

Prints, per (model, GPU, TP), the median and p90 absolute relative error of prefill and decode
times before (default efficiency factors) and after calibration (one factor set per model and
GPU, shared by all TP sizes); then the overall error, the error of the per-GPU factor sets (what
models without their own profile get), and a held-out check (fit without one TP size, predict
it). Writes a predicted-vs-measured plot to bench/out/calibration.png. The last line is one JSON
object: median and p90 error per phase after calibration.

    python bench/calibration.py [--csv PATH] [--write-catalog]

``--write-catalog`` stores the fitted factors in the package's catalog/efficiency.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.common.plotting import pyplot
from pdserve.perf import calibration as cal
from pdserve.perf.perf_model import Efficiency, perf_model_for

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CSV = ROOT.parent / "shared" / "data" / "traces" / "splitwise_sim_perf_model.csv"
CATALOG_EFFICIENCY = ROOT / "services" / "pdserve" / "capacity" / "catalog" / "efficiency.json"
OUT_DIR = ROOT / "bench" / "out"


def _pct(value: float) -> str:
    return f"{100 * value:5.1f}%"


def print_table(result: cal.CalibrationResult) -> None:
    rows: dict[tuple[str, str, int], dict[cal.Phase, cal.GroupError]] = {}
    for group in result.groups:
        key = (group.model_name, group.gpu_name, group.tp_size or 0)  # 0: all TP sizes
        rows.setdefault(key, {})[group.phase] = group
    header = (f"{'model':<12} {'gpu':<15} {'tp':>3}|" + "|".join(
        f"{title:^17}" for title in ("prefill before", "prefill after", "decode before",
                                     "decode after")))
    print(header)
    print(f"{'':<32}|" + "|".join(f"{'median    p90':^17}" for _ in range(4)))
    print("-" * len(header))
    for (model, gpu, tp), by_phase in sorted(rows.items()):
        cells = []
        for phase in (cal.Phase.PREFILL, cal.Phase.DECODE):
            group = by_phase[phase]
            cells.append(f" {_pct(group.before.median)} {_pct(group.before.p90)} ")
            cells.append(f" {_pct(group.after.median)} {_pct(group.after.p90)} ")
        tp_text = str(tp) if tp else "all"
        print(f"{model:<12} {gpu:<15} {tp_text:>3}|" + "|".join(f"{c:^17}" for c in cells))


def print_overall(title: str, errors: tuple[tuple[cal.Phase, cal.PhaseError], ...]) -> None:
    text = ", ".join(f"{phase} median {_pct(e.median)} p90 {_pct(e.p90)} (n={e.num_points})"
                     for phase, e in errors)
    print(f"{title:<34} {text}")


def per_gpu_errors(samples: list[cal.ProfileSample], result: cal.CalibrationResult
                   ) -> tuple[tuple[cal.Phase, cal.PhaseError], ...]:
    fits = dict(result.by_gpu)
    predicted = np.empty(len(samples))
    for gpu_name, efficiency in fits.items():
        indices = [i for i, s in enumerate(samples) if s.gpu_name == gpu_name]
        predicted[indices] = cal.predict_s([samples[i] for i in indices], efficiency)
    return _errors_by_phase(samples, predicted)


def held_out_errors(samples: list[cal.ProfileSample]
                    ) -> tuple[tuple[cal.Phase, cal.PhaseError], ...]:
    """For each (model, GPU) profiled at 3+ TP sizes: fit without one TP size, predict it."""
    kept: list[cal.ProfileSample] = []
    predicted: list[float] = []
    pairs = sorted({(s.model_name, s.gpu_name) for s in samples})
    for model_name, gpu_name in pairs:
        pair = [s for s in samples if (s.model_name, s.gpu_name) == (model_name, gpu_name)]
        tp_sizes = sorted({s.point.tp_size for s in pair})
        if len(tp_sizes) < 3:
            continue
        for tp in tp_sizes:
            train = [s for s in pair if s.point.tp_size != tp]
            test = [s for s in pair if s.point.tp_size == tp]
            efficiency = cal.fit_efficiency(train)
            kept += test
            predicted += list(cal.predict_s(test, efficiency))
    return _errors_by_phase(kept, np.array(predicted))


def _errors_by_phase(samples: list[cal.ProfileSample], predicted: np.ndarray
                     ) -> tuple[tuple[cal.Phase, cal.PhaseError], ...]:
    measured = np.array([s.point.measured_s for s in samples])
    out = []
    for phase in cal.Phase:
        mask = np.array([s.point.phase is phase for s in samples])
        if mask.any():
            out.append((phase, cal.phase_error(predicted[mask], measured[mask])))
    return tuple(out)


def plot(samples: list[cal.ProfileSample], result: cal.CalibrationResult, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    before = cal.predict_s(samples, Efficiency())
    fits = {(m, g): e for m, g, e in result.by_model_gpu}
    after = np.empty(len(samples))
    for key, efficiency in fits.items():
        indices = [i for i, s in enumerate(samples) if (s.model_name, s.gpu_name) == key]
        after[indices] = cal.predict_s([samples[i] for i in indices], efficiency)
    measured = np.array([s.point.measured_s for s in samples])
    figure, axes = plt.subplots(1, 2, figsize=(11, 5))
    for axis, phase in zip(axes, cal.Phase, strict=True):
        mask = np.array([s.point.phase is phase for s in samples])
        axis.scatter(measured[mask] * 1e3, before[mask] * 1e3, s=6, alpha=0.35, c="grey",
                     label="default factors")
        axis.scatter(measured[mask] * 1e3, after[mask] * 1e3, s=6, alpha=0.6, c="tab:blue",
                     label="calibrated (model, GPU)")
        low = min(measured[mask].min(), after[mask].min(), before[mask].min()) * 1e3
        high = max(measured[mask].max(), after[mask].max(), before[mask].max()) * 1e3
        axis.plot([low, high], [low, high], "k--", linewidth=0.8)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("measured (ms)")
        axis.set_ylabel("predicted (ms)")
        axis.set_title(f"{phase}: SplitwiseSim profile")
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def time_hot_path() -> tuple[float, float, float]:
    """Microseconds per call of prefill_time_s (8 prompts) and decode_step_time_s, and of a
    no-op call with the same arguments measured in the same run (the baseline)."""
    model = perf_model_for("llama-3.1-70b", "h100", 4)
    prompts = [512] * 8
    num_calls = 200_000

    def noop(lens: list[int]) -> float:
        return 0.0

    timings = []
    for call in (lambda: model.prefill_time_s(prompts), lambda: model.decode_step_time_s(64, 64000),
                 lambda: noop(prompts)):
        start = time.perf_counter()
        for _ in range(num_calls):
            call()
        timings.append((time.perf_counter() - start) / num_calls * 1e6)
    return timings[0], timings[1], timings[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--write-catalog", action="store_true")
    args = parser.parse_args()
    if not args.csv.exists():
        print(f"profile CSV not found: {args.csv} (pass --csv)", file=sys.stderr)
        return 2

    start = time.perf_counter()
    samples = cal.load_splitwise_csv(args.csv)
    result = cal.calibrate(samples)
    fit_s = time.perf_counter() - start

    print(f"SplitwiseSim profile: {len(samples) // 2} rows, {len(samples)} phase points; "
          f"fit in {fit_s:.2f} s\n")
    print_table(result)
    print()
    print_overall("overall, default factors:", result.overall_before)
    print_overall("overall, (model, GPU) fit:", result.overall_after)
    print_overall("overall, per-GPU fit (all models):", per_gpu_errors(samples, result))
    print_overall("held-out TP size, (model, GPU) fit:", held_out_errors(samples))
    print("\nfitted factors per (model, GPU):")
    for model_name, gpu_name, efficiency in result.by_model_gpu:
        factors = ", ".join(f"{k}={v:.3g}" for k, v in efficiency.as_dict().items())
        print(f"  {model_name:<12} {gpu_name:<15} {factors}")

    prefill_us, decode_us, noop_us = time_hot_path()
    print(f"\nhot path: prefill_time_s(8 prompts) {prefill_us:.2f} us/call, decode_step_time_s "
          f"{decode_us:.2f} us/call; no-op call baseline {noop_us:.2f} us "
          f"(ratios {prefill_us / noop_us:.1f}x, {decode_us / noop_us:.1f}x)")

    plot_path = OUT_DIR / "calibration.png"
    plot(samples, result, plot_path)
    print(f"plot: {plot_path.relative_to(ROOT)}")
    if args.write_catalog:
        CATALOG_EFFICIENCY.write_text(json.dumps(cal.efficiency_document(result), indent=2) + "\n")
        print(f"wrote {CATALOG_EFFICIENCY.relative_to(ROOT)}")

    summary = {str(phase): {"median": round(e.median, 4), "p90": round(e.p90, 4)}
               for phase, e in result.overall_after}
    summary["before"] = {str(phase): {"median": round(e.median, 4), "p90": round(e.p90, 4)}
                         for phase, e in result.overall_before}
    summary["hot_path_us"] = {"prefill": round(prefill_us, 3), "decode": round(decode_us, 3)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
