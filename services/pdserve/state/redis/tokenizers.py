"""``TokenizerStore`` on Redis: one hash per bundle, its fields as text."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.tokenizer_bundle import TokenizerBundle
from pdserve.common.types import Clock
from pdserve.state.redis.calls import LuaScripts, store_call, unwrap_reply
from pdserve.state.redis.codec import redis_time, text_map, to_ms
from pdserve.state.redis.keys import RedisKeys
from pdserve.state.shared import check_required, check_ttl

logger = logging.getLogger(__name__)

_TEXT_FIELDS = ("chat_template", "bos_token", "eos_token", "pad_token")


class RedisTokenizerStore:
    """``TokenizerStore`` on Redis. The client decodes replies as text, so ``tokenizer_json``
    (UTF-8 JSON, checked before it was accepted) is stored as text too. Expiry is on the
    injected clock (``expires_s``), with a ``PEXPIRE`` backstop of the same TTL; ``touch`` is one
    script, so a bundle is never left half there."""

    def __init__(self, client: aioredis.Redis, scripts: LuaScripts, keys: RedisKeys,
                 clock: Clock) -> None:
        self._client = client
        self._scripts = scripts
        self._keys = keys
        self._clock = clock

    @store_call
    async def put(self, bundle: TokenizerBundle, ttl_s: float) -> None:
        check_ttl(ttl_s)
        key = self._keys.tokenizer_bundle(bundle.sha256)
        fields: dict[FieldT, EncodableT] = {
            "tokenizer_json": bundle.tokenizer_json.decode("utf-8"),
            **{name: getattr(bundle, name) for name in _TEXT_FIELDS},
            "max_model_len": str(bundle.max_model_len),
            "expires_s": redis_time(self._clock() + ttl_s),
        }
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, to_ms(ttl_s))
            await pipe.execute()

    @store_call
    async def get(self, sha256: str) -> TokenizerBundle | None:
        check_required(sha256, "sha256")
        fields = text_map(await self._client.hgetall(self._keys.tokenizer_bundle(sha256)))
        if not fields or float(fields["expires_s"]) <= self._clock():
            return None
        try:
            bundle = TokenizerBundle(
                tokenizer_json=fields["tokenizer_json"].encode("utf-8"),
                **{name: fields[name] for name in _TEXT_FIELDS},
                max_model_len=int(fields["max_model_len"]))
        except (KeyError, ValueError, InvalidArgumentError):
            logger.warning("tokenizer bundle %s in the store is malformed; ignored", sha256)
            return None
        if bundle.sha256 != sha256:
            logger.warning("tokenizer bundle %s in the store has another digest; ignored", sha256)
            return None
        return bundle

    @store_call
    async def touch(self, sha256: str, ttl_s: float) -> bool:
        check_required(sha256, "sha256")
        check_ttl(ttl_s)
        now = self._clock()
        reply = unwrap_reply(await self._scripts(
            "tokenizer_touch", [self._keys.tokenizer_bundle(sha256)],
            [redis_time(now), redis_time(now + ttl_s), to_ms(ttl_s)]))
        return bool(int(reply[0]))
