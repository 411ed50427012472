"""Provisioners start and stop worker instances for a pool manager.

The pool manager decides *how many* and *which one to drain*; a provisioner only starts and
stops. ``LocalProcessProvisioner`` runs sim (or tiny) workers as local processes (``pdserve up``,
one machine); ``provisioner_docker.DockerProvisioner`` runs one container per worker through a
Docker engine; ``provisioner_kubernetes.KubernetesProvisioner`` scales one worker Deployment per
deployment and role. ``pool.app`` picks one by the pool manager's ``provisioner`` setting.

The guarantees stay with the pool manager: a worker leaves by draining first, and ``stop`` is
called only for the drained worker (or one that failed, or never became ready), never for one
still serving. Instances of the Docker and Kubernetes provisioners outlive the pool manager: a
restarted (or newly elected) pool manager finds them again through ``handles`` and adopts them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

WORKER_CREDENTIAL_ENV = "PDSERVE_WORKER_CREDENTIAL"
"""How a provisioner hands a worker its credential (the worker's ``worker_credential``)."""


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """What to start: one worker of a deployment and role, with the id it must register under
    (so the pool manager can tell its own launches apart) and extra CLI arguments."""

    worker_id: str
    deployment: str
    role: str
    args: tuple[str, ...] = ()


class Provisioner(Protocol):
    async def start(self, launch: WorkerLaunch) -> str:
        """Start an instance; returns its handle, which is the worker id it registers under:
        ``launch.worker_id`` where the provisioner can hand the worker its id (processes,
        containers), the pod's name where it cannot (a Deployment's pods)."""
        ...

    async def stop(self, handle: str) -> None:
        """Remove exactly this instance (drained, failed, or never ready); no-op if gone."""
        ...

    async def handles(self, deployment: str, role: str) -> list[str]:
        """The instances of ``deployment`` and ``role`` that exist now (starting or running),
        including those another pool manager process started."""
        ...

    async def close(self) -> None:
        """Release what the provisioner holds (local processes end with it)."""
        ...


@dataclass(slots=True)
class _Child:
    launch: WorkerLaunch
    process: asyncio.subprocess.Process
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class LocalProcessProvisioner:
    """Starts ``python -m pdserve serve worker ...`` children; stops them with SIGTERM, then
    SIGKILL."""

    def __init__(self, base_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 stop_timeout_s: float = 10.0,
                 worker_credential: Callable[[str], str] | None = None) -> None:
        """``worker_credential``: worker id -> the signed credential that worker gets
        (``PDSERVE_WORKER_CREDENTIAL``; ``credentials.ServiceTokens.mint_worker_credential``)."""
        self.base_args = list(base_args)
        """Arguments every launched worker gets (may be filled in after construction, e.g. once
        the control plane knows its own address)."""
        self._env = env
        self._worker_credential = worker_credential
        self._stop_timeout_s = stop_timeout_s
        self._children: dict[str, _Child] = {}

    async def start(self, launch: WorkerLaunch) -> str:
        argv = [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            "worker",
            "--deployment",
            launch.deployment,
            "--role",
            launch.role,
            "--worker-id",
            launch.worker_id,
            *self.base_args,
            *launch.args,
        ]
        env = dict(os.environ if self._env is None else self._env)
        if self._worker_credential is not None:
            env[WORKER_CREDENTIAL_ENV] = self._worker_credential(launch.worker_id)
        process = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        handle = launch.worker_id
        child = _Child(launch=launch, process=process)
        child.tasks.append(asyncio.create_task(self._forward_output(handle, process)))
        self._children[handle] = child
        logger.info("started %s worker for %s as %s", launch.role, launch.deployment, handle)
        return handle

    async def _forward_output(self, handle: str, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        while line := await process.stdout.readline():
            logger.debug("%s: %s", handle, line.decode(errors="replace").rstrip())

    async def stop(self, handle: str) -> None:
        child = self._children.pop(handle, None)
        if child is None:
            return
        process = child.process
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self._stop_timeout_s)
            except TimeoutError:
                process.kill()
                await process.wait()
        for task in child.tasks:
            task.cancel()

    async def handles(self, deployment: str, role: str) -> list[str]:
        return [
            handle for handle, child in self._children.items()
            if child.launch.deployment == deployment and child.launch.role == role
            and child.process.returncode is None
        ]

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(handle) for handle in list(self._children)))
