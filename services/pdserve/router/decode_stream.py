"""Reading a decode worker's token stream while the request's prefill still runs: the next
message, or the prefill's error as soon as it fails (the decode side would only time out), or
the worker's death as soon as its pool manager declares it (a stream to a host that vanished may
otherwise stay open until the idle bound)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.api.v1 import worker_pb2
from pdserve.common.errors import DeadlineError, UnavailableError

GONE_POLL_S = 0.5
"""How often a waiting read asks whether the decode worker is gone."""


async def next_or_prefill_failure(
    stream: AsyncIterator[worker_pb2.DecodeResponse],
    prefill_task: asyncio.Task[worker_pb2.PrefillResponse] | None,
    idle_timeout_s: float,
    why_gone: Callable[[], str] | None = None,
) -> worker_pb2.DecodeResponse | None:
    """The next decode message; if prefill fails first, its error (the decode side would only
    time out). ``DeadlineError`` if nothing comes within ``idle_timeout_s``; ``UnavailableError``
    as soon as ``why_gone`` (asked every ``GONE_POLL_S`` while waiting) names a reason the worker
    is gone."""
    read = asyncio.ensure_future(_next_message(stream, prefill_task))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + idle_timeout_s
    try:
        while True:
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                raise DeadlineError(f"no decode message within {idle_timeout_s:.1f}s")
            wait_s = remaining_s if why_gone is None else min(GONE_POLL_S, remaining_s)
            done, _ = await asyncio.wait({read}, timeout=wait_s)
            if done:
                return read.result()
            reason = why_gone() if why_gone is not None else ""
            if reason:
                raise UnavailableError(reason)
    finally:
        if not read.done():
            read.cancel()  # timed out, gone or cancelled: do not leave the read behind


async def _next_message(
    stream: AsyncIterator[worker_pb2.DecodeResponse],
    prefill_task: asyncio.Task[worker_pb2.PrefillResponse] | None,
) -> worker_pb2.DecodeResponse | None:
    next_message = asyncio.ensure_future(anext(stream, None))
    try:
        return await _first_of(next_message, prefill_task)
    except asyncio.CancelledError:
        next_message.cancel()  # timed out or cancelled: do not leave the read behind
        raise


async def _first_of(
    next_message: asyncio.Future[worker_pb2.DecodeResponse | None],
    prefill_task: asyncio.Task[worker_pb2.PrefillResponse] | None,
) -> worker_pb2.DecodeResponse | None:
    if prefill_task is None or prefill_task.done():
        error = prefill_task.exception() if prefill_task is not None else None
        if error is not None:
            next_message.cancel()
            raise error
        return await next_message
    waited: set[asyncio.Future[Any]] = {next_message, prefill_task}
    done, _ = await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
    if next_message in done:
        return next_message.result()
    error = prefill_task.exception()
    if error is None:
        return await next_message
    next_message.cancel()
    with contextlib.suppress(BaseException):
        await next_message
    raise error
