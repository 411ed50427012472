"""docker-compose.yml names only real ``pdserve`` commands with valid arguments, checked without a
Docker engine by parsing the file (``${VAR:-default}`` filled with its default) and feeding each
command to the CLI parser; the workers the pool managers start are checked the same way, from the
arguments their provisioner gives them. scripts/compose_smoke.sh brings the stack up for real."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli.main import build_parser
from pdserve.cli.serve import SERVICES, settings_for

ROOT = Path(__file__).resolve().parents[2]
_DEFAULT = re.compile(r"\$\{[A-Z0-9_]+:-([^}]*)\}")


def _compose() -> dict[str, Any]:
    text = _DEFAULT.sub(lambda m: m[1], (ROOT / "docker-compose.yml").read_text())
    return yaml.safe_load(text.replace("$$", "$"))


def _pdserve_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in _compose()["services"].items()
            if svc.get("image", "").startswith("pdserve") and "command" in svc
            and svc["command"][:1] in (["serve"], ["db"])}


def _settings(command: list[str], environment: dict[str, Any],
              monkeypatch: pytest.MonkeyPatch) -> Any:
    args = build_parser().parse_args(command)
    monkeypatch.setattr(os, "environ", {**os.environ,
                                        **{k: str(v) for k, v in environment.items()}})
    return settings_for(args)


def test_compose_has_state_stores_observability_and_every_service() -> None:
    services = _compose()["services"]
    assert {"redis", "postgres", "prometheus", "otel-collector", "jaeger", "grafana"} <= set(
        services)
    assert {services[s]["profiles"][0] for s in ("otel-collector", "jaeger", "grafana")} == {
        "observability"}
    assert services["otlp-recorder"]["profiles"] == ["smoke"]
    served = {svc["command"][1] for svc in _pdserve_services().values()
              if svc["command"][0] == "serve"}
    assert served == set(SERVICES) - {"worker"}  # workers: started by the pool managers
    assert services["redis"]["volumes"] and services["postgres"]["volumes"]


def test_every_pdserve_service_has_a_health_check_and_waits_for_the_migration() -> None:
    for name, service in _pdserve_services().items():
        if service["command"][0] != "serve":
            continue
        assert "pdserve.cli.health" in service["healthcheck"]["test"], name
        depends = service["depends_on"]
        assert depends["db-migrate"] == {"condition": "service_completed_successfully"}, name
        assert depends["redis"] == {"condition": "service_healthy"}, name


@pytest.mark.parametrize("name", sorted(_pdserve_services()))
def test_every_command_parses_into_valid_settings(name: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    service = _pdserve_services()[name]
    if service["command"][0] != "serve":
        assert service["command"] == ["db", "upgrade"]
        return
    settings = _settings(service["command"], service["environment"], monkeypatch)
    assert settings.grpc_host == "0.0.0.0"
    assert settings.redis_url.startswith("redis://redis:")
    # Admin keys without mutual TLS: the internal methods need the generated service token.
    assert settings.admin_keys_path is not None
    assert settings.service_tokens_path is not None
    assert settings.service_tokens_path.name in (
        ROOT / "infra/compose/init-secrets.sh").read_text()


@pytest.mark.parametrize("name", ["prefill-pool", "decode-pool", "vllm-prefill-pool",
                                  "vllm-decode-pool"])
def test_pool_managers_provision_docker_workers_whose_command_parses(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    service = _compose()["services"][name]
    pool = _settings(service["command"], service["environment"], monkeypatch)
    assert pool.is_provisioning and pool.provisioner == "docker"
    assert pool.join_token_path is not None and pool.deployments
    role = service["command"][1].removesuffix("-pool")
    worker_command = ["serve", "worker", "--deployment", pool.deployments[0], "--role", role,
                      "--worker-id", "w-1", *shlex.split(pool.worker_args)]
    monkeypatch.setattr(os, "environ", {**os.environ, "PDSERVE_JOIN_TOKEN": "t" * 32})
    worker = settings_for(build_parser().parse_args(worker_command))
    assert worker.pool_address == f"{name}:{pool.grpc_port}"
    assert worker.grpc_host == worker.kv_host == "0.0.0.0"
    assert worker.advertise_host_from_hostname
