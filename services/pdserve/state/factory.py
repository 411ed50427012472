"""Choosing a hot-state backend, its tunables, and the pieces both backends share.

``open_backend("redis://host:6379/0", clock)`` gives the shared Redis backend (many replicas of
each service); ``open_backend(None, clock)`` or ``"memory://"`` the embedded in-process backend
(one process). Both pass the same contract suite (``tests/integration/test_state_contract.py``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pdserve.common.errors import ConfigError, InvalidArgumentError
from pdserve.state.interfaces import StateBackend
from pdserve.state.types import Clock, TicketState

MEMORY_SCHEME = "memory"
REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True, slots=True)
class StateOptions:
    """Tunables shared by both backends.

    ``key_prefix`` is the first part of every Redis key (tests use a random one to isolate
    themselves on a shared Redis). ``ticket_retention_s``: how long a ticket whose blocks are free
    stays readable by ``get``/``find``/``list_tickets`` (coordinator-clock seconds).
    ``reconcile_grace_s``: a ticket younger than this is never released by ``reconcile`` just
    because the worker's report does not mention it yet (the report may predate the ticket).
    ``stream_max_len``: events kept per deployment's change stream (Redis trims approximately, in
    whole stream nodes, so it may keep up to ~100 more). ``ticket_index_ttl_s``: lifetime of the
    Redis id -> decode worker index of a live ticket (a held sequence older than this can no
    longer be released by token; reconciliation frees its blocks once the worker stops
    reporting it).
    """

    key_prefix: str = "pdserve"
    ticket_retention_s: float = 600.0
    reconcile_grace_s: float = 30.0
    stream_max_len: int = 10_000
    ticket_index_ttl_s: float = 86_400.0

    def __post_init__(self) -> None:
        if not self.key_prefix or any(c in self.key_prefix for c in "{}: \t\n"):
            raise ConfigError(
                f"key_prefix: non-empty, without braces, colons or spaces, got {self.key_prefix!r}"
            )
        for name in ("ticket_retention_s", "reconcile_grace_s", "ticket_index_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}: a finite number >= 0, got {value!r}")
        if self.stream_max_len < 1:
            raise ConfigError(f"stream_max_len: >= 1, got {self.stream_max_len}")


class BlockHolding(enum.StrEnum):
    """Where a ticket's blocks are in the ledger: counted as reserved (under a lease), held by a
    running sequence (no lease), or free again (released, aborted, expired)."""

    RESERVED = "reserved"
    HELD = "held"
    FREE = "free"


FREEING_STATES = frozenset({TicketState.ABORTED, TicketState.EXPIRED})
"""Transitions into these free the ticket's reserved blocks."""

REASON_RELEASED = "released"
REASON_LEASE_EXPIRED = "lease expired"
REASON_LEASE_EXPIRED_DONE = "lease expired before mark_held"
REASON_WORKER_DROPPED = "decode worker dropped"
REASON_NOT_REPORTED = "not reported by decode worker"
REASON_ADOPTED = "adopted from worker report"


def format_cursor(epoch: str, seq: int) -> str:
    """A change-stream cursor: the stream's epoch (new after every store loss) and the sequence
    number of the last event read (0 = before the first event)."""
    return f"{epoch}:{seq}"


def parse_cursor(cursor: str) -> tuple[str, int] | None:
    """``(epoch, seq)``, or None for the empty cursor (never read: resync from a snapshot)."""
    if not cursor:
        return None
    epoch, sep, seq_text = cursor.rpartition(":")
    if not sep or not epoch or not seq_text.isdigit():
        raise InvalidArgumentError(f"cursor: expected 'epoch:seq', got {cursor!r}", field="cursor")
    return epoch, int(seq_text)


def open_backend(
    url: str | None, clock: Clock, options: StateOptions | None = None
) -> StateBackend:
    """The backend named by ``url``: ``redis://``/``rediss://``/``unix://`` -> Redis, ``memory://``
    or None -> in-process. ``clock`` is the coordinator's clock; every lease and timestamp the
    backend writes comes from it. Raises ``ConfigError`` for any other scheme."""
    options = options or StateOptions()
    scheme = (url or f"{MEMORY_SCHEME}://").partition("://")[0].lower()
    if scheme == MEMORY_SCHEME:
        from pdserve.state.memory_backend import MemoryStateBackend

        return MemoryStateBackend(clock, options)
    if scheme in REDIS_SCHEMES:
        from pdserve.state.redis_backend import RedisStateBackend

        assert url is not None
        return RedisStateBackend.from_url(url, clock, options)
    raise ConfigError(
        f"state URL: expected redis://, rediss://, unix:// or memory://, got scheme {scheme!r}"
    )
