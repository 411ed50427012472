"""The settings of a pool manager (``pdserve serve prefill-pool`` / ``decode-pool``).

Every field has an environment variable ``PDSERVE_<NAME>`` and a flag ``--name`` (the flag wins);
``pdserve serve prefill-pool --help`` lists them with their defaults.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import ConfigError
from pdserve.common.settings import CommonSettings
from pdserve.common.settings_fields import setting
from pdserve.common.settings_parsers import DURATION_S, int_range
from pdserve.common.types import WorkerRole


class ProvisionerKind(enum.StrEnum):
    """How a provisioning pool manager starts workers (``pdserve.pool.provisioner*``)."""

    LOCAL = "local"
    """Child processes of the pool manager, on its host (``pdserve up``)."""
    DOCKER = "docker"
    """One container per worker through a Docker engine (the compose stack, Docker hosts)."""
    KUBERNETES = "kubernetes"
    """The worker Deployment of each deployment and role, through the Kubernetes API."""


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
    provisioner: ProvisionerKind = setting(
        ProvisionerKind.LOCAL,
        help="How is_provisioning starts workers: local (child processes), docker (a container "
             "per worker), kubernetes (scales the worker Deployment of each deployment and role).")
    worker_ready_timeout_s: float = setting(
        1800.0, parser=DURATION_S,
        help="A provisioned worker not READY this long after its launch is stopped and replaced "
             "(0 = never); longer than the slowest cold start.")
    docker_url: str = setting(
        "", help="Docker engine (unix:///var/run/docker.sock, tcp://host:2376); empty = "
                 "DOCKER_HOST or the local socket.")
    docker_image: str = setting("pdserve:dev", help="Image of the worker containers.")
    docker_network: str = setting(
        "", help="Network the worker containers join (a compose stack's network; host); empty = "
                 "the engine's default bridge.")
    docker_scope: str = setting(
        "pdserve", help="Label (io.pdserve.scope) and name prefix of this stack's worker "
                        "containers; a pool manager adopts only containers of its scope.")
    docker_gpus_per_worker: int = setting(
        0, parser=int_range(0, 1024),
        help="GPUs each worker container requests from the engine (0 = none, sim workers).")
    is_removing_workers_on_close: bool = setting(
        False,
        help="On shutdown, stop and remove this scope's worker containers (a compose stack going "
             "down). Off on a fleet: a restarted pool manager adopts its running workers.")
    kubernetes_namespace: str = setting(
        "", help="Namespace of the worker Deployments; empty = this pod's own (in a cluster), "
                 "else the kubeconfig's.")
    kubernetes_api_url: str = setting(
        "", help="Kubernetes API server URL (kubectl proxy, tests); empty = the in-cluster "
                 "service account, else the kubeconfig.")

    def check(self) -> None:
        CommonSettings.check(self)
        if not self.join_token and self.join_token_path is None:
            raise ConfigError("PDSERVE_JOIN_TOKEN: required, set it or PDSERVE_JOIN_TOKEN_PATH",
                              field="join_token")
