"""``pdserve up``: the whole stack on this machine. Every control-plane service in this process
(embedded state and SQLite unless Redis/Postgres URLs are given), sim workers as child processes
that speak gRPC to it, exactly as they would on a fleet. Prints the gRPC and HTTP addresses, then
a line starting with ``ready`` once every worker is READY."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.runtime import install_fast_event_loop
from pdserve.common.settings import CommonSettings, LogFormat
from pdserve.common.settings_fields import add_settings_arguments, setting, settings_from_namespace
from pdserve.common.settings_parsers import (
    DATABASE_URL,
    DURATION_S,
    PORT,
    PORT_OR_OFF,
    float_range,
    int_range,
)
from pdserve.perf.catalog import DEFAULT_GPU, DEFAULT_MODEL
from pdserve.router.settings import TENANT_FLOATS, TENANT_INTS


@dataclass(frozen=True, slots=True, kw_only=True)
class UpSettings(CommonSettings):
    """The one-machine stack."""

    service_name: str = setting("pdserve-up", help="Service name in logs, traces and metrics.")
    grpc_port: int = setting(
        50051, parser=PORT,
        help="gRPC port of every control-plane service; 0 = any.")
    http_port: int = setting(
        8000, parser=PORT_OR_OFF,
        help="OpenAI-compatible HTTP port; 0 = any, -1 = off.")
    database_url: str = setting(
        "sqlite://", parser=DATABASE_URL,
        help="Durable store; default in-memory SQLite (nothing kept).")
    metrics_port: int = setting(-1, parser=PORT_OR_OFF, help="Prometheus port; -1 = off.")
    log_format: LogFormat = setting(LogFormat.TEXT, help="json or text.")
    model: str = setting(DEFAULT_MODEL, help="Model (deployment) to serve, from the catalog.")
    gpu: str = setting(DEFAULT_GPU, help="GPU from the catalog the sim workers model.")
    num_prefill: int = setting(
        -1, parser=int_range(-1, 64),
        help="Prefill workers (-1 = 2, or 1 with the vllm engine).")
    num_decode: int = setting(
        -1, parser=int_range(-1, 64),
        help="Decode workers (-1 = 2, or 1 with the vllm engine).")
    speedup: float = setting(
        1.0, parser=float_range(1e-3, 1e12),
        help="Sim speed-up of the workers.")
    cold_start_s: float = setting(
        0.0, parser=DURATION_S,
        help="Simulated cold start of each worker.")
    transport: str = setting("tcp", help="KV transport between workers.")
    engine: str = setting(
        "sim",
        help="Engine of the workers: sim (roofline timing), tiny (a real small transformer on "
             "the CPU; its KV and tokens are real) or vllm (a real model in vLLM, from "
             "model_path).")
    model_path: Path | None = setting(
        None,
        help="vllm engine: the model folder every worker serves (`pdserve models` builds one).")
    vllm_dtype: str = setting("auto", help="vllm engine: dtype (auto = the model's).")
    vllm_max_model_len: int = setting(
        0, parser=int_range(0, 10_000_000),
        help="vllm engine: context length (0 = the model's).")
    vllm_num_blocks: int = setting(
        0, parser=int_range(0, 10_000_000),
        help="vllm engine: KV blocks per worker (0 = vLLM sizes its cache).")
    vllm_block_size_tokens: int = setting(
        0, parser=int_range(0, 1024),
        help="vllm engine: tokens per KV block (0 = vLLM's default).")
    vllm_kv_cache_gib: int = setting(
        1, parser=int_range(1, 4096),
        help="vllm engine, CPU build: GiB of KV cache per worker.")
    http_tls_cert_path: Path | None = setting(
        None, help="PEM certificate the HTTP API serves HTTPS with; unset: plain HTTP.")
    http_tls_key_path: Path | None = setting(None, help="PEM private key of http_tls_cert_path.")
    join_token: str = setting(
        "", help="Worker join token; empty = a fresh random one.", is_secret=True
    )
    worker_tls_cert_path: Path | None = setting(
        None,
        help="With TLS: the workers' certificate (default worker.pem beside tls_cert_path, as "
             "pdserve certs writes it).")
    worker_tls_key_path: Path | None = setting(
        None,
        help="With TLS: the key of worker_tls_cert_path (default worker.key beside tls_cert_path).")
    max_num_blocks: int = setting(
        8192, parser=int_range(16, 10_000_000),
        help="KV blocks per sim worker (cap).")
    local_prefill_threshold_tokens: int = setting(
        64, parser=int_range(0, 10_000_000),
        help="Uncached prompt tokens at or below which decode prefills itself.")
    is_autoscaling: bool = setting(
        False,
        help="Let the governor's autoscaler set the pool sizes (off: it records recommendations "
             "only).")
    autoscale_interval_s: float = setting(
        30.0, parser=float_range(0.01, 86400.0),
        help="Seconds between the governor's passes (pool sizes and the local-prefill "
             "threshold it publishes to the router).")
    live_plan_interval_s: float = setting(
        0.0, parser=float_range(0.0, 86400.0),
        help="Seconds between the governor's plans by replay of the observed window (pdserve "
             "governor plan); 0 = none (each simulates for seconds in this one process).")
    # Router SLOs, admission and load shedding (see RouterSettings).
    slo_ttft_ms: float = setting(
        2000.0, parser=float_range(0.001, 1e9),
        help="TTFT SLO (goodput and shedding), ms.")
    slo_tpot_ms: float = setting(
        100.0, parser=float_range(0.001, 1e9),
        help="TPOT SLO for goodput, ms.")
    max_in_flight: int = setting(
        4096, parser=int_range(1, 1_000_000),
        help="Requests the router admits at once.")
    is_shedding_enabled: bool = setting(
        True,
        help="Shed requests predicted to miss the TTFT SLO, and tenants over their share of a "
             "saturated queue.")
    shed_ttft_fraction: float = setting(
        0.8, parser=float_range(0.01, 100.0),
        help="Shed when the predicted TTFT exceeds this fraction of slo_ttft_ms.")
    fair_share_onset: float = setting(
        0.5, parser=float_range(0.01, 1.0),
        help="Queue saturation beyond which tenants over their share are shed.")
    max_pending_requests: int = setting(
        1024, parser=int_range(1, 1_000_000),
        help="Router queue bound: admitted requests whose prefill has not finished.")
    tenant_share: float = setting(
        0.5, parser=float_range(0.001, 1.0),
        help="Default in-flight cap of a tenant, fraction of max_in_flight.")
    tenant_max_in_flight: tuple[tuple[str, int], ...] = setting(
        (), parser=TENANT_INTS,
        help="Per-tenant in-flight caps, tenant=N pairs.")
    tenant_weights: tuple[tuple[str, float], ...] = setting(
        (), parser=TENANT_FLOATS,
        help="Fair-share weights, tenant=W pairs.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, UpSettings)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_namespace(UpSettings, args, os.environ)
    if settings.engine == "vllm" and settings.model == DEFAULT_MODEL and settings.model_path:
        # The catalog's default names a model these workers do not serve: the deployment is
        # the model folder's name unless one was given.
        settings = dataclasses.replace(settings, model=Path(settings.model_path).name)
    install_fast_event_loop()
    return asyncio.run(_up(settings))


def _announce(line: str) -> None:
    print(line, flush=True)


def pool_sizes(settings: UpSettings) -> tuple[int, int]:
    """(prefill, decode) workers: as set, else 2 each (1 each with the vllm engine, whose
    engines are large)."""
    default = 1 if settings.engine == "vllm" else 2
    num_prefill = default if settings.num_prefill < 0 else settings.num_prefill
    num_decode = default if settings.num_decode < 0 else max(1, settings.num_decode)
    return num_prefill, num_decode


def vllm_worker_args(settings: UpSettings) -> list[str]:
    from pdserve.common.errors import ConfigError

    if settings.engine != "vllm":
        return []
    if settings.model_path is None:
        raise ConfigError("PDSERVE_MODEL_PATH: --engine vllm needs --model-path (a model "
                          "folder; `pdserve models smollm2 DIR` builds one)", field="model_path")
    from pdserve.worker.engines.vllm.model_folders import check_model_folder

    folder = check_model_folder(Path(settings.model_path))  # one clear error, before any worker
    # The engines share this host: each gets its share of the cores (oversubscribed OpenMP
    # threads spin at barriers). A vLLM CUDA build ignores it.
    num_engines = sum(pool_sizes(settings))
    cpu_threads = max(1, (os.cpu_count() or 1) // max(1, num_engines))
    return ["--model-path", str(folder.path), "--vllm-dtype", settings.vllm_dtype,
            "--vllm-max-model-len", str(settings.vllm_max_model_len),
            "--vllm-num-blocks", str(settings.vllm_num_blocks),
            "--vllm-block-size-tokens", str(settings.vllm_block_size_tokens),
            "--vllm-kv-cache-gib", str(settings.vllm_kv_cache_gib),
            "--vllm-cpu-threads", str(cpu_threads)]


def worker_tls_args(settings: UpSettings) -> list[str]:
    """Flags that give provisioned workers their own (worker) certificate, the CA, and KV TLS.

    Workers must not reuse this process's certificate: it names a service, and the
    authorization table lets only worker identities register (``pdserve.common.auth``).
    """
    if settings.tls is None:
        return []
    from pdserve.common.errors import ConfigError

    cert_path, key_path = settings.worker_tls_cert_path, settings.worker_tls_key_path
    if settings.tls_cert_path is not None:
        directory = settings.tls_cert_path.parent
        cert_path = cert_path or directory / "worker.pem"
        key_path = key_path or directory / "worker.key"
    if cert_path is None or key_path is None or not cert_path.exists() or not key_path.exists():
        raise ConfigError("PDSERVE_WORKER_TLS_CERT_PATH: with TLS the workers need their own "
                          "certificate (pdserve certs DIR makes DIR/worker.pem)",
                          field="worker_tls_cert_path")
    args = ["--tls-cert-path", str(cert_path), "--tls-key-path", str(key_path)]
    if settings.tls_ca_path is not None:
        args += ["--tls-ca-path", str(settings.tls_ca_path)]
    if settings.kv_tls:
        args += ["--kv-tls", "true"]
    return args


def internal_credentials(settings: UpSettings, directory: Path) -> tuple[UpSettings, Path | None]:
    """With keys configured and no mutual TLS, the stack's internal calls need credentials
    (``pdserve.common.auth``): a fresh service token in ``directory/service-tokens`` (unless
    ``service_tokens_path`` names one) for the services, and ``directory/service-token-digests``
    (verify-only ``sha256:`` lines) for the workers' own servers, so that a worker can check a
    service's calls but not act as one. Returns the settings to run with and the workers' file
    (None: nothing to wire)."""
    tls = settings.tls
    is_mutual = tls is not None and tls.cert_path is not None and tls.ca_path is not None
    has_keys = settings.api_keys_path is not None or settings.admin_keys_path is not None
    if settings.service_tokens_path is None and (is_mutual or not has_keys):
        return settings, None
    if settings.service_tokens_path is None:
        tokens_path = directory / "service-tokens"
        tokens_path.write_text(secrets.token_hex(24) + "\n")
        tokens_path.chmod(0o600)
        settings = dataclasses.replace(settings, service_tokens_path=tokens_path)
    assert settings.service_tokens_path is not None
    digests_path = directory / "service-token-digests"
    write_token_digests(Path(settings.service_tokens_path), digests_path)
    return settings, digests_path


def write_token_digests(source: Path, digests: Path) -> bool:
    """Write the verify-only copy of the service token file ``source`` to ``digests`` if it
    differs; True when written. Raises ``ConfigError`` for a bad ``source``."""
    from pdserve.common.credentials import DIGEST_PREFIX, parse_service_token_file

    tokens = parse_service_token_file(source.read_text(), str(source))
    text = "".join(DIGEST_PREFIX + token.digest.hex() + "\n" for token in tokens)
    if digests.exists() and digests.read_text() == text:
        return False
    partial = digests.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(digests)  # a reader never sees half a file
    return True


async def follow_service_tokens(source: Path, digests: Path, stop: asyncio.Event,
                                interval_s: float = 1.0) -> None:
    """Keep the workers' verify-only copy in step with a rotated ``source`` until ``stop``."""
    from pdserve.common.errors import ConfigError

    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
        try:
            write_token_digests(source, digests)
        except (OSError, ConfigError):
            continue  # a bad edit: the services keep their tokens too (ServiceTokens.refresh)


