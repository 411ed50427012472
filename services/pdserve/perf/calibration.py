"""Fit the performance model's efficiency factors to measured latencies.

Two sources of measurements, one fitter:
- the SplitwiseSim profile (``Mutinifni/splitwise-sim`` ``data/perf_model.csv``: Llama-2-70B and
  BLOOM-176B on DGX-A100 / DGX-H100 / power-capped H100, TP 2-8, prompt and per-token times in ms);
  ``calibrate`` fits one factor set per (model, GPU) and one per GPU over all its models, and
  reports the error per phase before and after. The fitted sets ship in
  ``catalog/efficiency.json``, so the performance model is calibrated without the CSV;
- a worker's own profile (prompt tokens, batch size, measured seconds) when it reports one:
  ``fit_worker_profile``.

The fit minimises the mean absolute log error of each phase present (phases weigh equally), by
coordinate descent over log-spaced grids with shrinking span: a handful of vectorised numpy
evaluations, well under a second. The roofline's work terms (FLOPs, bytes, all-reduce volume and
steps) do not depend on the factors, so they are computed once per point by ``PerfModel``.
"""

from __future__ import annotations

import csv
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from pdserve.common.errors import InvalidArgumentError
from pdserve.perf.catalog import Catalog, default_catalog
from pdserve.perf.perf_model import Efficiency, PerfModel, PhaseWork, calibrated_efficiency

SPLITWISE_CSV_REF = ("Mutinifni/splitwise-sim data/perf_model.csv "
                     "(commit 378088013a54df6f2052c27ff5ae6ea7619c3ecc)")


