"""Settings: one frozen object per service, parsed once at start-up, then passed down.

``CommonSettings`` holds what every pdserve service has (logging, tracing, gRPC and metrics
listeners, the state stores, TLS, key files). A service composes it by subclassing it, adding its
own fields and, if it wants, re-declaring a common field to change its default::

    @dataclass(frozen=True, slots=True, kw_only=True)
    class RouterSettings(CommonSettings):
        service_name: str = setting("router", help="Service name in logs, traces and metrics.")
        max_inflight_requests: int = setting(
            4096, parser=int_range(1, 1_000_000), help="Admission limit per router replica."
        )
        request_timeout_s: float = setting(
            600.0, parser=DURATION_S, help="Deadline of a whole Generate call."
        )

        def check(self) -> None:  # optional cross-field checks; call the parent's explicitly
            CommonSettings.check(self)

    settings = parse_settings(RouterSettings, sys.argv[1:], os.environ)

(``check`` calls the parent by name because zero-argument ``super()`` does not work in slotted
dataclasses on Python 3.11.) Fields are declared and loaded with ``pdserve.common.settings_fields``
(``setting``, ``parse_settings``: flag > environment > default); their parsers are in
``pdserve.common.settings_parsers``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import ConfigError
from pdserve.common.settings_fields import setting
from pdserve.common.settings_parsers import (
    DATABASE_URL,
    DURATION_S,
    HOST,
    OTLP_ENDPOINT,
    PORT,
    PORT_OR_OFF,
    RATIO,
    REDIS_URL,
    format_address,
    int_range,
)


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(enum.StrEnum):
    JSON = "json"
    TEXT = "text"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Paths of PEM files for gRPC TLS. Server: ``cert_path``/``key_path`` are its identity and
    ``ca_path``, when set, turns on mutual TLS (clients must present a cert signed by it).
    Client: ``ca_path`` verifies the server; ``cert_path``/``key_path`` are its mTLS identity."""

    cert_path: Path | None = None
    key_path: Path | None = None
    ca_path: Path | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommonSettings:
    """Settings every pdserve service has. Subclass to add a service's own."""

    service_name: str = setting(
        "pdserve", help="Service name in logs, traces (service.name) and metrics."
    )
    log_level: LogLevel = setting(LogLevel.INFO, help="Lowest level logged.")
    log_format: LogFormat = setting(
        LogFormat.JSON, help="json: one JSON object per line with the trace id; text: for humans."
    )
    otel_endpoint: str = setting(
        "",
        parser=OTLP_ENDPOINT,
        help="OTLP gRPC collector to send traces to. Empty: no tracing at all (no interceptors).",
    )
    # Why 0.01: what costs CPU is having the gRPC interceptors installed (+~40% CPU on a trivial
    # unary call in our measurement), not the ratio (sampling 100% instead of 0% added ~15% more).
    # Tracing is therefore switched on and off by the endpoint; the ratio only picks which root
    # requests are traced (ParentBased: services downstream follow the caller's decision), and 1%
    # gives a steady sample of end-to-end traces at negligible export volume.
    otel_sampling_ratio: float = setting(
        0.01,
        parser=RATIO,
        help="Share of root requests traced (0..1), honoured only where a trace starts; "
        "0 turns tracing off even with an endpoint.",
    )
    grpc_host: str = setting(
        "127.0.0.1",
        parser=HOST,
        help="Interface the gRPC and metrics servers listen on (0.0.0.0 or :: for all).",
    )
    grpc_port: int = setting(0, parser=PORT, help="gRPC port; 0 = any free port (printed).")
    grpc_max_message_bytes: int = setting(
        64 * 1024 * 1024,
        parser=int_range(1024, 2**31 - 1),
        help="Largest gRPC message sent or received, in bytes.",
    )
    metrics_port: int = setting(
        0, parser=PORT_OR_OFF, help="Prometheus /metrics port; 0 = any free port, -1 = off."
    )
    grace_period_s: float = setting(
        15.0,
        parser=DURATION_S,
        help="On SIGTERM, how long in-flight calls may run before they are cancelled.",
    )
    redis_url: str = setting(
        "memory://",
        parser=REDIS_URL,
        help="Hot-state store (control-plane services only); memory:// = in-process.",
    )
    database_url: str = setting(
        "sqlite:///pdserve.db",
        parser=DATABASE_URL,
        help="Durable store, a SQLAlchemy URL (control-plane services only).",
    )
    durable_spool_dir: Path | None = setting(
        None,
        help="Folder of the spool of durable records that wait for the database (kept across "
        "restarts; records of a dead process are adopted by the next one). Empty: a "
        "pdserve-spool folder in the system's temporary folder.",
    )
    tls_cert_path: Path | None = setting(None, help="PEM certificate of this process (TLS).")
    tls_key_path: Path | None = setting(None, help="PEM private key of tls_cert_path.")
    tls_ca_path: Path | None = setting(
        None, help="PEM CA bundle: verifies peers; on a server it requires client certs (mTLS)."
    )
    api_keys_path: Path | None = setting(
        None,
        help="File of '<key> <tenant>' lines: client API keys (gRPC and HTTP), reloaded on "
        "change. Unset: the client API is open.",
    )
    admin_keys_path: Path | None = setting(
        None,
        help="File of '<key> <operator>' lines: keys of the operator API (drain, target "
        "sizes, autoscaler controls), reloaded on change. Unset: the operator API is open.",
    )
    service_tokens_path: Path | None = setting(
        None,
        help="File of service tokens, one a line (or sha256:<hex> lines: verify only), reloaded "
        "on change: services present the last one on their internal channels, and it signs "
        "worker credentials. Required on every service once keys are configured without "
        "mutual TLS (else internal methods refuse every caller).",
    )
    service_token_grace_s: float = setting(
        300.0,
        parser=DURATION_S,
        help="How long a token removed from service_tokens_path (and the worker credentials it "
        "signed) stays accepted, in seconds.",
    )
    kv_tls: bool = setting(
        False,
        help="Run the tcp KV data path over mutual TLS with this process's TLS files "
        "(default: clear, for a trusted fabric).",
    )

    def check(self) -> None:
        """Cross-field checks; raises ``ConfigError``."""
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ConfigError(
                "PDSERVE_TLS_CERT_PATH and PDSERVE_TLS_KEY_PATH: expected both set or both empty",
                field="tls_cert_path",
            )
        if self.kv_tls and (self.tls_cert_path is None or self.tls_ca_path is None):
            raise ConfigError(
                "PDSERVE_KV_TLS: expected PDSERVE_TLS_CERT_PATH, PDSERVE_TLS_KEY_PATH and "
                "PDSERVE_TLS_CA_PATH to be set (the KV path is mutual TLS)",
                field="kv_tls",
            )
        if self.grpc_port != 0 and self.metrics_port == self.grpc_port:
            raise ConfigError(
                f"PDSERVE_METRICS_PORT: expected a port other than PDSERVE_GRPC_PORT, "
                f"got {self.metrics_port}",
                field="metrics_port",
            )

    @property
    def call_credential(self) -> str:
        """A credential of this process's own to present on its channels instead of a service
        token (a worker's credential); ``""`` for none."""
        return ""

    @property
    def tls(self) -> TlsConfig | None:
        """The TLS files, or None when this process speaks plaintext gRPC."""
        if self.tls_cert_path is None and self.tls_ca_path is None:
            return None
        return TlsConfig(self.tls_cert_path, self.tls_key_path, self.tls_ca_path)

    @property
    def grpc_address(self) -> str:
        """``host:port`` to bind, IPv6 hosts bracketed."""
        return format_address(self.grpc_host, self.grpc_port)
