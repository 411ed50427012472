"""``ThresholdStore`` on Redis: one hash for every deployment, so a router reads them all with
one ``HGETALL`` (see ``lua/threshold_publish.lua`` for its fields)."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from pdserve.common.types import Clock, PublishedThreshold, ThresholdSource
from pdserve.state.redis.calls import LuaScripts, store_call, unwrap_reply
from pdserve.state.redis.codec import redis_time, text_map, text_or_none
from pdserve.state.redis.keys import RedisKeys
from pdserve.state.shared import check_count, check_required

logger = logging.getLogger(__name__)

_IN_FORCE = "t:"
"""Field prefix of the threshold in force; ``v:`` fields count versions."""


def _parse(deployment: str, value: str) -> PublishedThreshold | None:
    try:
        tokens, source, version, published_s = value.split(" ")
        return PublishedThreshold(deployment, int(tokens), ThresholdSource(source),
                                  int(version), float(published_s))
    except ValueError:
        logger.warning("published threshold of %s is malformed (%r); ignored", deployment, value)
        return None


class RedisThresholdStore:
    """Published local-prefill thresholds, read by every router replica."""

    def __init__(self, client: aioredis.Redis, scripts: LuaScripts, keys: RedisKeys,
                 clock: Clock) -> None:
        self._client = client
        self._scripts = scripts
        self._keys = keys
        self._clock = clock

    @store_call
    async def publish(self, deployment: str, threshold_tokens: int,
                      source: ThresholdSource) -> PublishedThreshold:
        check_required(deployment, "deployment")
        check_count(threshold_tokens, "threshold_tokens", 0)
        source = ThresholdSource(source)
        now_s = self._clock()
        reply = unwrap_reply(await self._scripts(
            "threshold_publish", [self._keys.thresholds()],
            [deployment, threshold_tokens, source.value, redis_time(now_s)]))
        return PublishedThreshold(deployment, threshold_tokens, source, int(reply[0]), now_s)

    @store_call
    async def clear(self, deployment: str) -> None:
        check_required(deployment, "deployment")
        await self._client.hdel(self._keys.thresholds(), _IN_FORCE + deployment)

    @store_call
    async def get(self, deployment: str) -> PublishedThreshold | None:
        check_required(deployment, "deployment")
        value = text_or_none(await self._client.hget(self._keys.thresholds(),
                                                     _IN_FORCE + deployment))
        return None if value is None else _parse(deployment, value)

    @store_call
    async def list(self) -> dict[str, PublishedThreshold]:
        fields = text_map(await self._client.hgetall(self._keys.thresholds()))
        published = {}
        for name, value in fields.items():
            if name.startswith(_IN_FORCE):
                deployment = name.removeprefix(_IN_FORCE)
                parsed = _parse(deployment, value)
                if parsed is not None:
                    published[deployment] = parsed
        return published
