"""Wiring of a pool manager: core, servicer, provisioner and its health/actuation loop."""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable

from pdserve.api.v1 import pool_pb2_grpc
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.leadership import LeaderElector, Lease, holder_id, open_lease
from pdserve.common.service import GrpcService
from pdserve.common.types import Clock
from pdserve.db.durable import LifecycleSinkAdapter, open_durable
from pdserve.pool.manager import LifecycleSink, PoolManager, PoolPolicy
from pdserve.pool.provisioner import LocalProcessProvisioner, Provisioner
from pdserve.pool.servicer import SERVICE_NAME, PoolServicer
from pdserve.pool.settings import PoolSettings, ProvisionerKind
from pdserve.state.interfaces import StateBackend
from pdserve.state.prefix_index import PrefixIndex
from pdserve.state.stores import open_stores


class PoolApp:
    def __init__(self, settings: PoolSettings, backend: StateBackend, prefix_index: PrefixIndex,
                 clock: Clock, provisioner: Provisioner | None = None,
                 lifecycle_sink: LifecycleSink | None = None,
                 actuation_lease: Lease | None = None) -> None:
        """``actuation_lease``: replicas of one pool share it, and only its holder actuates
        (``PoolManager.actuation_elector``); None = this manager always actuates."""
        self.settings = settings
        worker_args = tuple(shlex.split(settings.worker_args))
        policy = PoolPolicy(
            role=settings.role, join_token=settings.join_token,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            record_ttl_s=max(60.0, settings.heartbeat_timeout_s * 4),
            launch_args={d: worker_args for d in settings.deployments},
            ready_timeout_s=settings.worker_ready_timeout_s,
        )
        self.manager = PoolManager(
            policy, backend, prefix_index, clock, provisioner, lifecycle_sink
        )
        if settings.join_token_path is not None:
            from pdserve.common.credentials import TokenFile

            self.manager.join_token_source = TokenFile(settings.join_token_path).tokens
        self.servicer = PoolServicer({settings.role: self.manager}, backend.workers, backend.events,
                                     mint_credential=worker_credentials(settings))
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._elector_task: asyncio.Task[None] | None = None
        if actuation_lease is not None:
            self.manager.actuation_elector = LeaderElector(
                actuation_lease, ttl_s=max(3.0, 3 * settings.heartbeat_interval_s))

    def register(self, server: GrpcServer) -> None:
        server.add_servicer(SERVICE_NAME, pool_pb2_grpc.add_PoolServiceServicer_to_server,
                            self.servicer)

    async def start(self) -> None:
        if self.settings.initial_target_size >= 0:
            for deployment in self.settings.deployments:
                await self.manager.set_target(deployment, self.settings.initial_target_size)
        if self.manager.actuation_elector is not None:
            self._elector_task = asyncio.create_task(
                self.manager.actuation_elector.run(self._stop))
        self._task = asyncio.create_task(self.manager.run(self._stop, self.settings.deployments))

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        if self._elector_task is not None:
            await self._elector_task
        await self.manager.close()


def open_provisioner(settings: PoolSettings) -> Provisioner | None:
    """The provisioner ``settings.provisioner`` names, or None without ``is_provisioning``.
    Docker and Kubernetes need their client library (the ``docker``/``kubernetes`` extras).
    ``worker_args`` go to each launch; the container image's command is ``pdserve``."""
    if not settings.is_provisioning:
        return None
    if settings.provisioner is ProvisionerKind.DOCKER:
        from pdserve.pool.provisioner_docker import DockerProvisioner, DockerWorkerSpec

        spec = DockerWorkerSpec(image=settings.docker_image, scope=settings.docker_scope,
                                network=settings.docker_network,
                                num_gpus=settings.docker_gpus_per_worker)
        return DockerProvisioner.from_url(spec, newest_join_token(settings), settings.docker_url,
                                          is_removing_on_close=settings.is_removing_workers_on_close,
                                          worker_credential=worker_credentials(settings))
    if settings.provisioner is ProvisionerKind.KUBERNETES:
        from pdserve.pool.provisioner_kubernetes import KubernetesProvisioner

        return KubernetesProvisioner.connect(settings.kubernetes_namespace,
                                             settings.kubernetes_api_url)
    return LocalProcessProvisioner(worker_credential=worker_credentials(settings))


def worker_credentials(settings: PoolSettings) -> Callable[[str], str] | None:
    """Worker id -> the credential a worker started by this pool gets, signed with the service
    token; None without a service token file (workers then present none). Kubernetes names its
    pods itself, so its workers get none this way (there, use mutual TLS)."""
    from pdserve.common.credentials import load_service_tokens

    tokens = load_service_tokens(settings)
    if tokens is None or tokens.presented() is None:
        return None
    return tokens.mint_worker_credential


def newest_join_token(settings: PoolSettings) -> Callable[[], str]:
    """The join token a new worker gets: the file's last line (a rotation appends the new token,
    moves the workers over, then removes the old one), else ``join_token``."""
    if settings.join_token_path is None:
        return lambda: settings.join_token
    from pdserve.common.credentials import TokenFile

    tokens = TokenFile(settings.join_token_path).tokens
    return lambda: tokens()[-1]


def build(settings: PoolSettings) -> GrpcService:
    """A pool manager as its own process. With ``is_provisioning`` it starts workers through
    the provisioner its settings name, and its replicas share a lease so that one actuates at a
    time."""
    stores = open_stores(settings.redis_url)
    durable = open_durable(settings.database_url, settings.durable_spool_dir,
                           settings.service_name, migrate=False)
    provisioner = open_provisioner(settings)
    lease = (open_lease(stores.redis_client, f"pool-actuation:{settings.role}", holder_id())
             if provisioner is not None else None)
    app = PoolApp(settings, stores.backend, stores.prefix_index, time.time, provisioner,
                  LifecycleSinkAdapter(durable) if durable else None, lease)
    return GrpcService(settings.service_name, settings, app,
                       [stores.close, *([durable.close] if durable else [])])
