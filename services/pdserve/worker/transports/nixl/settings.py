"""Settings of the ``nixl`` backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NixlTransportSettings:
    """Knobs of the ``nixl`` backend; seconds."""

    connect_timeout_s: float = 5.0
    reply_timeout_s: float = 30.0
    sender_progress_interval_s: float = 0.001
    read_spin_polls: int = 256
    """Polls of a READ that yield to the loop without sleeping, before backing off."""
    read_poll_interval_s: float = 0.0005
    quiesce_spin_s: float = 0.05
    """``cancel`` drives a READ in flight this long before asking NIXL to cancel it."""
    quiesce_timeout_s: float = 10.0
    """Longest ``cancel`` waits for a READ in flight that NIXL cannot cancel."""


DEFAULT_NIXL_SETTINGS = NixlTransportSettings()
"""The default timeouts and polling intervals."""
