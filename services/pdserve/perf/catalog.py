"""The GPU and model catalog: hardware and architecture numbers as data, each with its source.

The numbers live in ``catalog/gpus.json``, ``catalog/models.json`` and (fitted efficiency factors
of the performance model) ``catalog/efficiency.json`` beside this module. This module only loads,
validates and looks them up; the capacity and performance models compute from the frozen
``GpuSpec`` / ``ModelSpec`` values it returns.

Units: bytes, FLOP/s, bytes/s, tokens. Names are matched case-insensitively, ``_`` and ``-``
alike, against the catalog name and its aliases (the hub id counts as an alias for models).
Unknown names raise ``InvalidArgumentError`` listing the known names.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from pdserve.common.errors import ConfigError, InvalidArgumentError

DEFAULT_MODEL = "llama-3.1-8b"
"""The model a deployment serves unless told (settings of workers, the governor, ``pdserve up``)."""
DEFAULT_GPU = "h100-sxm-80gb"
"""The GPU the sim engine and the planner assume unless told."""

_DATA_PACKAGE = "pdserve.perf"
_DATA_DIR = "catalog"


class AttentionKind(enum.StrEnum):
    """How a model's KV cache is laid out."""

    STANDARD = "standard"  # K and V per KV head (MHA, GQA, MQA)
    MLA = "mla"  # one compressed latent plus a shared RoPE key per token (DeepSeek-V2/V3)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model. FLOP/s are dense; link bandwidths are per GPU and per direction.

    ``peak_fp8_flops_per_s`` is 0 for GPUs without FP8 tensor cores (engines then run FP8
    weights through BF16 math).

    ``calibration_proxy`` names the catalog GPU whose fitted efficiency factors stand in when this
    GPU has none of its own (same generation and software stack), or is ``None``.
    """

    name: str
    memory_bytes: int
    peak_bf16_flops_per_s: float
    peak_fp8_flops_per_s: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    nic_bytes_per_s: float
    calibration_proxy: str | None = None
    aliases: tuple[str, ...] = ()
    sources: tuple[tuple[str, str], ...] = ()

    def peak_flops_per_s(self, dtype_bytes: int) -> float:
        """Dense peak for matrix products on weights of ``dtype_bytes`` (1 = FP8, else BF16)."""
        if dtype_bytes == 1 and self.peak_fp8_flops_per_s > 0:
            return self.peak_fp8_flops_per_s
        return self.peak_bf16_flops_per_s

    def source_of(self, field_name: str) -> str:
        """The citation for one numeric field."""
        return _source_of(self.sources, field_name)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model's architecture, enough for KV sizing and a roofline.

    ``head_dim`` is the value head width; the query/key width is ``qk_head_dim`` (larger for MLA,
    whose keys carry a RoPE part). MoE fields are zero for dense models. ``dtype_bytes`` is the
    weight element width, ``kv_dtype_bytes`` the KV-cache element width.
    """

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context_tokens: int
    num_params: int
    num_active_params: int
    dtype_bytes: int
    kv_dtype_bytes: int
    is_gated_mlp: bool = True
    tie_word_embeddings: bool = False
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    num_experts: int = 0
    num_shared_experts: int = 0
    num_experts_per_token: int = 0
    num_moe_layers: int = 0
    num_dense_layers: int = 0
    moe_intermediate_size: int = 0
    aliases: tuple[str, ...] = ()
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def attention_kind(self) -> AttentionKind:
        return AttentionKind.MLA if self.kv_lora_rank > 0 else AttentionKind.STANDARD

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head (MLA: nope + rope part; otherwise ``head_dim``)."""
        if self.attention_kind is AttentionKind.MLA:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def num_params_per_expert(self) -> int:
        """Weights of one routed expert in one MoE layer (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    @property
    def num_routed_expert_params(self) -> int:
        """All routed-expert weights of the model (the part a small batch reads only partly)."""
        return self.num_moe_layers * self.num_experts * self.num_params_per_expert

    def source_of(self, field_name: str) -> str:
        """The citation for one architecture field."""
        return _source_of(self.sources, field_name)


def estimate_num_params(model: ModelSpec) -> int:
    """Parameters implied by the architecture fields (biases and norms ignored, no MTP heads).

    Used to cross-check catalog entries against their cited totals; the cited ``num_params`` is
    what the capacity model uses.
    """
    h = model.hidden_size
    embed = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    if model.attention_kind is AttentionKind.MLA:
        heads = model.num_attention_heads
        q = h * model.q_lora_rank + model.q_lora_rank * heads * model.qk_head_dim
        kv_down = h * (model.kv_lora_rank + model.qk_rope_head_dim)
        kv_up = model.kv_lora_rank * heads * (model.qk_nope_head_dim + model.head_dim)
        attn = q + kv_down + kv_up + heads * model.head_dim * h
    else:
        q_and_o = 2 * h * model.num_attention_heads * model.head_dim
        attn = q_and_o + 2 * h * model.num_kv_heads * model.head_dim
    mlp_mats = 3 if model.is_gated_mlp else 2
    dense_mlp = mlp_mats * h * model.intermediate_size
    if model.is_moe:
        shared = model.num_shared_experts * model.num_params_per_expert
        router = h * model.num_experts
        moe_layer = model.num_experts * model.num_params_per_expert + shared + router
        mlp_total = model.num_dense_layers * dense_mlp + model.num_moe_layers * moe_layer
    else:
        mlp_total = model.num_layers * dense_mlp
    return embed + model.num_layers * attn + mlp_total


def _source_of(sources: tuple[tuple[str, str], ...], field_name: str) -> str:
    by_field = dict(sources)
    if field_name in by_field:
        return by_field[field_name]
    return by_field["*"]


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


_GPU_NUMERIC = ("memory_bytes", "peak_bf16_flops_per_s", "hbm_bytes_per_s",
                "nvlink_bytes_per_s", "nic_bytes_per_s")
_MODEL_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                   "intermediate_size", "vocab_size", "max_context_tokens", "num_params",
                   "num_active_params", "dtype_bytes", "kv_dtype_bytes")


