"""The GPU/model catalog: every entry loads, is self-consistent and cited; lookups fail clearly."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from pdserve.common.errors import ConfigError, InvalidArgumentError
from pdserve.perf import catalog as cat
from pdserve.perf.catalog import AttentionKind, Catalog, estimate_num_params

DATA_DIR = Path(cat.__file__).with_name("catalog")

GPU_NAMES = ["H100", "h100-sxm-80gb", "H200", "H800", "A100-80G", "a100-80gb", "A100-40G", "B200",
             "h100-80gb-pcap", "h100-80gb"]
MODEL_NAMES = ["llama-3.1-8b", "Llama-3.1-70B", "qwen2.5-7b", "qwen2.5-72b", "mixtral-8x7b",
               "deepseek-v3", "llama2-70b", "bloom-176b", "meta-llama/Llama-3.1-8B-Instruct",
               "Qwen/Qwen2.5-72B"]


@pytest.mark.parametrize("name", GPU_NAMES)
def test_every_required_gpu_resolves_with_positive_numbers(name: str) -> None:
    gpu = cat.get_gpu(name)
    assert gpu.memory_bytes >= 40 * 2**30
    assert gpu.peak_bf16_flops_per_s > 1e14
    assert gpu.hbm_bytes_per_s > 1e12
    assert gpu.nvlink_bytes_per_s > gpu.nic_bytes_per_s > 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_required_model_resolves(name: str) -> None:
    model = cat.get_model(name)
    assert model.num_attention_heads % model.num_kv_heads == 0
    assert 0 < model.num_active_params <= model.num_params


def test_aliases_resolve_to_one_entry_case_and_separator_insensitive() -> None:
    assert cat.get_gpu("H100_SXM").name == cat.get_gpu("h100").name == "h100-sxm-80gb"
    assert cat.get_model("LLAMA2_70B") is cat.get_model("meta-llama/Llama-2-70b-hf")


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(InvalidArgumentError) as gpu_error:
        cat.get_gpu("tpu-v5")
    assert "tpu-v5" in gpu_error.value.message
    assert "h100-sxm-80gb" in gpu_error.value.message and gpu_error.value.field == "gpu"
    with pytest.raises(InvalidArgumentError) as model_error:
        cat.get_model("gpt-5")
    assert "gpt-5" in model_error.value.message
    assert "deepseek-v3" in model_error.value.message and model_error.value.field == "model"


def test_every_numeric_value_has_a_source() -> None:
    catalog = cat.default_catalog()
    for spec in (*catalog.gpus, *catalog.models):
        for f in fields(spec):
            if isinstance(getattr(spec, f.name), int | float) and f.name != "sources":
                assert len(spec.source_of(f.name)) > 10, (spec.name, f.name)


@pytest.mark.parametrize("name", cat.default_catalog().model_names)
def test_architecture_reproduces_the_cited_parameter_count(name: str) -> None:
    """A typo in any shape field moves the implied count well beyond 1%."""
    model = cat.get_model(name)
    assert estimate_num_params(model) == pytest.approx(model.num_params, rel=0.01)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3"])
def test_moe_active_parameters_match_the_routed_fraction(name: str) -> None:
    model = cat.get_model(name)
    unused = model.num_routed_expert_params * (1 - model.num_experts_per_token / model.num_experts)
    assert model.num_params - unused == pytest.approx(model.num_active_params, rel=0.02)


def test_deepseek_v3_mla_and_moe_fields() -> None:
    model = cat.get_model("deepseek-v3")
    assert model.attention_kind is AttentionKind.MLA
    assert (model.kv_lora_rank, model.qk_rope_head_dim) == (512, 64)
    assert (model.num_experts, model.num_shared_experts, model.num_experts_per_token) == (256, 1, 8)
    assert (model.num_layers, model.num_moe_layers, model.num_dense_layers) == (61, 58, 3)
    assert model.qk_head_dim == 192


def test_power_capped_h100_differs_only_in_compute() -> None:
    h100, pcap = cat.get_gpu("h100-80gb"), cat.get_gpu("h100-80gb-pcap")
    assert pcap.peak_bf16_flops_per_s < h100.peak_bf16_flops_per_s
    assert (pcap.hbm_bytes_per_s, pcap.memory_bytes) == (h100.hbm_bytes_per_s, h100.memory_bytes)


def _write_catalog(tmp_path: Path, mutate_gpu: dict | None = None,
                   extra_gpu: dict | None = None) -> tuple[Path, Path]:
    gpus = json.loads((DATA_DIR / "gpus.json").read_text())
    if mutate_gpu is not None:
        gpus["gpus"][0].update(mutate_gpu)
        gpus["gpus"][0] = {k: v for k, v in gpus["gpus"][0].items() if v is not None}
    if extra_gpu is not None:
        gpus["gpus"].append(extra_gpu)
    gpus_path = tmp_path / "gpus.json"
    gpus_path.write_text(json.dumps(gpus))
    return gpus_path, DATA_DIR / "models.json"


def test_custom_catalog_files_load(tmp_path: Path) -> None:
    extra = dict(json.loads((DATA_DIR / "gpus.json").read_text())["gpus"][0],
                 name="l40s", aliases=[], memory_bytes=48 * 2**30)
    catalog = Catalog.from_files(*_write_catalog(tmp_path, extra_gpu=extra))
    assert catalog.gpu("L40S").memory_bytes == 48 * 2**30


def test_entry_without_source_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="source"):
        Catalog.from_files(*_write_catalog(tmp_path, mutate_gpu={"source": None}))


def test_non_positive_number_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hbm_bytes_per_s"):
        Catalog.from_files(*_write_catalog(tmp_path, mutate_gpu={"hbm_bytes_per_s": 0}))


def test_alias_used_twice_is_rejected(tmp_path: Path) -> None:
    extra = dict(json.loads((DATA_DIR / "gpus.json").read_text())["gpus"][1],
                 name="other", aliases=["h100"])
    with pytest.raises(ConfigError, match="h100"):
        Catalog.from_files(*_write_catalog(tmp_path, extra_gpu=extra))
