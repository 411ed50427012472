"""``ThresholdStore`` in process memory."""

from __future__ import annotations

from pdserve.common.types import Clock, PublishedThreshold, ThresholdSource
from pdserve.state.shared import check_count, check_required


class MemoryThresholdStore:
    """Published local-prefill thresholds of the one process; times from the injected clock."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._published: dict[str, PublishedThreshold] = {}
        self._versions: dict[str, int] = {}

    async def publish(self, deployment: str, threshold_tokens: int,
                      source: ThresholdSource) -> PublishedThreshold:
        check_required(deployment, "deployment")
        check_count(threshold_tokens, "threshold_tokens", 0)
        version = self._versions.get(deployment, 0) + 1
        self._versions[deployment] = version
        published = PublishedThreshold(deployment, threshold_tokens, ThresholdSource(source),
                                       version, self._clock())
        self._published[deployment] = published
        return published

    async def clear(self, deployment: str) -> None:
        check_required(deployment, "deployment")
        self._published.pop(deployment, None)

    async def get(self, deployment: str) -> PublishedThreshold | None:
        check_required(deployment, "deployment")
        return self._published.get(deployment)

    async def list(self) -> dict[str, PublishedThreshold]:
        return dict(self._published)
