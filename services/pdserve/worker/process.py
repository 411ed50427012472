"""One worker process: engine, agent, gRPC server, and the membership loop (register, cold
start, heartbeats, drain). ``pdserve serve worker`` runs ``run_worker``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2_grpc
from pdserve.common.convert import role_to_pb, token_from_pb, worker_state_to_pb
from pdserve.common.credentials import bearer_interceptors
from pdserve.common.errors import (
    ConfigError,
    NotFoundError,
    PdserveError,
    UnauthenticatedError,
    UnavailableError,
)
from pdserve.common.grpc_client import open_channel
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.tokenizer_bundle import bundle_from_folder, bundle_to_pb
from pdserve.common.types import WorkerRole, WorkerState
from pdserve.common.version import software_version
from pdserve.worker.agent import AgentConfig, WorkerAgent
from pdserve.worker.control import GrpcControlPlane, PoolClient
from pdserve.worker.engine import Engine
from pdserve.worker.runtime import EngineReadiness, Readiness
from pdserve.worker.scheduler.agents import create_agent
from pdserve.worker.servicer import SERVICE_NAME, WorkerAgentServicer
from pdserve.worker.settings import WorkerSettings
from pdserve.worker.transports.registry import TransportBackend, get_backend

if TYPE_CHECKING:
    from pdserve.worker.engines.tiny import TinyConfig

logger = logging.getLogger(__name__)


def build_engine(settings: WorkerSettings) -> Engine:
    if settings.engine == "sim":
        from pdserve.worker.engines.sim import SimConfig, SimEngine

        return SimEngine(SimConfig(
            model=settings.model, gpu=settings.gpu, tp_size=settings.tp_size,
            block_size_tokens=settings.block_size_tokens, max_num_blocks=settings.max_num_blocks,
            kv_scale=settings.kv_scale, speedup=settings.speedup,
            num_kv_layers=settings.num_kv_layers, num_moe_layers=settings.num_moe_layers,
            expert_skew=settings.expert_skew, expert_seed=settings.expert_seed,
        ))
    if settings.engine == "tiny":
        from pdserve.worker.engines.tiny import TinyEngine

        return TinyEngine(tiny_config(settings))
    raise PdserveError(f"PDSERVE_ENGINE: expected sim or tiny, got {settings.engine!r}")


def tiny_config(settings: WorkerSettings) -> TinyConfig:
    """The tiny engine's shape from the worker's settings; ``ConfigError`` if inconsistent.
    Workers that hand KV to each other need equal shapes and seeds (equal weights)."""
    from pdserve.worker.engines.tiny import TinyConfig

    try:
        config = TinyConfig(
            num_layers=settings.tiny_num_layers, hidden_size=settings.tiny_hidden_size,
            num_heads=settings.tiny_num_heads, num_kv_heads=settings.tiny_num_kv_heads,
            intermediate_size=2 * settings.tiny_hidden_size,
            block_size_tokens=settings.block_size_tokens, seed=settings.tiny_seed,
        )
        if settings.max_num_blocks:
            config = dataclasses.replace(config, num_blocks=settings.max_num_blocks)
        return config
    except ValueError as exc:
        raise ConfigError(f"tiny engine: {exc}", field="tiny_hidden_size") from None


def kv_backend(settings: WorkerSettings) -> TransportBackend:
    """The KV transport; ``kv_tls`` runs the tcp data path over this worker's mutual TLS."""
    backend = get_backend(settings.transport)
    if not settings.kv_tls:
        return backend
    if settings.transport != "tcp":
        raise ConfigError(f"PDSERVE_KV_TLS: only the tcp transport has TLS, not "
                          f"{settings.transport!r} (run it in clear on a trusted fabric)",
                          field="kv_tls")
    from pdserve.worker.transports.tcp.backend import TcpBackend
    from pdserve.worker.transports.tcp.settings import KvTls, TcpTransportSettings

    assert settings.tls_cert_path and settings.tls_key_path and settings.tls_ca_path  # check()
    tls = KvTls(settings.tls_cert_path, settings.tls_key_path, settings.tls_ca_path)
    return TcpBackend(TcpTransportSettings(tls=tls))


