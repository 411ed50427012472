"""How the Redis stores call Redis: Lua scripts registered once, their replies turned into results
or ``PdserveError``s, and connection failures turned into ``UnavailableError``."""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from pdserve.common.errors import (
    AlreadyExistsError,
    CapacityError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    StaleTokenError,
    UnavailableError,
)

P = ParamSpec("P")
R = TypeVar("R")

_ERRORS_BY_CODE: dict[str, type[PdserveError]] = {
    "stale": StaleTokenError,
    "illegal": IllegalTransitionError,
    "invalid": InvalidArgumentError,
    "notfound": NotFoundError,
    "exists": AlreadyExistsError,
}
"""Error codes of ``{'err', code, message, extra}`` script replies (``lua/_lib.lua``)."""


def store_call(method: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn Redis connection failures into ``UnavailableError``, which callers retry and gRPC
    reports as UNAVAILABLE. For every Redis-backed store (these, the prefix index, the
    rendezvous)."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
            raise UnavailableError(f"state store unavailable ({type(exc).__name__})") from exc

    return wrapper


def _lua(name: str) -> str:
    return importlib.resources.files("pdserve.state").joinpath("lua", name).read_text("utf-8")


class LuaScripts:
    """The Lua scripts, registered once; redis-py loads them again after a server restart.

    Ledger scripts run after ``_lib.lua`` and ``_ledger.lua``, the others after ``_lib.lua``.
    A call returns the raw reply; ``unwrap_reply`` reads it.
    """

    _LEDGER = (
        "set_capacity", "open", "transition", "extend", "mark_held", "release", "reap",
        "drop_worker", "reconcile",
    )
    _PLAIN = ("worker_heartbeat", "worker_set_state", "events_head", "events_publish",
              "tokenizer_touch", "threshold_publish")

    def __init__(self, client: aioredis.Redis) -> None:
        lib = _lua("_lib.lua")
        ledger_lib = lib + "\n" + _lua("_ledger.lua")
        self._scripts = {name: client.register_script(ledger_lib + "\n" + _lua(f"{name}.lua"))
                         for name in self._LEDGER}
        self._scripts.update(
            {name: client.register_script(lib + "\n" + _lua(f"{name}.lua")) for name in self._PLAIN}
        )

    def queue(self, pipe: Any, name: str, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Queue the script on a pipeline by its digest alone (no SCRIPT EXISTS round trip);
        its reply is ``NoScriptError`` when the server does not have it (restarted): run it
        then with ``__call__``, which loads it."""
        pipe.evalsha(self._scripts[name].sha, len(keys), *keys, *args)

    async def __call__(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        reply: list[Any] = await self._scripts[name](keys=list(keys), args=list(args))
        return reply


def unwrap_reply(reply: Sequence[Any]) -> list[Any]:
    """The payload of an ``{'ok', ...}`` script reply; raises the mapped error otherwise."""
    if reply[0] == "ok":
        return list(reply[1:])
    _, code, message, extra = reply
    if code == "capacity":
        raise CapacityError(message, retry_after_s=float(extra))
    error = _ERRORS_BY_CODE.get(code, PdserveError)
    raise error(message, field=extra or None)
