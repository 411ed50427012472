"""Which Redis failures a store call reports as UNAVAILABLE (callers retry): connection loss and
failovers in progress, whose commands did not run; anything else passes through."""

from __future__ import annotations

import pytest
from redis import exceptions as redis_errors

from pdserve.common.errors import UnavailableError
from pdserve.state.redis.calls import store_call


async def _call_raising(exc: Exception) -> None:
    @store_call
    async def call() -> None:
        raise exc

    await call()


@pytest.mark.parametrize("exc", [
    redis_errors.ConnectionError("closed"),
    redis_errors.TimeoutError("slow"),
    redis_errors.ReadOnlyError("You can't write against a read only replica."),
    redis_errors.ClusterDownError("The cluster is down"),
    redis_errors.TryAgainError("Multiple keys request during rehashing of slot"),
    redis_errors.MovedError("3999 127.0.0.1:6381"),
    redis_errors.SlotNotCoveredError("slot 12 not covered"),
    redis_errors.RedisClusterException("All slots are not covered after query all startup_nodes"),
    redis_errors.ResponseError("UNBLOCKED force unblock from blocking operation, instance state "
                               "changed (master -> replica?)"),
])
async def test_failovers_in_progress_are_unavailable(exc: Exception) -> None:
    with pytest.raises(UnavailableError):
        await _call_raising(exc)


@pytest.mark.parametrize("exc", [
    redis_errors.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
    redis_errors.CrossSlotTransactionError("keys in one transaction span slots"),
    redis_errors.NoScriptError("NOSCRIPT"),
])
async def test_other_redis_errors_pass_through(exc: Exception) -> None:
    with pytest.raises(type(exc)):
        await _call_raising(exc)


async def test_a_connection_torn_down_inside_redis_py_is_unavailable() -> None:
    """redis-py 8.1's cluster client may close a connection another command is connecting on;
    the AttributeError that follows is raised in its connection module, before anything is
    sent. An AttributeError anywhere else is a bug and passes through."""
    as_redis_py: dict[str, object] = {"__name__": "redis.asyncio.connection"}
    exec("def write(writer):\n    writer.writelines([b'PING'])\n", as_redis_py)  # noqa: S102

    @store_call
    async def torn_down() -> None:
        as_redis_py["write"](None)  # type: ignore[operator]

    @store_call
    async def buggy() -> None:
        None.writelines([])  # type: ignore[attr-defined]

    with pytest.raises(UnavailableError):
        await torn_down()
    with pytest.raises(AttributeError):
        await buggy()


async def test_a_runtime_error_inside_redis_py_is_unavailable() -> None:
    """Under a cluster failover redis-py's asyncio client can read one connection from two
    commands (asyncio refuses the second read with a RuntimeError): the command's outcome is
    unknown, so it is UNAVAILABLE (callers retry). A RuntimeError of pdserve's own passes."""
    as_redis_py: dict[str, object] = {"__name__": "redis.asyncio.connection"}
    exec("def read(reader):\n    return reader()\n", as_redis_py)  # noqa: S102

    def asyncio_refuses() -> None:
        raise RuntimeError("read() called while another coroutine is already waiting for "
                           "incoming data")

    @store_call
    async def shared_connection() -> None:
        as_redis_py["read"](asyncio_refuses)  # type: ignore[operator]

    @store_call
    async def ours() -> None:
        asyncio_refuses()

    with pytest.raises(UnavailableError):
        await shared_connection()
    with pytest.raises(RuntimeError):
        await ours()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1"])
async def test_the_prefix_index_client_never_retries_inside_redis_py(url: str) -> None:
    """Routing asks the prefix index for every request and routes without hints when it fails:
    its client fails at once (a cluster client's own retries reconnect and sleep through a
    whole failover). The state backend's client does not retry either (a script may have run)."""
    from pdserve.state.stores import open_stores

    stores = open_stores(url)  # nothing connects until a command
    try:
        for client in (stores.prefix_client, stores.backend.client):
            retry = (client.retry if hasattr(client, "nodes_manager")
                     else client.connection_pool.connection_kwargs["retry"])
            assert retry.get_retries() == 0
    finally:
        await stores.close()
