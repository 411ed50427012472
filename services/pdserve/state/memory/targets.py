"""``TargetStore`` in process memory."""

from __future__ import annotations

from pdserve.common.types import WorkerRole
from pdserve.state.shared import check_count, check_required


class MemoryTargetStore:
    """Target pool sizes of the one process."""

    def __init__(self) -> None:
        self._targets: dict[tuple[str, WorkerRole], int] = {}

    async def set_target(self, deployment: str, role: WorkerRole, num_workers: int) -> None:
        check_required(deployment, "deployment")
        check_count(num_workers, "num_workers", 0)
        self._targets[(deployment, WorkerRole(role))] = num_workers

    async def get_target(self, deployment: str, role: WorkerRole) -> int | None:
        return self._targets.get((deployment, WorkerRole(role)))
