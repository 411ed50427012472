"""Values as the Redis stores write and read them.

Every client of the hot state is made with ``decode_responses=True`` (see
``RedisStateBackend.from_url``), so Redis replies are text; redis-py types them ``bytes | str``
whatever the client, and the ``text*`` helpers say what they are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, cast


def redis_time(seconds: float) -> str:
    """A float as the shortest decimal that reads back exactly (Lua and Redis parse it)."""
    return repr(float(seconds))


def to_ms(seconds: float) -> int:
    """Whole milliseconds for ``PEXPIRE``/``PX``/``BLOCK``, rounded up and at least 1."""
    return max(1, math.ceil(seconds * 1000))


def pairs(flat: Sequence[str]) -> dict[str, str]:
    """A hash from the flat ``field, value, ...`` list a script replies with."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def text(reply: bytes | str) -> str:
    return cast(str, reply)


def text_or_none(reply: bytes | str | None) -> str | None:
    return cast(str | None, reply)


def texts(reply: Iterable[Any]) -> list[str]:
    """Members of a set, or of a sorted-set range asked without scores."""
    return cast(list[str], list(reply))


def text_map(reply: dict[bytes | str, bytes | str]) -> dict[str, str]:
    return cast(dict[str, str], reply)
