"""Workers as Docker containers, one per instance, through the Docker Engine API (the ``docker``
SDK, ``pip install 'pdserve[docker]'``).

Each container runs ``pdserve serve worker`` from ``DockerWorkerSpec.image`` under the worker id
the pool manager chose (the container's name and host name are ``<scope>-<worker id>``, so the
worker advertises an address that resolves on the container network), with labels that tie it
to its stack, deployment and role, and a GPU device request when the spec asks for GPUs. The
worker reports its own lifecycle (REGISTERING -> LOADING -> READY) to its pool manager; the
container's state only says whether the process still runs.

A drained worker exits by itself; ``stop`` removes exactly the container it names. ``handles``
lists the live containers of a deployment and role (another pool manager process may have
started them: they are adopted) and removes containers whose process has exited, after logging
the end of their output, so nothing dead piles up on the host.

The SDK is synchronous (HTTP over the engine's socket): every call runs on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.pool.provisioner import WorkerLaunch

if TYPE_CHECKING:
    import docker
    from docker.models.containers import Container

logger = logging.getLogger(__name__)

LABEL_SCOPE = "io.pdserve.scope"
"""Which stack a container belongs to; a pool manager adopts only its own scope's containers."""
LABEL_DEPLOYMENT = "io.pdserve.deployment"
LABEL_ROLE = "io.pdserve.role"
LABEL_WORKER_ID = "io.pdserve.worker-id"

_LIVE_STATUSES = frozenset({"created", "running", "restarting"})
_LOG_TAIL_LINES = 20


@dataclass(frozen=True, slots=True)
class DockerWorkerSpec:
    """How every worker container of one pool manager is made."""

    image: str
    scope: str = "pdserve"
    """Label value and container-name prefix: several stacks can share one engine."""
    network: str = ""
    """Network to join (a compose stack's network, or ``host``); empty = the default bridge."""
    base_args: tuple[str, ...] = ()
    """``pdserve serve worker`` arguments every container gets (pool and coordinator address,
    engine, model, ...), before the launch's own."""
    environment: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of every container (never the join token: see ``join_token``)."""
    num_gpus: int = 0
    """GPUs requested per container (a ``DeviceRequest`` for the engine's GPU runtime)."""
    stop_timeout_s: float = 30.0
    """SIGTERM to SIGKILL when stopping a container that still runs."""


class DockerProvisioner:
    """``Provisioner`` over a Docker engine. ``join_token`` returns the token new workers get
    (the newest one, so that rotation moves new workers over first)."""

    def __init__(self, spec: DockerWorkerSpec, join_token: Callable[[], str],
                 client: docker.DockerClient, *, is_removing_on_close: bool = False,
                 worker_credential: Callable[[str], str] | None = None) -> None:
        """``worker_credential``: worker id -> the signed credential its container gets."""
        self.spec = spec
        self._join_token = join_token
        self._worker_credential = worker_credential
        self._client = client
        self._is_removing_on_close = is_removing_on_close

    @classmethod
    def from_url(cls, spec: DockerWorkerSpec, join_token: Callable[[], str], url: str = "",
                 *, is_removing_on_close: bool = False,
                 worker_credential: Callable[[str], str] | None = None) -> DockerProvisioner:
        """A provisioner on the engine at ``url`` (empty = ``DOCKER_HOST`` or the local
        socket); fails at once when the engine does not answer."""
        import docker

        client = docker.DockerClient(base_url=url) if url else docker.from_env()
        client.ping()
        return cls(spec, join_token, client, is_removing_on_close=is_removing_on_close,
                   worker_credential=worker_credential)

    def container_name(self, worker_id: str) -> str:
        return f"{self.spec.scope}-{worker_id}"

    async def start(self, launch: WorkerLaunch) -> str:
        await asyncio.to_thread(self._run, launch)
        logger.info("started %s worker container %s for %s", launch.role,
                    self.container_name(launch.worker_id), launch.deployment)
        return launch.worker_id

    def _run(self, launch: WorkerLaunch) -> None:
        from docker.types import DeviceRequest

        spec = self.spec
        name = self.container_name(launch.worker_id)
        command = ["serve", "worker", "--deployment", launch.deployment, "--role", launch.role,
                   "--worker-id", launch.worker_id, *spec.base_args, *launch.args]
        options: dict[str, Any] = {}
        if spec.network == "host":
            options["network_mode"] = "host"
        else:
            options["hostname"] = name
            if spec.network:
                options["network"] = spec.network
        if spec.num_gpus:
            options["device_requests"] = [DeviceRequest(count=spec.num_gpus,
                                                        capabilities=[["gpu"]])]
        self._client.containers.run(
            spec.image, command, name=name, detach=True,
            labels={LABEL_SCOPE: spec.scope, LABEL_DEPLOYMENT: launch.deployment,
                    LABEL_ROLE: launch.role, LABEL_WORKER_ID: launch.worker_id},
            environment=self._environment(launch.worker_id),
            stop_signal="SIGTERM", **options,
        )

    def _environment(self, worker_id: str) -> dict[str, str]:
        environment = {**self.spec.environment, "PDSERVE_JOIN_TOKEN": self._join_token()}
        if self._worker_credential is not None:
            environment["PDSERVE_WORKER_CREDENTIAL"] = self._worker_credential(worker_id)
        return environment

    async def stop(self, handle: str) -> None:
        await asyncio.to_thread(self._remove, self.container_name(handle))

    def _remove(self, name: str) -> None:
        from docker.errors import NotFound

        try:
            container = self._client.containers.get(name)
        except NotFound:
            return
        try:
            if container.status in _LIVE_STATUSES:
                container.stop(timeout=int(self.spec.stop_timeout_s))
            container.remove(force=True)
        except NotFound:
            return
        logger.info("removed worker container %s", name)

    async def handles(self, deployment: str, role: str) -> list[str]:
        return await asyncio.to_thread(self._handles, deployment, role)

    def _containers(self, extra_labels: Mapping[str, str] = {}) -> list[Container]:  # noqa: B006
        filters = [f"{LABEL_SCOPE}={self.spec.scope}",
                   *(f"{key}={value}" for key, value in extra_labels.items())]
        return list(self._client.containers.list(all=True, filters={"label": filters}))

    def _handles(self, deployment: str, role: str) -> list[str]:
        live = []
        for container in self._containers({LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role}):
            worker_id = container.labels.get(LABEL_WORKER_ID, "")
            if container.status in _LIVE_STATUSES:
                live.append(worker_id)
                continue
            # Exited (drained and gone, or crashed): its pool manager no longer counts it.
            tail = container.logs(tail=_LOG_TAIL_LINES).decode(errors="replace").rstrip()
            exit_code = container.attrs.get("State", {}).get("ExitCode")
            logger.log(logging.INFO if exit_code == 0 else logging.WARNING,
                       "worker container %s exited (%s); last output:\n%s",
                       container.name, exit_code, tail)
            self._remove(container.name or "")
        return sorted(live)

    async def close(self) -> None:
        if self._is_removing_on_close:
            names = [c.name or "" for c in await asyncio.to_thread(self._containers)]
            await asyncio.gather(*(asyncio.to_thread(self._remove, name) for name in names))
        await asyncio.to_thread(self._client.close)
