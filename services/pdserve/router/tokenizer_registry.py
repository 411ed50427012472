"""Which tokenizer the router uses for each deployment: the model's own, or the byte tokenizer.

A deployment whose workers serve a real model advertises its tokenizer's digest
(``WorkerInfo.tokenizer_sha256``); its bundle sits in the hot state, where the workers' pool
manager put it. The registry loads a bundle once per digest, as soon as the pool view shows a
worker with a digest it lacks (so the first request does not wait for it), keeps a few tokenizers
(least recently used beyond ``max_cached`` go) and hands the front ends the one of a request's
deployment. Deployments whose workers ship no tokenizer (``sim``, ``tiny``) use the byte
tokenizer, whose vocabulary those engines share.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Protocol

from pdserve.common.errors import UnavailableError
from pdserve.common.hf_tokenizer import HfTokenizer
from pdserve.common.tokenizer import ByteTokenizer, Tokenizer
from pdserve.router.pool_view import PoolView, WorkerView
from pdserve.state.interfaces import TokenizerStore

logger = logging.getLogger(__name__)

DEFAULT_MAX_CACHED = 8
"""Model tokenizers kept in memory (a large vocabulary takes tens of MB)."""


class TokenizerSource(Protocol):
    """What the front ends need: the tokenizer of a deployment."""

    async def for_model(self, deployment: str) -> Tokenizer:
        """Raises ``UnavailableError`` while the deployment's tokenizer cannot be had (its
        bundle is not in the store yet: its workers send it again with their next heartbeat)."""
        ...


class TokenizerRegistry:
    """The deployments' tokenizers for one router replica (see the module docstring)."""

    def __init__(self, view: PoolView, store: TokenizerStore, *,
                 default: Tokenizer | None = None, max_cached: int = DEFAULT_MAX_CACHED) -> None:
        self._view = view
        self._store = store
        self._default = default or ByteTokenizer()
        self._max_cached = max_cached
        self._loaded: collections.OrderedDict[str, HfTokenizer] = collections.OrderedDict()
        """Digest -> tokenizer, least recently used first."""
        self._loading: dict[str, asyncio.Task[HfTokenizer]] = {}
        view.add_listener(self._notice)

    async def for_model(self, deployment: str) -> Tokenizer:
        sha256 = self._view.tokenizer_sha256(deployment)
        if not sha256:
            return self._default
        tokenizer = self._loaded.get(sha256)
        if tokenizer is not None:
            self._loaded.move_to_end(sha256)
            return tokenizer
        # Shielded: a request that is cancelled while it waits does not cancel the shared load.
        return await asyncio.shield(self._load_task(sha256))

    def _notice(self, worker: WorkerView) -> None:
        """A worker entered the view or changed: load its tokenizer ahead of any request."""
        sha256 = worker.info.tokenizer_sha256
        if sha256 and sha256 not in self._loaded:
            self._load_task(sha256)

    def _load_task(self, sha256: str) -> asyncio.Task[HfTokenizer]:
        task = self._loading.get(sha256)
        if task is None:
            task = asyncio.create_task(self._load(sha256))
            self._loading[sha256] = task
            task.add_done_callback(lambda done: self._loaded_or_failed(sha256, done))
        return task

    async def _load(self, sha256: str) -> HfTokenizer:
        bundle = await self._store.get(sha256)
        if bundle is None:
            raise UnavailableError(
                f"tokenizer {sha256[:12]} is not in the store yet (its workers send it again "
                "with their next heartbeat); retry shortly")
        tokenizer = await asyncio.to_thread(HfTokenizer.from_bundle, bundle)
        self._loaded[sha256] = tokenizer
        while len(self._loaded) > self._max_cached:
            self._loaded.popitem(last=False)
        logger.info("tokenizer %s loaded (%d tokens)", sha256[:12], tokenizer.vocab_size)
        return tokenizer

    def _loaded_or_failed(self, sha256: str, task: asyncio.Task[HfTokenizer]) -> None:
        """Forget the finished load (a failed one is tried again by the next caller)."""
        self._loading.pop(sha256, None)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("loading tokenizer %s failed: %s", sha256[:12], task.exception())
