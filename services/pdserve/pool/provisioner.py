"""Provisioners start and stop worker instances for a pool manager.

The pool manager decides *how many* and *which one to drain*; a provisioner only starts and
stops. ``LocalProcessProvisioner`` runs sim (or tiny) workers as local processes; a Kubernetes
provisioner comes later behind the same protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)


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
        """Start an instance; returns its handle, which is ``launch.worker_id``."""
        ...

    async def stop(self, handle: str) -> None: ...

    def handles(self, deployment: str, role: str) -> list[str]: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _Child:
    launch: WorkerLaunch
    process: asyncio.subprocess.Process
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class LocalProcessProvisioner:
    """Starts ``python -m pdserve serve worker ...`` children; stops them with SIGTERM, then
    SIGKILL."""

    def __init__(self, base_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 stop_timeout_s: float = 10.0) -> None:
        self.base_args = list(base_args)
        """Arguments every launched worker gets (may be filled in after construction, e.g. once
        the control plane knows its own address)."""
        self._env = env
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

    def handles(self, deployment: str, role: str) -> list[str]:
        return [
            handle for handle, child in self._children.items()
            if child.launch.deployment == deployment and child.launch.role == role
            and child.process.returncode is None
        ]

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(handle) for handle in list(self._children)))
