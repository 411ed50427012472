"""The settings of a router replica (``pdserve serve router``).

Every field has an environment variable ``PDSERVE_<NAME>`` and a flag ``--name`` (the flag wins);
``pdserve serve router --help`` lists them with their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import ConfigError
from pdserve.common.settings import CommonSettings
from pdserve.common.settings_fields import setting
from pdserve.common.settings_parsers import (
    ADDRESS,
    DURATION_S,
    PORT_OR_OFF,
    Parser,
    float_range,
    int_range,
)


def _tenant_values(parse_value: type[int | float]) -> Parser[tuple[tuple[str, float], ...]]:
    """``tenant=value,tenant=value``; an empty tenant name (``=4``) is the default tenant."""

    def parse(raw: str) -> tuple[tuple[str, float], ...]:
        pairs = []
        for part in raw.split(","):
            if not part.strip():
                continue
            tenant, sep, value = part.partition("=")
            number = parse_value(value.strip())
            if not sep or not number > 0:
                raise ValueError(raw)
            pairs.append((tenant.strip(), number))
        return tuple(pairs)

    kind = "integers" if parse_value is int else "numbers"
    return Parser(f"comma-separated tenant=value pairs (positive {kind})", parse)


TENANT_INTS = _tenant_values(int)
TENANT_FLOATS = _tenant_values(float)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings(CommonSettings):
    """A router replica."""

    service_name: str = setting("router", help="Service name in logs, traces and metrics.")
    http_host: str = setting("127.0.0.1", help="Interface of the OpenAI-compatible HTTP API.")
    http_port: int = setting(0, parser=PORT_OR_OFF, help="HTTP port; 0 = any, -1 = off.")
    http_tls_cert_path: Path | None = setting(
        None,
        help="PEM certificate (chain) the HTTP API serves HTTPS with; unset: plain HTTP (put a "
             "TLS-terminating proxy in front).")
    http_tls_key_path: Path | None = setting(None, help="PEM private key of http_tls_cert_path.")
    coordinator_address: str = setting(
        parser=ADDRESS,
        help="host:port of the KV-transfer coordinator.")
    max_attempts: int = setting(
        3, parser=int_range(1, 10),
        help="Attempts per request before the first token (and per failover).")
    max_failovers: int = setting(
        3, parser=int_range(0, 100),
        help="Times a request's stream may move to another decode worker after its first token "
             "(its decode worker died); 0 = the client gets UNAVAILABLE instead.")
    max_failover_s: float = setting(
        30.0, parser=DURATION_S,
        help="Extra time a request's failovers may take in all (each from the break to the next "
             "token); beyond it the client gets UNAVAILABLE naming the request.")
    max_in_flight: int = setting(
        4096, parser=int_range(1, 1_000_000),
        help="Requests admitted at once.")
    max_tokens_limit: int = setting(
        32768, parser=int_range(1, 10_000_000),
        help="Largest max_tokens accepted.")
    local_prefill_threshold_tokens: int = setting(
        64, parser=int_range(0, 10_000_000),
        help="Uncached prompt tokens at or below which decode prefills itself, for a deployment "
             "the governor has published no threshold for.")
    threshold_refresh_s: float = setting(
        1.0, parser=float_range(0.05, 3600.0),
        help="How often the router reads the local-prefill thresholds the governor publishes "
             "(one store read for every deployment), seconds.")
    prefill_saturation_tokens: int = setting(
        65536, parser=int_range(0, 10**9),
        help="Queued prefill tokens beyond which prompts prefill locally.")
    lease_s: float = setting(10.0, parser=DURATION_S, help="Lease asked for each ticket.")
    stream_idle_timeout_s: float = setting(
        20.0, parser=DURATION_S,
        help="Longest silence of a decode stream after its first token (before it, plus the KV "
             "wait) before the request ends with DEADLINE_EXCEEDED.")
    transport: str = setting("tcp", help="KV transport workers use.")
    slo_ttft_ms: float = setting(
        2000.0, parser=float_range(0.001, 1e9),
        help="TTFT SLO for goodput, ms.")
    slo_tpot_ms: float = setting(
        100.0, parser=float_range(0.001, 1e9),
        help="TPOT SLO for goodput, ms.")
    outcome_window_s: float = setting(
        10.0, parser=DURATION_S,
        help="Window of the durable request-outcome aggregates.")
    # Admission and load shedding: pdserve.router.admission.
    is_shedding_enabled: bool = setting(
        True,
        help="Shed requests whose predicted TTFT misses the SLO, and tenants over their share of "
             "a saturated queue.")
    shed_ttft_fraction: float = setting(
        0.8, parser=float_range(0.01, 100.0),
        help="Shed when the predicted TTFT exceeds this fraction of slo_ttft_ms.")
    fair_share_onset: float = setting(
        0.5, parser=float_range(0.01, 1.0),
        help="Queue saturation (fraction of the TTFT budget or of max_pending_requests) beyond "
             "which tenants over their share are shed.")
    max_pending_requests: int = setting(
        1024, parser=int_range(1, 1_000_000),
        help="Router queue bound: admitted requests whose prefill has not finished.")
    tenant_share: float = setting(
        0.5, parser=float_range(0.001, 1.0),
        help="Default in-flight cap of a tenant, as a fraction of max_in_flight.")
    tenant_max_in_flight: tuple[tuple[str, int], ...] = setting(
        (), parser=TENANT_INTS,
        help="Per-tenant in-flight caps, tenant=N pairs (=N for the default tenant).")
    tenant_weights: tuple[tuple[str, float], ...] = setting(
        (), parser=TENANT_FLOATS,
        help="Fair-share weights, tenant=W pairs; others weigh 1.")
    max_retry_after_s: float = setting(
        10.0, parser=DURATION_S,
        help="Longest retry hint given to a shed request.")

    def check(self) -> None:
        CommonSettings.check(self)
        if (self.http_tls_cert_path is None) != (self.http_tls_key_path is None):
            raise ConfigError(
                "PDSERVE_HTTP_TLS_CERT_PATH and PDSERVE_HTTP_TLS_KEY_PATH: expected both set or "
                "both empty", field="http_tls_cert_path")
