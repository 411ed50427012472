"""Agents over a vLLM engine, built by role from a worker's settings (``--engine vllm``).

The agents are the same ``PrefillAgent``/``DecodeAgent`` that drive the in-house runtime; only
the runtime differs (``runtimes``). vLLM's processes inherit this process's environment, so the
engine's (offline hub, KV cache size on CPU, no usage reports) is set here, never overriding
what the operator exported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import grpc

from pdserve.common.grpc_client import open_channel
from pdserve.common.types import WorkerRole
from pdserve.worker.agent import AgentConfig, WorkerAgent
from pdserve.worker.decode_agent import DecodeAgent
from pdserve.worker.engines.vllm.engine import VllmEngineSettings
from pdserve.worker.engines.vllm.exchange import GrpcDestinationExchange
from pdserve.worker.engines.vllm.runtimes import (
    VllmDecodeRuntime,
    VllmPrefillRuntime,
    VllmRuntimeSettings,
)
from pdserve.worker.prefill_agent import PrefillAgent
from pdserve.worker.reports import ControlPlane
from pdserve.worker.settings import WorkerSettings
from pdserve.worker.transports.registry import TransportBackend


def engine_environment(settings: WorkerSettings) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND=nobind``: vLLM's CPU build pins each engine's model worker to
    cores it picks alone, so two engines on one machine (a prefill and a decode worker) land on
    the same core, where each one's busy loop starves the other's KV receiver; unpinned, the
    kernel spreads them. Operators who place engines on cores set the variable themselves.
    ``OMP_NUM_THREADS`` from ``vllm_cpu_threads``: unpinned, each engine still starts an OpenMP
    thread per core, and engines sharing a host then run more threads than cores, which spin at
    every barrier (measured on two cores with a prefill and a decode engine: decode steps 2.5x
    slower than with one thread each)."""
    environment = {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": str(settings.vllm_kv_cache_gib),  # whole GiB (vLLM parses an int)
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if settings.vllm_cpu_threads:
        environment["OMP_NUM_THREADS"] = str(settings.vllm_cpu_threads)
    return environment


def default_block_size_tokens() -> int:
    """vLLM's own default: 128 tokens on its CPU build, 16 on GPUs."""
    return 128 if importlib.util.find_spec("vllm") is not None and _is_cpu_build() else 16


def _is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def runtime_settings(settings: WorkerSettings) -> VllmRuntimeSettings:
    assert settings.model_path is not None  # WorkerSettings.check
    engine = VllmEngineSettings(
        model_path=Path(settings.model_path),
        dtype=settings.vllm_dtype,
        max_model_len=settings.vllm_max_model_len or None,
        block_size_tokens=settings.vllm_block_size_tokens or default_block_size_tokens(),
        num_blocks=settings.vllm_num_blocks or None,
        max_num_seqs=settings.vllm_max_num_seqs,
        is_eager=settings.vllm_is_eager,
        environment=engine_environment(settings),
    )
    return VllmRuntimeSettings(engine=engine, worker_id=settings.worker_id,
                               handoff_timeout_s=settings.vllm_handoff_timeout_s,
                               decode_output_pause_s=settings.test_decode_step_pause_s)


def create_vllm_agent(settings: WorkerSettings, config: AgentConfig, transport: TransportBackend,
                      control: ControlPlane | None = None,
                      interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> WorkerAgent:
    """The agent of ``config.role`` over one vLLM engine (not started: ``agent.start`` loads it
    in the background). ``interceptors`` go on its channel (the worker's credential)."""
    runtime_config = runtime_settings(settings)
    # The coordinator's rendezvous, over this worker's own channel settings (TLS included).
    exchange = GrpcDestinationExchange(
        settings.coordinator_address,
        channel=open_channel(settings.coordinator_address, settings, interceptors=interceptors))
    if config.role is WorkerRole.DECODE:
        return DecodeAgent(config, VllmDecodeRuntime(runtime_config, exchange), transport,
                           control)
    return PrefillAgent(config, VllmPrefillRuntime(runtime_config, exchange), transport, control)