async def _up(settings: UpSettings) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as directory:
        settings, worker_tokens_path = internal_credentials(settings, Path(directory))
        return await _up_with(settings, worker_tokens_path)


async def _up_with(settings: UpSettings, worker_tokens_path: Path | None) -> int:
    from pdserve.common.credentials import load_service_tokens
    from pdserve.common.grpc_server import GrpcServer
    from pdserve.common.runtime import setup_process, stop_on_signals
    from pdserve.common.types import WorkerRole
    from pdserve.db.durable import (
        LifecycleSinkAdapter,
        TransferSinkAdapter,
        WindowWriterAdapter,
        open_durable,
    )
    from pdserve.governor.app import GovernorApp
    from pdserve.kv_transfer.app import CoordinatorApp
    from pdserve.kv_transfer.coordinator import CoordinatorPolicy
    from pdserve.kv_transfer.local_client import LocalTicketClient
    from pdserve.kv_transfer.rendezvous import open_rendezvous
    from pdserve.pool.app import PoolApp
    from pdserve.pool.provisioner import LocalProcessProvisioner
    from pdserve.pool.servicer import PoolServicer
    from pdserve.pool.settings import PoolSettings
    from pdserve.router.app import RouterApp
    from pdserve.router.settings import RouterSettings
    from pdserve.state.stores import open_stores

    runtime = setup_process(settings)
    num_prefill, num_decode = pool_sizes(settings)
    vllm_args = vllm_worker_args(settings)
    stop = asyncio.Event()
    stop_on_signals(stop)
    stores = open_stores(settings.redis_url)
    durable = open_durable(settings.database_url, settings.durable_spool_dir,
                           settings.service_name, migrate=True)
    join_token = settings.join_token or secrets.token_hex(16)
    env = dict(os.environ, PDSERVE_JOIN_TOKEN=join_token)
    env.pop("PDSERVE_SERVICE_TOKENS_PATH", None)  # workers never hold a service token
    if worker_tokens_path is not None:
        env["PDSERVE_SERVICE_TOKENS_PATH"] = str(worker_tokens_path)
        env["PDSERVE_SERVICE_TOKEN_GRACE_S"] = str(settings.service_token_grace_s)
    service_tokens = load_service_tokens(settings)
    mint = service_tokens.mint_worker_credential if service_tokens is not None else None
    server = GrpcServer.from_settings(settings)

    coordinator = CoordinatorApp(stores.backend, time.time, CoordinatorPolicy(),
                                 open_rendezvous(stores.redis_client), settings,
                                 TransferSinkAdapter(durable) if durable else None)
    coordinator.register(server)
    pools = {}
    for role, count in (
        (WorkerRole.PREFILL, num_prefill),
        (WorkerRole.DECODE, num_decode),
    ):
        pool_settings = PoolSettings(
            role=role,
            join_token=join_token,
            deployments=(settings.model,),
            is_provisioning=True,
            initial_target_size=count,
            grpc_port=settings.grpc_port,
            service_tokens_path=settings.service_tokens_path,
            service_token_grace_s=settings.service_token_grace_s,
        )
        pools[role] = PoolApp(pool_settings, stores.backend, stores.prefix_index, time.time,
                              LocalProcessProvisioner(env=env, worker_credential=mint),
                              LifecycleSinkAdapter(durable) if durable else None)
    PoolServicerAll = PoolServicer({r: p.manager for r, p in pools.items()}, stores.backend.workers,
                                   stores.backend.events, mint_credential=mint)
    from pdserve.api.v1 import pool_pb2_grpc
    from pdserve.pool.servicer import SERVICE_NAME as POOL_SERVICE

    server.add_servicer(
        POOL_SERVICE, pool_pb2_grpc.add_PoolServiceServicer_to_server, PoolServicerAll
    )
    router_settings = RouterSettings(
        http_host=settings.grpc_host, http_port=settings.http_port,
        http_tls_cert_path=settings.http_tls_cert_path,
        http_tls_key_path=settings.http_tls_key_path,
        coordinator_address="127.0.0.1:1", transport=settings.transport,
        tls_cert_path=settings.tls_cert_path, tls_key_path=settings.tls_key_path,
        tls_ca_path=settings.tls_ca_path, api_keys_path=settings.api_keys_path,
        local_prefill_threshold_tokens=settings.local_prefill_threshold_tokens,
        otel_endpoint=settings.otel_endpoint, otel_sampling_ratio=settings.otel_sampling_ratio,
        slo_ttft_ms=settings.slo_ttft_ms, slo_tpot_ms=settings.slo_tpot_ms,
        max_in_flight=settings.max_in_flight, is_shedding_enabled=settings.is_shedding_enabled,
        shed_ttft_fraction=settings.shed_ttft_fraction, fair_share_onset=settings.fair_share_onset,
        max_pending_requests=settings.max_pending_requests, tenant_share=settings.tenant_share,
        tenant_max_in_flight=settings.tenant_max_in_flight, tenant_weights=settings.tenant_weights,
        service_tokens_path=settings.service_tokens_path,
        service_token_grace_s=settings.service_token_grace_s,
    )
    router = RouterApp(router_settings, stores.backend, stores.prefix_index,
                       LocalTicketClient(coordinator.coordinator),
                       WindowWriterAdapter(durable) if durable else None)
    router.register(server)
    from pdserve.governor.autoscaling import ManagerTargetSetter
    from pdserve.governor.settings import GovernorSettings

    governor = GovernorApp(
        # A vllm model folder is not in the catalog the autoscaler sizes pools from: its pools
        # keep the sizes asked for.
        GovernorSettings(autoscale_deployments=(
                             () if settings.engine == "vllm" else (settings.model,)),
                         autoscale_gpu=settings.gpu,
                         autoscale_interval_s=settings.autoscale_interval_s,
                         live_plan_interval_s=settings.live_plan_interval_s,
                         autoscale_slo_ttft_ms=settings.slo_ttft_ms,
                         autoscale_slo_tpot_ms=settings.slo_tpot_ms,
                         autoscale_cold_start_s=settings.cold_start_s,
                         autoscale_speedup=settings.speedup,
                         autoscale_max_num_blocks=settings.max_num_blocks,
                         is_autoscaler_dry_run=not settings.is_autoscaling,
                         redis_url=settings.redis_url, database_url=settings.database_url,
                         service_tokens_path=settings.service_tokens_path,
                         service_token_grace_s=settings.service_token_grace_s),
        durable, stores.backend,
        target_setter=ManagerTargetSetter({role: pool.manager for role, pool in pools.items()}))
    governor.register(server)

    port = await server.start()
    address = f"{settings.grpc_host}:{port}"
    worker_args = [
        "--pool-address",
        address,
        "--coordinator-address",
        address,
        "--model",
        settings.model,
        "--gpu",
        settings.gpu,
        "--speedup",
        str(settings.speedup),
        "--cold-start-s",
        str(settings.cold_start_s),
        "--transport",
        settings.transport,
        "--engine",
        settings.engine,
        "--max-num-blocks",
        str(settings.max_num_blocks),
        *vllm_args,
        "--log-format",
        "text",
        "--log-level",
        "WARNING",
        "--metrics-port",
        "-1",
    ]
    for pool in pools.values():
        pool.manager._provisioner.base_args = [*worker_args, *worker_tls_args(settings)]  # type: ignore[union-attr]
    coordinator.start()
    follower = None
    if worker_tokens_path is not None and settings.service_tokens_path is not None:
        follower = asyncio.create_task(follow_service_tokens(
            Path(settings.service_tokens_path), worker_tokens_path, stop))
    for pool in pools.values():
        await pool.start()
    await router.start()
    governor.start()
    _announce(f"grpc {address}")
    if router.http_port:
        _announce(f"http {router.http_scheme}://{settings.grpc_host}:{router.http_port}")
    try:
        started = time.monotonic()
        while not stop.is_set():
            # Ready means the router can route: count what its pool view sees, not the store.
            num_ready = {r: len(router.view.ready(settings.model, r)) for r in WorkerRole}
            if (num_ready[WorkerRole.PREFILL] >= num_prefill
                    and num_ready[WorkerRole.DECODE] >= num_decode):
                _announce(f"ready model {settings.model}: {num_prefill} prefill, "
                          f"{num_decode} decode workers "
                          f"({time.monotonic() - started:.1f}s)")
                break
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except TimeoutError:
                pass
        await stop.wait()
    finally:
        # Pools first: their loops stop before anything else does (with the server gone they
        # would count the workers' missed heartbeats as failures and start new workers), and
        # their workers leave through the server while it still answers.
        for pool in pools.values():
            await pool.close()
        await server.stop(2.0)
        await router.close()
        await governor.close()
        if follower is not None:
            follower.cancel()
        await coordinator.close()
        await stores.close()
        if durable is not None:
            durable.close()
        runtime.close()
    return 0


