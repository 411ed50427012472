"""Choosing a hot-state backend (its tunables and shared pieces are in ``pdserve.state.shared``).

``open_backend("redis://host:6379/0", clock)`` gives the shared Redis backend (many replicas of
each service; ``redis+cluster://`` and ``redis+sentinel://`` URLs give it on a Redis Cluster or
behind Sentinel); ``open_backend(None, clock)`` or ``"memory://"`` the embedded in-process backend
(one process). Both pass the same contract suite (``tests/integration/test_state_contract.py``).
"""

from __future__ import annotations

from pdserve.common.errors import ConfigError
from pdserve.common.types import Clock
from pdserve.state.interfaces import StateBackend
from pdserve.state.shared import StateOptions

__all__ = ["StateOptions", "open_backend"]

MEMORY_SCHEME = "memory"


def open_backend(
    url: str | None, clock: Clock, options: StateOptions | None = None
) -> StateBackend:
    """The backend named by ``url``: ``redis://``/``rediss://``/``unix://`` -> one Redis,
    ``redis+cluster://`` -> Redis Cluster, ``redis+sentinel://`` -> a master behind Sentinel
    (``pdserve.common.redis_url``), ``memory://`` or None -> in-process. ``clock`` is the
    coordinator's clock; every lease and timestamp the backend writes comes from it. Raises
    ``ConfigError`` for any other scheme."""
    options = options or StateOptions()
    scheme = (url or f"{MEMORY_SCHEME}://").partition("://")[0].lower()
    if scheme == MEMORY_SCHEME:
        from pdserve.state.memory.backend import MemoryStateBackend

        return MemoryStateBackend(clock, options)
    from pdserve.common.redis_url import REDIS_SCHEMES

    if scheme in REDIS_SCHEMES:
        from pdserve.state.redis.backend import RedisStateBackend

        assert url is not None
        return RedisStateBackend.from_url(url, clock, options)
    raise ConfigError(
        "redis_url (PDSERVE_REDIS_URL): expected redis://, rediss://, unix://, redis+cluster://, "
        f"redis+sentinel:// or memory://, got scheme {scheme!r}"
    )
