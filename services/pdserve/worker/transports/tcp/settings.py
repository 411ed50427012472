"""Settings of the ``tcp`` backend, and the mutual-TLS credentials of its data path (``KvTls``)."""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.worker.transports.frames import MAX_FRAME_NBYTES

logger = logging.getLogger(__name__)


class KvTls:
    """Mutual TLS of the KV data path: this worker's certificate and key, the cluster CA, and
    the SPIFFE kinds a peer's certificate must have (workers only, by default).

    The SSL contexts are rebuilt when the files change (checked at most every
    ``poll_interval_s``, on new connections), so renewed certificates need no restart.
    """

    def __init__(self, cert_path: Path, key_path: Path, ca_path: Path, *,
                 peer_kinds: frozenset[str] = frozenset({"worker"}),
                 poll_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._paths = (cert_path, key_path, ca_path)
        self.peer_kinds = peer_kinds
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamps = self._read_stamps()
        self._server, self._client = self._build()
        self._next_check_s = clock() + poll_interval_s

    def _read_stamps(self) -> list[tuple[int, int]]:
        return [(p.stat().st_mtime_ns, p.stat().st_size) for p in self._paths]

    def _build(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        cert_path, key_path, ca_path = self._paths
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the host name by default
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(cert_path, key_path)
            context.load_verify_locations(cafile=ca_path)
            context.verify_mode = ssl.CERT_REQUIRED
        return server, client

    def contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """``(server, client)`` contexts, rebuilt first if the files changed."""
        with self._lock:
            now = self._clock()
            if now >= self._next_check_s:
                self._next_check_s = now + self._poll_interval_s
                try:
                    stamps = self._read_stamps()
                    if stamps != self._stamps:
                        self._server, self._client = self._build()
                        self._stamps = stamps
                        logger.info("KV TLS certificate reloaded from %s", self._paths[0])
                except (OSError, ssl.SSLError) as exc:
                    logger.warning("KV TLS files changed but cannot be loaded (keeping the old "
                                   "ones): %s", exc)
            return self._server, self._client

    def check_peer(self, tls: ssl.SSLObject) -> None:
        """Raise ``ssl.SSLError`` unless the peer's certificate names an allowed SPIFFE kind."""
        from pdserve.common.certs import parse_spiffe_id

        cert = tls.getpeercert() or {}
        for entry in cert.get("subjectAltName", ()):
            match entry:
                case ("URI", str(uri)):
                    identity = parse_spiffe_id(uri)
                    if identity is not None and identity[0].value in self.peer_kinds:
                        return
        raise ssl.SSLError(f"KV peer is not one of {sorted(self.peer_kinds)}")


@dataclass(frozen=True, slots=True)
class TcpTransportSettings:
    """Knobs of the ``tcp`` backend. Timeouts are seconds; 0 buffer size = kernel autotuning."""

    socket_buffer_nbytes: int = 0
    connect_timeout_s: float = 5.0
    reply_timeout_s: float = 30.0
    max_frame_nbytes: int = MAX_FRAME_NBYTES
    yield_every_nbytes: int = 64 * 1024 * 1024
    """A receiver reading a long frame yields to the loop after this many bytes (fairness)."""
    multi_layer_frame_nbytes: int = 16 * 1024 * 1024
    """A sender puts layers that are ready together in one LAYERS frame up to this payload (a
    bound on how long another ticket's frames wait behind it on a shared connection)."""
    idle_close_s: float = 60.0
    """A sender's pooled connection unused this long is closed."""
    tls: KvTls | None = field(default=None, compare=False)
    """Mutual TLS on the data path; None = clear (trusted fabric)."""


DEFAULT_TCP_SETTINGS = TcpTransportSettings()
"""Clear text, kernel-tuned buffers, the default timeouts."""