class WorkerProcess:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        if settings.engine == "vllm":
            from pdserve.worker.engines.vllm.model_folders import check_model_folder

            assert settings.model_path is not None  # WorkerSettings.check
            check_model_folder(settings.model_path)  # one error naming model_path, first
        tokenizer_path = settings.tokenizer_path or (
            settings.model_path if settings.engine == "vllm" else None)
        self.tokenizer = bundle_from_folder(tokenizer_path) if tokenizer_path else None
        """The model tokenizer this worker ships to the control plane; None = the byte one."""
        self.credential = settings.worker_credential
        """What this worker presents on its calls: its provisioner's credential, else the one
        its pool returned at registration (joined by the join token alone)."""
        credential = bearer_interceptors(lambda: self.credential or None)
        self._coordinator_channel = open_channel(settings.coordinator_address, settings,
                                                 interceptors=credential)
        self._pool_channel = open_channel(settings.pool_address, settings,
                                          interceptors=credential)
        self.control = GrpcControlPlane(self._coordinator_channel, settings.worker_id)
        self.pool = PoolClient(self._pool_channel, settings.join_token)
        config = AgentConfig(worker_id=settings.worker_id, deployment=settings.deployment,
                             role=settings.role, transport=settings.transport,
                             max_batch_size=settings.max_batch_size,
                             decode_step_pause_s=settings.test_decode_step_pause_s,
                             is_prefix_cache_simulated=settings.engine == "sim",
                             max_prefill_stall_s=settings.max_prefill_stall_s)
        self.engine: Engine | None = None
        """The in-house engine (sim, tiny); None for a self-scheduling one (vllm)."""
        self.agent: WorkerAgent
        if settings.engine == "vllm":
            from pdserve.worker.engines.vllm.agents import create_vllm_agent

            self.agent = create_vllm_agent(settings, config, kv_backend(settings), self.control,
                                           interceptors=credential)
        else:
            self.engine = build_engine(settings)
            self.agent = create_agent(config, self.engine, kv_backend(settings), self.control)
        self.server = GrpcServer.from_settings(settings)
        self.server.add_servicer(SERVICE_NAME,
                                 worker_pb2_grpc.add_WorkerAgentServiceServicer_to_server,
                                 WorkerAgentServicer(self.agent, self.describe))
        self.address = ""
        self.heartbeat_interval_s = 1.0
        self._needs_full_prefix_report = True
        self._needs_tokenizer_sent = False
        self._next_expert_report_s = 0.0
        self.has_failed = False
        """The engine failed: the process reports FAILED, then exits non-zero."""

    def engine_readiness(self) -> Readiness | None:
        """A runtime that loads its engine in the background says when it can serve (vllm);
        None for the in-house ones (ready at once; ``cold_start_s`` simulates loading)."""
        readiness = getattr(self.agent.runtime, "readiness", None)
        return readiness if isinstance(readiness, Readiness) else None

    def describe(self) -> pb.WorkerInfo:
        layout = self.agent.runtime.layout
        return pb.WorkerInfo(
            worker_id=self.agent.config.worker_id, deployment=self.settings.deployment,
            role=role_to_pb(self.settings.role), state=worker_state_to_pb(self.agent.state),
            address=self.address, kv_address=self.agent.kv_address, engine=self.engine_name,
            gpu=self.settings.gpu, tp_size=self.settings.tp_size, model=self.settings.model,
            num_gpus=self.settings.tp_size,
            kv_layout=pb.KvLayout(num_layers=layout.num_layers, num_blocks=layout.num_blocks,
                                  block_size_tokens=layout.block_size_tokens,
                                  block_nbytes=layout.block_nbytes),
            kv_transports=[self.settings.transport],
            prefill_tokens_per_s=self.prefill_tokens_per_s(),
            tokenizer_sha256=self.tokenizer.sha256 if self.tokenizer else "",
            max_model_len=self.max_model_len(),
            software_version=software_version(),
            kv_frame_versions=self.agent.transport.frame_versions,
            admits_in_decode=True,
        )

    def max_model_len(self) -> int:
        """The context limit routers enforce: the engine's own when it has one (vLLM's, which
        ``vllm_max_model_len`` may set below the model's), else the tokenizer's; 0 = none."""
        limit = getattr(self.agent.runtime, "max_model_len", None)
        if isinstance(limit, int) and limit > 0:
            return limit
        return self.tokenizer.max_model_len if self.tokenizer else 0

    @property
    def engine_name(self) -> str:
        return self.engine.name if self.engine is not None else self.settings.engine

    def tokenizer_pb(self) -> pb.TokenizerBundle | None:
        return bundle_to_pb(self.tokenizer) if self.tokenizer else None

    def prefill_tokens_per_s(self) -> float:
        """Measured from this worker's recent prefills when it has any, else the engine's own
        estimate (0 when it has none)."""
        points = [(n, s) for n, _, s, is_prefill in self.agent.profile if is_prefill and s > 0]
        if points:
            return sum(n for n, _ in points) / sum(s for _, s in points)
        estimate = getattr(self.engine, "estimated_prefill_tokens_per_s", None)
        return float(estimate()) if callable(estimate) else 0.0

    @property
    def advertise_host(self) -> str:
        if self.settings.advertise_host_from_hostname:
            return socket.gethostname()
        return self.settings.advertise_host

    async def start(self) -> None:
        await self.agent.start(self.settings.kv_host, self.settings.kv_port)
        if self.settings.test_prefill_hold_signals and self.settings.role is WorkerRole.PREFILL:
            self._install_hold_signals()
        kv_host, _, kv_port = self.agent.kv_address.rpartition(":")
        if kv_host.strip("[]") in ("0.0.0.0", "::", ""):
            # Bound to every interface: peers need an address they can reach.
            self.agent.kv_address = f"{self.advertise_host}:{kv_port}"
        port = await self.server.start()
        self.address = f"{self.advertise_host}:{port}"
        response = await self.pool.register(self.describe(), self.settings.cold_start_s,
                                            self.tokenizer_pb(),
                                            deadline_s=self.settings.register_timeout_s)
        self.credential = response.worker_credential or self.credential
        self.agent.config = dataclasses.replace(self.agent.config, worker_id=response.worker_id)
        self.control.worker_id = response.worker_id
        self.heartbeat_interval_s = max(0.05, response.heartbeat_interval_ms / 1000)
        self.agent.state = WorkerState.LOADING
        logger.info("worker %s registered; grpc %s kv %s", response.worker_id, self.address,
                    self.agent.kv_address)

    def _install_hold_signals(self) -> None:
        """Fault injection: SIGUSR1 holds the in-house prefill loop, SIGUSR2 releases it."""
        import signal

        hold = getattr(self.agent.runtime, "hold", None)
        release = getattr(self.agent.runtime, "release", None)
        if hold is None or release is None:
            logger.warning("test_prefill_hold_signals: this runtime has no prefill loop to hold")
            return
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, hold)
        loop.add_signal_handler(signal.SIGUSR2, release)

    async def heartbeat(self) -> None:
        is_full = self._needs_full_prefix_report
        removed: list[int]
        if is_full:
            added, removed = self.agent.all_prefix_hashes(), []
        else:
            added, removed = self.agent.take_prefix_delta()
        held = self.agent.held_blocks() if self.settings.role is WorkerRole.DECODE else {}
        expert_counts: list[int]
        num_moe_layers, expert_counts = 0, []
        now_s = asyncio.get_running_loop().time()
        if now_s >= self._next_expert_report_s:
            # Counts since the previous report; a report lost with a failed heartbeat only makes
            # the governor's estimate a little older.
            num_moe_layers, expert_counts = self.agent.take_expert_token_counts()
            self._next_expert_report_s = now_s + self.settings.expert_report_interval_s
        tokenizer = self.tokenizer_pb() if self._needs_tokenizer_sent else None
        try:
            response = await self.pool.heartbeat(
                self.describe(), self.agent.state, self.agent.load(), held, added, removed,
                is_full, expert_counts, num_moe_layers, tokenizer)
        except Exception:
            if added or removed:  # the delta may not have reached the index: all of it next time
                self._needs_full_prefix_report = True
            raise
        self._needs_full_prefix_report = response.should_send_full_prefix_report
        self._needs_tokenizer_sent = response.should_send_tokenizer
        self.credential = response.worker_credential or self.credential
        reasons = list(response.drop_reasons)
        for i, pb_token in enumerate(response.drop_tokens):  # freed; this worker was not told
            token = token_from_pb(pb_token)
            why = reasons[i] if i < len(reasons) else ""
            reason = why or "the ledger no longer holds it"
            num_freed = self.agent.drop(token, reason)
            if num_freed:
                logger.warning("dropped ticket %s (%d blocks): the ledger no longer holds it "
                               "(%s)", token, num_freed, why or "no record of why")
        if response.should_drain:
            self.agent.begin_drain("pool manager asked")

    async def run(self, stop: asyncio.Event,
                  on_ready: Callable[[WorkerProcess], None] | None = None) -> None:
        """Cold start, then heartbeats until drained or ``stop``."""
        loop = asyncio.get_running_loop()
        ready_at = loop.time() + self.settings.cold_start_s / self.settings.cold_start_speedup
        while not stop.is_set():
            readiness = self.engine_readiness()
            if readiness is not None and readiness.state is EngineReadiness.FAILED and (
                    self.agent.state is not WorkerState.FAILED):
                logger.error("worker %s FAILED: its engine failed: %s",
                             self.agent.config.worker_id, readiness.error)
                self.agent.state = WorkerState.FAILED
            is_engine_ready = readiness is None or readiness.state is EngineReadiness.READY
            if (self.agent.state is WorkerState.LOADING and loop.time() >= ready_at
                    and is_engine_ready):
                self.agent.state = WorkerState.READY
                if readiness is not None:
                    # The engine sized its KV cache and context as it loaded: registering
                    # again puts its own layout and limit in the pool's record (the first
                    # registration could only estimate them).
                    try:
                        response = await self.pool.register(
                            self.describe(), self.settings.cold_start_s, self.tokenizer_pb())
                        self.credential = response.worker_credential or self.credential
                    except PdserveError as exc:
                        logger.warning("could not refresh the registration: %s", exc.message)
                logger.info("worker %s ready", self.agent.config.worker_id)
                if on_ready is not None:
                    on_ready(self)
            if self.agent.state is WorkerState.DRAINING and self.agent.num_in_flight == 0:
                self.agent.state = WorkerState.DRAINED
            try:
                await self.heartbeat()
                await self.agent.renew_queued_leases()
            except UnauthenticatedError:
                logger.error("the pool refused this worker's join token; stopping")
                stop.set()
                break
            except NotFoundError:
                logger.warning("the pool does not know this worker; registering again")
                self._needs_full_prefix_report = True
            except PdserveError as exc:
                logger.warning("heartbeat failed: %s", exc.message)
            if self.agent.state is WorkerState.DRAINED:
                logger.info("worker %s drained", self.agent.config.worker_id)
                break
            if self.agent.state is WorkerState.FAILED:
                self.has_failed = True  # reported; the pool replaces this worker
                break
            try:
                await asyncio.wait_for(stop.wait(), self.heartbeat_interval_s)
            except TimeoutError:
                pass

    async def close(self, *, is_registered: bool = True) -> None:
        """Stop serving and free the engine; leave the pool when this worker had joined it."""
        self.agent.begin_drain("shutting down")
        await self.server.stop()
        if is_registered:
            try:
                await self.pool.deregister(self.agent.config.worker_id)
            except PdserveError:
                pass
        await self.agent.close()
        await self.control.close()
        await self._coordinator_channel.close()
        await self._pool_channel.close()


