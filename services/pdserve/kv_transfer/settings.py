"""The settings of the KV-transfer coordinator (``pdserve serve kv-transfer``).

Every field has an environment variable ``PDSERVE_<NAME>`` and a flag ``--name`` (the flag wins);
``pdserve serve kv-transfer --help`` lists them with their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.settings import CommonSettings
from pdserve.common.settings_fields import setting
from pdserve.common.settings_parsers import DURATION_S


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorSettings(CommonSettings):
    """The KV-transfer coordinator."""

    service_name: str = setting("kv-transfer", help="Service name in logs, traces and metrics.")
    default_lease_s: float = setting(
        10.0, parser=DURATION_S,
        help="Lease of a ticket unless the caller asks.")
    max_lease_s: float = setting(300.0, parser=DURATION_S, help="Longest lease granted.")
    reap_interval_s: float = setting(
        0.5, parser=DURATION_S,
        help="How often lapsed leases are reaped.")
