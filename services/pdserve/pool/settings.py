"""The settings of a pool manager (``pdserve serve prefill-pool`` / ``decode-pool``).

Every field has an environment variable ``PDSERVE_<NAME>`` and a flag ``--name`` (the flag wins);
``pdserve serve prefill-pool --help`` lists them with their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import ConfigError
from pdserve.common.settings import CommonSettings
from pdserve.common.settings_fields import setting
from pdserve.common.settings_parsers import DURATION_S, int_range
from pdserve.common.types import WorkerRole


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSettings(CommonSettings):
    """A pool manager (one per role)."""

    service_name: str = setting("pool", help="Service name in logs, traces and metrics.")
    role: WorkerRole = setting(help="Pool this manager serves: prefill or decode.")
    join_token: str = setting("", help="Secret workers present to join (or join_token_path).",
                              is_secret=True)
    join_token_path: Path | None = setting(
        None,
        help="File of join tokens, one per line, all valid; re-read when it changes (rotation "
             "without a restart). Replaces join_token.")
    deployments: tuple[str, ...] = setting((), help="Deployments whose size this manager actuates.")
    heartbeat_interval_s: float = setting(1.0, parser=DURATION_S, help="Worker heartbeat period.")
    heartbeat_timeout_s: float = setting(
        5.0, parser=DURATION_S,
        help="No heartbeat this long = FAILED.")
    is_provisioning: bool = setting(
        False,
        help="Start and stop local worker processes to meet the target size.")
    worker_args: str = setting("", help="Extra arguments for provisioned workers (shell words).")
    initial_target_size: int = setting(
        -1, parser=int_range(-1, 100_000),
        help="Target size set at start (-1 = leave).")

    def check(self) -> None:
        CommonSettings.check(self)
        if not self.join_token and self.join_token_path is None:
            raise ConfigError("PDSERVE_JOIN_TOKEN: required, set it or PDSERVE_JOIN_TOKEN_PATH",
                              field="join_token")