def skew_wall_clock(offset_s: float) -> None:
    """Fault injection: this process's ``time.time``/``time.time_ns`` run ``offset_s`` ahead
    (behind if negative), like a host whose clock is off. Monotonic clocks are untouched (a
    skewed host's are too). Nothing of a worker's may depend on agreeing with another clock."""
    import types

    import grpc.aio._utils as grpc_aio_utils

    real_time, real_time_ns = time.time, time.time_ns
    offset_ns = int(offset_s * 1e9)
    # gRPC turns a timeout into a deadline with Python's time.time() and its C core compares
    # it with the core's own (unskewed) clock; on a skewed host both are skewed alike. Keep
    # the library consistent with its core, so only pdserve's code sees the skew.
    grpc_aio_utils.time = types.SimpleNamespace(time=real_time)  # type: ignore[assignment]
    time.time = lambda: real_time() + offset_s
    time.time_ns = lambda: real_time_ns() + offset_ns
    logger.warning("wall clock skewed by %+.1f s (fault injection)", offset_s)


async def run_worker(settings: WorkerSettings, stop: asyncio.Event,
                     announce: Callable[[str], None] = print) -> None:
    if settings.test_clock_offset_s:
        skew_wall_clock(settings.test_clock_offset_s)
    process = WorkerProcess(settings)
    try:
        await process.start()
    except BaseException:
        # E.g. the pool refused the join token: the gRPC server and KV receiver are already
        # up and must be stopped before the loop closes. Never deregister here: this process
        # did not join, and the worker id it names may be another worker's.
        await process.close(is_registered=False)
        raise
    announce(f"worker {process.agent.config.worker_id} grpc {process.address} "
             f"kv {process.agent.kv_address}")
    try:
        await process.run(stop, lambda p: announce(f"ready worker {p.agent.config.worker_id}"))
    finally:
        # A failed worker stays in the pool as FAILED (its history says why) until replaced.
        await process.close(is_registered=not process.has_failed)
    if process.has_failed:
        readiness = process.engine_readiness()
        raise UnavailableError(f"worker {process.agent.config.worker_id}: its engine failed"
                               + (f": {readiness.error}" if readiness else ""))