class Phase(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One measurement. Prefill: ``batch_size`` prompts of ``prompt_tokens`` each, measured
    seconds for the whole batch. Decode: ``batch_size`` sequences of ``prompt_tokens`` context
    tokens each, measured seconds per step."""

    phase: Phase
    prompt_tokens: int
    batch_size: int
    measured_s: float
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.batch_size < 1:
            raise InvalidArgumentError(
                f"profile point needs prompt_tokens and batch_size >= 1, got "
                f"{self.prompt_tokens} and {self.batch_size}", field="profile")
        if not self.measured_s > 0.0 or not math.isfinite(self.measured_s):
            raise InvalidArgumentError(
                f"profile point needs a positive measured_s, got {self.measured_s}",
                field="profile")


@dataclass(frozen=True, slots=True)
class ProfileSample:
    """A measurement of a (model, GPU) pair, by catalog names."""

    model_name: str
    gpu_name: str
    point: ProfilePoint


@dataclass(frozen=True, slots=True)
class PhaseError:
    """Absolute relative error |predicted - measured| / measured over ``num_points`` points."""

    num_points: int
    median: float
    p90: float


@dataclass(frozen=True, slots=True)
class GroupError:
    """Error of one phase on one (model, GPU, TP) group, before and after calibration.
    ``tp_size`` is ``None`` for the group of all TP sizes of that (model, GPU)."""

    model_name: str
    gpu_name: str
    tp_size: int | None
    phase: Phase
    before: PhaseError
    after: PhaseError


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """Fitted factor sets and the errors they leave. "After" uses the (model, GPU) fit."""

    by_model_gpu: tuple[tuple[str, str, Efficiency], ...]
    by_gpu: tuple[tuple[str, Efficiency], ...]
    groups: tuple[GroupError, ...]
    overall_before: tuple[tuple[Phase, PhaseError], ...]
    overall_after: tuple[tuple[Phase, PhaseError], ...]


# -- loading -------------------------------------------------------------------------------


def load_splitwise_csv(path: Path, catalog: Catalog | None = None) -> list[ProfileSample]:
    """Two samples (prefill, decode) per row of the SplitwiseSim profile CSV.

    ``prompt_time`` (ms) is the prefill of ``batch_size`` prompts of ``prompt_size`` tokens;
    ``token_time`` (ms) the mean decode step while ``token_size`` tokens are generated, so the
    context per sequence is taken as ``prompt_size + token_size / 2``, capped at the model's
    context length. Model and hardware names are resolved through the catalog aliases.
    """
    catalog = catalog or default_catalog()
    samples: list[ProfileSample] = []
    with Path(path).open(newline="") as handle:
        for row in csv.DictReader(handle):
            model = catalog.model(row["model"])
            gpu = catalog.gpu(row["hardware"])
            tp = int(row["tensor_parallel"])
            prompt = int(row["prompt_size"])
            batch = int(row["batch_size"])
            context = min(prompt + int(row["token_size"]) // 2, model.max_context_tokens)
            samples.append(ProfileSample(model.name, gpu.name, ProfilePoint(
                Phase.PREFILL, prompt, batch, float(row["prompt_time"]) / 1e3, tp)))
            samples.append(ProfileSample(model.name, gpu.name, ProfilePoint(
                Phase.DECODE, context, batch, float(row["token_time"]) / 1e3, tp)))
    return samples


# -- vectorised roofline ----------------------------------------------------------------------

_FITTED = ("prefill_mfu", "decode_mfu", "mbu", "prefill_overhead_s", "decode_overhead_s",
           "allreduce_latency_s", "link_efficiency")
_TP_ONLY = ("allreduce_latency_s", "link_efficiency")
_BOUNDS = {
    "prefill_mfu": (0.01, 1.0),
    "decode_mfu": (0.002, 1.0),
    "mbu": (0.05, 1.0),
    "prefill_overhead_s": (1e-6, 1.0),
    "decode_overhead_s": (1e-6, 0.5),
    "allreduce_latency_s": (1e-8, 1e-3),
    "link_efficiency": (0.02, 1.0),
}
_GRID_POINTS = 25
_NUM_ROUNDS = 14

DEFAULT_EFFICIENCY = Efficiency()
"""The uncalibrated factors: where every fit starts unless told otherwise."""


class _Design:
    """Per-point work terms and hardware constants as numpy arrays (shape ``[num_points]``)."""

    def __init__(self, samples: Sequence[ProfileSample], catalog: Catalog) -> None:
        if not samples:
            raise InvalidArgumentError("no profile points to fit", field="profile")
        works: list[PhaseWork] = []
        hardware: list[tuple[float, float, float]] = []
        models: dict[tuple[str, str, int], PerfModel] = {}
        for sample in samples:
            point = sample.point
            key = (sample.model_name, sample.gpu_name, point.tp_size)
            if key not in models:
                models[key] = PerfModel(catalog.model(sample.model_name),
                                        catalog.gpu(sample.gpu_name), point.tp_size)
            perf = models[key]
            if point.phase is Phase.PREFILL:
                works.append(perf.prefill_work([point.prompt_tokens] * point.batch_size))
            else:
                works.append(perf.decode_work(point.batch_size,
                                              point.batch_size * point.prompt_tokens))
            hardware.append((perf.peak_flops_per_s, perf.gpu.hbm_bytes_per_s,
                             perf.gpu.nvlink_bytes_per_s))
        self.flops = np.array([w.flops for w in works])
        self.memory_bytes = np.array([w.memory_bytes for w in works])
        self.comm_bytes = np.array([w.comm_bytes for w in works])
        self.comm_steps = np.array([w.comm_steps for w in works])
        hw = np.array(hardware)
        self.peak, self.bandwidth, self.link = hw[:, 0], hw[:, 1], hw[:, 2]
        self.is_prefill = np.array([s.point.phase is Phase.PREFILL for s in samples])
        self.measured_s = np.array([s.point.measured_s for s in samples])
        self.phases = tuple(p for p in Phase if np.any(self.is_prefill == (p is Phase.PREFILL)))
        self.num_tp_sizes = len({s.point.tp_size for s in samples})

    def predict_s(self, params: Mapping[str, np.ndarray | float]) -> np.ndarray:
        """Predicted seconds; each parameter a scalar or a ``[G, 1]`` column (-> ``[G, N]``)."""
        mfu = np.where(self.is_prefill, params["prefill_mfu"], params["decode_mfu"])
        overhead_s = np.where(self.is_prefill, params["prefill_overhead_s"],
                              params["decode_overhead_s"])
        compute_s = self.flops / (self.peak * mfu)
        memory_s = self.memory_bytes / (self.bandwidth * params["mbu"])
        comm_s = self.comm_bytes / (self.link * params["link_efficiency"])
        return (np.maximum(compute_s, memory_s) + comm_s
                + self.comm_steps * params["allreduce_latency_s"] + overhead_s)

    def loss(self, params: Mapping[str, np.ndarray | float]) -> np.ndarray:
        """Sum over phases of the mean absolute log error (shape of the parameter columns)."""
        log_error = np.abs(np.log(self.predict_s(params) / self.measured_s))
        total = 0.0
        for phase in self.phases:
            mask = self.is_prefill == (phase is Phase.PREFILL)
            total = total + log_error[..., mask].mean(axis=-1)
        return np.asarray(total)


def _free_parameters(design: _Design) -> tuple[str, ...]:
    """Factors the points can pin down: a phase's own factors only if it was measured; the
    all-reduce latency and link efficiency only across several TP sizes (at one TP size they
    are indistinguishable from the overheads and the MFU)."""
    free = []
    for name in _FITTED:
        if name.startswith("prefill") and Phase.PREFILL not in design.phases:
            continue
        if name.startswith("decode") and Phase.DECODE not in design.phases:
            continue
        if name in _TP_ONLY and design.num_tp_sizes < 2:
            continue
        free.append(name)
    return tuple(free)


def _fit(design: _Design, start: Efficiency) -> Efficiency:
    params: dict[str, float] = start.as_dict()
    free = _free_parameters(design)
    best = float(design.loss(params))
    span = 8.0
    for _ in range(_NUM_ROUNDS):
        for name in free:
            low, high = _BOUNDS[name]
            centre = min(max(params[name], low), high)
            grid = np.clip(centre * span ** np.linspace(-1.0, 1.0, _GRID_POINTS), low, high)
            trial: dict[str, np.ndarray | float] = dict(params)
            trial[name] = grid[:, None]
            losses = design.loss(trial)
            index = int(np.argmin(losses))
            if losses[index] < best:
                best = float(losses[index])
                params[name] = float(grid[index])
        span = max(1.02, span ** 0.6)
    return Efficiency(**params)


def fit_efficiency(samples: Sequence[ProfileSample], start: Efficiency = DEFAULT_EFFICIENCY,
                   catalog: Catalog | None = None) -> Efficiency:
    """Factors that minimise the mean absolute log error of ``samples`` (any mix of models,
    GPUs and TP sizes; the factors are shared). Factors the points cannot pin down keep their
    ``start`` value."""
    return _fit(_Design(samples, catalog or default_catalog()), start)


def fit_worker_profile(model_name: str, gpu_name: str, tp_size: int,
                       prefill_points: Iterable[tuple[int, int, float]] = (),
                       decode_points: Iterable[tuple[int, int, float]] = ()) -> Efficiency:
    """Factors fitted to what one worker measured: ``(prompt tokens, batch size, seconds)``.

    Prefill points time a batch of equal prompts; decode points time one step of ``batch size``
    sequences of ``prompt tokens`` context each. Starts from the catalog's calibrated factors
    for (model, GPU), so a profile of one phase leaves the other phase's factors as they were.
    """
    start, _ = calibrated_efficiency(model_name, gpu_name)
    samples = [ProfileSample(model_name, gpu_name, ProfilePoint(Phase.PREFILL, t, b, s, tp_size))
               for t, b, s in prefill_points]
    samples += [ProfileSample(model_name, gpu_name, ProfilePoint(Phase.DECODE, t, b, s, tp_size))
                for t, b, s in decode_points]
    return fit_efficiency(samples, start)


# -- errors and the SplitwiseSim calibration -------------------------------------------------


def phase_error(predicted_s: np.ndarray, measured_s: np.ndarray) -> PhaseError:
    """Median and p90 of the absolute relative error."""
    relative = np.abs(predicted_s - measured_s) / measured_s
    return PhaseError(num_points=int(relative.size), median=float(np.median(relative)),
                      p90=float(np.quantile(relative, 0.9)))


def predict_s(samples: Sequence[ProfileSample], efficiency: Efficiency,
              catalog: Catalog | None = None) -> np.ndarray:
    """Predicted seconds for each sample under one factor set."""
    return _Design(samples, catalog or default_catalog()).predict_s(efficiency.as_dict())


def calibrate(samples: Sequence[ProfileSample], baseline: Efficiency = DEFAULT_EFFICIENCY,
              catalog: Catalog | None = None) -> CalibrationResult:
    """Fit per (model, GPU) and per GPU; report errors per phase for each (model, GPU, TP), each
    (model, GPU) over all its TP sizes, and overall.

    "Before" is ``baseline``; "after" is the (model, GPU) fit. Every fit starts from
    ``baseline``.
    """
    catalog = catalog or default_catalog()
    by_pair: dict[tuple[str, str], list[ProfileSample]] = {}
    by_gpu: dict[str, list[ProfileSample]] = {}
    for sample in samples:
        by_pair.setdefault((sample.model_name, sample.gpu_name), []).append(sample)
        by_gpu.setdefault(sample.gpu_name, []).append(sample)
    pair_fits = {key: fit_efficiency(group, baseline, catalog) for key, group in by_pair.items()}
    gpu_fits = {key: fit_efficiency(group, baseline, catalog) for key, group in by_gpu.items()}

    before = predict_s(samples, baseline, catalog)
    after = np.empty_like(before)
    index_of = {id(s): i for i, s in enumerate(samples)}
    for key, group in by_pair.items():
        indices = [index_of[id(s)] for s in group]
        after[indices] = predict_s(group, pair_fits[key], catalog)
    measured = np.array([s.point.measured_s for s in samples])

    keys: set[tuple[str, str, int | None, Phase]] = {
        (s.model_name, s.gpu_name, s.point.tp_size, s.point.phase) for s in samples}
    keys |= {(model_name, gpu_name, None, phase) for model_name, gpu_name, _, phase in keys}
    groups: list[GroupError] = []
    for model_name, gpu_name, tp, phase in sorted(keys, key=lambda k: (*k[:2], k[2] or 0, k[3])):
        mask = np.array([(s.model_name, s.gpu_name, s.point.phase) == (model_name, gpu_name, phase)
                         and tp in (None, s.point.tp_size) for s in samples])
        groups.append(GroupError(model_name, gpu_name, tp, phase,
                                 phase_error(before[mask], measured[mask]),
                                 phase_error(after[mask], measured[mask])))
    overall_before, overall_after = [], []
    for phase in Phase:
        mask = np.array([s.point.phase is phase for s in samples])
        if mask.any():
            overall_before.append((phase, phase_error(before[mask], measured[mask])))
            overall_after.append((phase, phase_error(after[mask], measured[mask])))
    return CalibrationResult(
        by_model_gpu=tuple((m, g, e) for (m, g), e in sorted(pair_fits.items())),
        by_gpu=tuple(sorted(gpu_fits.items())),
        groups=tuple(groups),
        overall_before=tuple(overall_before),
        overall_after=tuple(overall_after),
    )


def efficiency_document(result: CalibrationResult, source: str = SPLITWISE_CSV_REF) -> dict:
    """The JSON document ``catalog/efficiency.json`` holds, from a calibration result."""

    def factors(efficiency: Efficiency) -> dict[str, float]:
        return {f.name: float(f"{getattr(efficiency, f.name):.6g}") for f in fields(efficiency)}

    return {
        "_comment": ("Efficiency factors of pdserve.perf.perf_model, fitted by "
                     "pdserve.perf.calibration (bench/calibration.py --write-catalog) to "
                     "the measured profile named in 'source'. 'by_model_gpu' is used for that "
                     "exact pair; 'by_gpu' (all profiled models on that GPU) otherwise."),
        "source": source,
        "by_model_gpu": [{"model": m, "gpu": g, "factors": factors(e)}
                         for m, g, e in result.by_model_gpu],
        "by_gpu": [{"gpu": g, "factors": factors(e)} for g, e in result.by_gpu],
    }
