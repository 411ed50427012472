"""The local-prefill thresholds the governor publishes, as this router applies them.

The router reads every deployment's published threshold with one store call
(``ThresholdStore.list``) every ``refresh_s`` and keeps them in memory; routing reads the copy
(``routing_for``), so the hot path never waits on the store. A deployment with nothing published
(the governor has not decided yet, or the store lost it) routes with the router's own setting
(``RouterSettings.local_prefill_threshold_tokens``). A failed read keeps the last copy: the
store may be restarting, and the governor publishes again after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from pdserve.common.metrics import gauge
from pdserve.common.types import PublishedThreshold
from pdserve.router.policy import RoutingConfig
from pdserve.state.interfaces import ThresholdStore

logger = logging.getLogger(__name__)

THRESHOLD = gauge(
    "router", "local_prefill_threshold", "tokens",
    "Local-prefill threshold (uncached prompt tokens) this router applies per deployment: the "
    "governor's published one, else the router's setting.", ["model"])


class PublishedThresholds:
    """This router's copy of the published thresholds, and the routing config each implies."""

    def __init__(self, store: ThresholdStore, base: RoutingConfig,
                 refresh_s: float = 1.0) -> None:
        self._store = store
        self._base = base
        self._refresh_s = refresh_s
        self._published: dict[str, PublishedThreshold] = {}
        self._configs: dict[str, RoutingConfig] = {}
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def routing_for(self, deployment: str) -> RoutingConfig:
        """The routing config for a request to ``deployment`` (a dictionary lookup)."""
        return self._configs.get(deployment, self._base)

    def published(self, deployment: str) -> PublishedThreshold | None:
        return self._published.get(deployment)

    async def refresh(self) -> None:
        """Read every published threshold (one store call) and apply what changed."""
        published = await self._store.list()
        for deployment, threshold in published.items():
            before = self._published.get(deployment)
            if before is None or before.version != threshold.version:
                logger.info("local-prefill threshold of %s: %d tokens (%s, version %d)",
                            deployment, threshold.threshold_tokens, threshold.source,
                            threshold.version)
                THRESHOLD.labels(deployment).set(threshold.threshold_tokens)
        for deployment in self._published.keys() - published.keys():
            logger.info("local-prefill threshold of %s: none published, the setting (%d tokens) "
                        "applies", deployment, self._base.local_prefill_threshold_tokens)
            THRESHOLD.labels(deployment).set(self._base.local_prefill_threshold_tokens)
        self._configs = {
            deployment: dataclasses.replace(
                self._base, local_prefill_threshold_tokens=threshold.threshold_tokens)
            for deployment, threshold in published.items()}
        self._published = published

    async def start(self) -> None:
        """A first read (a failure is logged: the setting applies until one succeeds), then
        one every ``refresh_s``."""
        await self._refresh_logged()
        self._task = asyncio.create_task(self._run())

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except Exception:  # noqa: BLE001 - keep the last copy; the next read may succeed
            logger.debug("reading the published thresholds failed", exc_info=True)

    async def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._refresh_s)
            if not self._stop.is_set():
                await self._refresh_logged()

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