def _sources(entry: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    source = entry.get("source")
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{where}: every catalog entry needs a 'source' citation")
    field_sources = entry.get("field_sources", {})
    return (("*", source), *sorted((str(k), str(v)) for k, v in field_sources.items()))


def _gpu_from_entry(entry: Mapping[str, Any]) -> GpuSpec:
    where = f"gpus.json entry {entry.get('name')!r}"
    known = {f.name for f in fields(GpuSpec)}
    extra = set(entry) - known - {"source", "field_sources"}
    if extra:
        raise ConfigError(f"{where}: unknown fields {sorted(extra)}")
    for key in _GPU_NUMERIC:
        value = entry.get(key)
        if not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")
    fp8 = entry.get("peak_fp8_flops_per_s", 0)
    if not isinstance(fp8, int | float) or fp8 < 0:
        raise ConfigError(f"{where}: peak_fp8_flops_per_s must be >= 0, got {fp8!r}")
    return GpuSpec(
        name=_normalise(entry["name"]),
        memory_bytes=int(entry["memory_bytes"]),
        peak_bf16_flops_per_s=float(entry["peak_bf16_flops_per_s"]),
        peak_fp8_flops_per_s=float(fp8),
        hbm_bytes_per_s=float(entry["hbm_bytes_per_s"]),
        nvlink_bytes_per_s=float(entry["nvlink_bytes_per_s"]),
        nic_bytes_per_s=float(entry["nic_bytes_per_s"]),
        calibration_proxy=entry.get("calibration_proxy"),
        aliases=tuple(_normalise(a) for a in entry.get("aliases", ())),
        sources=_sources(entry, where),
    )


def _model_from_entry(entry: Mapping[str, Any]) -> ModelSpec:
    where = f"models.json entry {entry.get('name')!r}"
    known = {f.name for f in fields(ModelSpec)}
    extra = set(entry) - known - {"source", "field_sources"}
    if extra:
        raise ConfigError(f"{where}: unknown fields {sorted(extra)}")
    for key in _MODEL_REQUIRED:
        value = entry.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    values = {k: v for k, v in entry.items() if k not in ("source", "field_sources")}
    values["name"] = _normalise(entry["name"])
    values["aliases"] = tuple(_normalise(a) for a in entry.get("aliases", ()))
    values["sources"] = _sources(entry, where)
    model = ModelSpec(**values)
    _check_model(model, where)
    return model


def _check_model(model: ModelSpec, where: str) -> None:
    if model.num_active_params > model.num_params:
        raise ConfigError(f"{where}: num_active_params exceeds num_params")
    if model.num_attention_heads % model.num_kv_heads:
        raise ConfigError(f"{where}: num_attention_heads must be a multiple of num_kv_heads")
    if model.is_moe:
        if model.num_moe_layers + model.num_dense_layers != model.num_layers:
            raise ConfigError(f"{where}: num_moe_layers + num_dense_layers != num_layers")
        if not 0 < model.num_experts_per_token <= model.num_experts:
            raise ConfigError(f"{where}: num_experts_per_token must be in [1, num_experts]")
        if model.moe_intermediate_size <= 0:
            raise ConfigError(f"{where}: an MoE model needs moe_intermediate_size")
    if model.attention_kind is AttentionKind.MLA and model.qk_rope_head_dim <= 0:
        raise ConfigError(f"{where}: an MLA model needs qk_rope_head_dim")


@dataclass(frozen=True, slots=True)
class Catalog:
    """All known GPUs and models, with alias lookup. Build with ``Catalog.from_files``."""

    gpus: tuple[GpuSpec, ...]
    models: tuple[ModelSpec, ...]
    efficiency: Mapping[str, Any]

    @classmethod
    def from_files(cls, gpus_path: Path, models_path: Path,
                   efficiency_path: Path | None = None) -> Catalog:
        """Load and validate catalog files (an operator may ship their own)."""
        gpus_doc = json.loads(Path(gpus_path).read_text())
        models_doc = json.loads(Path(models_path).read_text())
        efficiency_doc: dict[str, Any] = {}
        if efficiency_path is not None and Path(efficiency_path).exists():
            efficiency_doc = json.loads(Path(efficiency_path).read_text())
        return cls._from_docs(gpus_doc, models_doc, efficiency_doc)

    @classmethod
    def _from_docs(cls, gpus_doc: Mapping[str, Any], models_doc: Mapping[str, Any],
                   efficiency_doc: Mapping[str, Any]) -> Catalog:
        gpus = tuple(_gpu_from_entry(e) for e in gpus_doc["gpus"])
        models = tuple(_model_from_entry(e) for e in models_doc["models"])
        catalog = cls(gpus=gpus, models=models, efficiency=efficiency_doc)
        catalog._check_unique_names()
        for gpu in gpus:
            if gpu.calibration_proxy is not None:
                catalog.gpu(gpu.calibration_proxy)
        return catalog

    def _check_unique_names(self) -> None:
        for kind, specs in (("GPU", self.gpus), ("model", self.models)):
            seen: dict[str, str] = {}
            for spec in specs:
                keys = {spec.name, *spec.aliases}
                if isinstance(spec, ModelSpec):
                    keys.add(_normalise(spec.hf_id))
                for key in keys:
                    if seen.setdefault(key, spec.name) != spec.name:
                        raise ConfigError(f"{kind} name {key!r} is used by {seen[key]} and "
                                          f"{spec.name}")

    @property
    def gpu_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.gpus)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models)

    def gpu(self, name: str) -> GpuSpec:
        """The GPU called ``name`` (or one of its aliases)."""
        key = _normalise(name)
        for gpu in self.gpus:
            if key == gpu.name or key in gpu.aliases:
                return gpu
        raise InvalidArgumentError(
            f"unknown GPU {name!r}; known GPUs: {', '.join(self.gpu_names)}", field="gpu")

    def model(self, name: str) -> ModelSpec:
        """The model called ``name`` (its catalog name, an alias or its hub id)."""
        key = _normalise(name)
        for model in self.models:
            if key == model.name or key in model.aliases or key == _normalise(model.hf_id):
                return model
        raise InvalidArgumentError(
            f"unknown model {name!r}; known models: {', '.join(self.model_names)}",
            field="model")


def _data_path(file_name: str) -> Path:
    return Path(str(resources.files(_DATA_PACKAGE).joinpath(_DATA_DIR, file_name)))


@functools.cache
def default_catalog() -> Catalog:
    """The catalog shipped with the package (loaded once per process)."""
    return Catalog.from_files(_data_path("gpus.json"), _data_path("models.json"),
                              _data_path("efficiency.json"))


def get_gpu(name: str) -> GpuSpec:
    """Shorthand for ``default_catalog().gpu(name)``."""
    return default_catalog().gpu(name)


def get_model(name: str) -> ModelSpec:
    """Shorthand for ``default_catalog().model(name)``."""
    return default_catalog().model(name)
