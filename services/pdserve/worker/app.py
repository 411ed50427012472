"""A worker agent as its own process (``pdserve serve worker``): ``build`` is its entry, as for
every service; the process itself (engine, agent, gRPC server, membership loop) is
``pdserve.worker.process``."""

from __future__ import annotations

import asyncio

from pdserve.common.service import Announce
from pdserve.worker.process import run_worker
from pdserve.worker.settings import WorkerSettings


class WorkerService:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings

    async def run(self, stop: asyncio.Event, announce: Announce) -> None:
        """Register, announce ``worker <id> grpc ... kv ...``, then ``ready worker <id>`` once
        the engine has loaded; heartbeat until drained or ``stop``."""
        await run_worker(self.settings, stop, announce)


def build(settings: WorkerSettings) -> WorkerService:
    return WorkerService(settings)
