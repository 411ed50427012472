"""How the Redis stores call Redis: Lua scripts registered once, their replies turned into results
or ``PdserveError``s, and connection failures turned into ``UnavailableError``."""

from __future__ import annotations

import functools
import importlib.resources
import math
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
    "unavailable": UnavailableError,
}
"""Error codes of ``{'err', code, message, extra}`` script replies (``lua/_lib.lua``)."""


UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    # A failover in progress: a demoted master (READONLY), a cluster without a master for some
    # slot (CLUSTERDOWN, MASTERDOWN), a slot being moved (TRYAGAIN), a redirection a
    # transaction cannot follow (MOVED, ASK: its EXEC did not run), a topology the client could
    # not learn (uncovered slots, nodes that disagree or do not answer). None ran the command.
    redis_errors.ReadOnlyError,
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    redis_errors.AskError,
    redis_errors.ClusterError,
    redis_errors.RedisClusterException,
)
"""Redis failures that mean "not now": callers retry them (gRPC UNAVAILABLE)."""

_PROGRAMMING_ERRORS = (redis_errors.CrossSlotTransactionError, redis_errors.InvalidPipelineStack)

UNBLOCKED_PREFIX = "UNBLOCKED"
"""A blocking read (XREAD BLOCK) that its master ended by becoming a replica: nothing was read."""


def _is_torn_down_connection(exc: Exception) -> bool:
    """An ``AttributeError`` raised inside redis-py's connection code: redis-py 8.1's cluster
    client can tear a connection down (handling another command's failure during a failover)
    while a command is connecting on it, which then writes to a closed socket (``None``). The
    command was not sent."""
    if not isinstance(exc, AttributeError):
        return False
    innermost = exc.__traceback__
    while innermost is not None and innermost.tb_next is not None:
        innermost = innermost.tb_next
    module = innermost.tb_frame.f_globals.get("__name__", "") if innermost else ""
    return str(module).startswith("redis.asyncio.connection")


def _is_redis_py_runtime_error(exc: Exception) -> bool:
    """A ``RuntimeError`` raised while redis-py's asyncio client ran: under a cluster failover its
    connection handling can make two commands share a connection (asyncio's ``read() called
    while another coroutine is already waiting``) or change its node tables while another
    command iterates them. The command's outcome is unknown: like a lost connection, callers
    retry (each store write is safe to repeat or ends by its lease)."""
    if not isinstance(exc, RuntimeError):
        return False
    frame = exc.__traceback__
    while frame is not None:
        if str(frame.tb_frame.f_globals.get("__name__", "")).startswith("redis.asyncio"):
            return True
        frame = frame.tb_next
    return False


def _is_unavailable(exc: Exception) -> bool:
    if _is_torn_down_connection(exc) or _is_redis_py_runtime_error(exc):
        return True
    if isinstance(exc, _PROGRAMMING_ERRORS):
        return False
    if isinstance(exc, UNAVAILABLE_ERRORS):
        return True
    return isinstance(exc, redis_errors.ResponseError) and str(exc).startswith(UNBLOCKED_PREFIX)


def store_call(method: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn Redis connection failures and failovers in progress (``UNAVAILABLE_ERRORS``, an
    unblocked read) into ``UnavailableError``, which callers retry and gRPC reports as
    UNAVAILABLE. For every Redis-backed store (these, the prefix index, the rendezvous)."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (redis_errors.RedisError, redis_errors.RedisClusterException,
                AttributeError, RuntimeError) as exc:
            if not _is_unavailable(exc):
                raise
            raise UnavailableError(f"state store unavailable ({type(exc).__name__})") from exc

    return wrapper


def _lua(name: str) -> str:
    return importlib.resources.files("pdserve.state").joinpath("lua", name).read_text("utf-8")


class LuaScripts:
    """The Lua scripts, registered once; redis-py loads them again after a server restart.
    With ``replica_acks`` (``StateOptions``), each call is pipelined with ``WAIT`` and succeeds
    only once that many replicas have its writes.

    Ledger scripts run after ``_lib.lua`` and ``_ledger.lua``, the others after ``_lib.lua``.
    A call returns the raw reply; ``unwrap_reply`` reads it.
    """

    _LEDGER = (
        "set_capacity", "open", "transition", "extend", "mark_held", "release", "reap",
        "drop_worker", "reconcile", "describe_worker", "hold_done",
    )
    _PLAIN = ("worker_heartbeat", "worker_set_state", "events_head", "events_publish",
              "tokenizer_touch", "threshold_publish")

    def __init__(self, client: aioredis.Redis, replica_acks: int = 0,
                 replica_ack_timeout_s: float = 0.5) -> None:
        self._client = client
        self._replica_acks = replica_acks
        self._replica_ack_timeout_ms = max(1, math.ceil(replica_ack_timeout_s * 1000))
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
        # ``execute_command``: a cluster pipeline refuses ``evalsha()`` by name, yet routes the
        # command by its keys (one slot) like any other.
        pipe.execute_command("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)

    def queue_replica_wait(self, pipe: Any) -> bool:
        """With ``replica_acks``, queue ``WAIT`` after the writes queued on ``pipe`` (one
        connection: WAIT covers exactly them); its reply goes to ``check_replica_acks``."""
        if self._replica_acks:
            pipe.execute_command("WAIT", self._replica_acks, self._replica_ack_timeout_ms)
        return bool(self._replica_acks)

    def check_replica_acks(self, reply: Any) -> None:
        """Raise ``UnavailableError`` unless ``WAIT`` saw enough replicas: the write happened on
        this master but a failover may lose it, so its outcome is unknown."""
        if isinstance(reply, BaseException):
            raise reply
        if int(reply) < self._replica_acks:
            raise UnavailableError(
                f"state store write reached {int(reply)} of {self._replica_acks} replicas; "
                "its outcome is unknown")

    async def __call__(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        if not self._replica_acks:
            reply: list[Any] = await self._scripts[name](keys=list(keys), args=list(args))
            return reply
        for _ in range(2):
            async with self._client.pipeline(transaction=False) as pipe:
                self.queue(pipe, name, keys, args)
                self.queue_replica_wait(pipe)
                reply, num_acked = await pipe.execute(raise_on_error=False)
            if not isinstance(reply, redis_errors.NoScriptError):
                break
            await self._client.script_load(self._scripts[name].script)  # a restarted Redis
        if isinstance(reply, BaseException):
            raise reply
        self.check_replica_acks(num_acked)
        return list(reply)


def unwrap_reply(reply: Sequence[Any]) -> list[Any]:
    """The payload of an ``{'ok', ...}`` script reply; raises the mapped error otherwise."""
    if reply[0] == "ok":
        return list(reply[1:])
    _, code, message, extra = reply
    if code == "capacity":
        raise CapacityError(message, retry_after_s=float(extra))
    error = _ERRORS_BY_CODE.get(code, PdserveError)
    raise error(message, field=extra or None)
