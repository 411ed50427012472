"""docker-compose.yml names only real ``pdserve`` commands with valid arguments (no Docker engine
runs here, so the file is checked by parsing it and feeding each command to the CLI parser)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from pdserve.cli.main import build_parser
from pdserve.cli.serve import SERVICES

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _pdserve_services() -> dict[str, dict]:
    return {name: svc for name, svc in _compose()["services"].items()
            if svc.get("image", "").startswith("pdserve")}


def test_compose_has_state_stores_trace_viewer_and_every_service() -> None:
    services = _compose()["services"]
    assert {"redis", "postgres", "jaeger"} <= set(services)
    served = {
        svc["command"][1] for svc in _pdserve_services().values() if svc["command"][0] == "serve"
    }
    assert served == set(SERVICES)
    assert (
        "4317" in str(services["jaeger"])
        or services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    )


@pytest.mark.parametrize("name", sorted(_pdserve_services()))
def test_every_command_parses_into_valid_settings(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = _pdserve_services()[name]
    environment = {k: str(v) for k, v in service["environment"].items()}
    args = build_parser().parse_args(service["command"])
    if args.command == "serve":
        from pdserve.cli.serve import settings_for

        monkeypatch.setattr(os, "environ", {**os.environ, **environment})
        settings = settings_for(args)
        assert settings.grpc_host == "0.0.0.0"
        assert settings.redis_url.startswith("redis://redis:")
    else:
        assert args.command == "db" and args.action == "upgrade"
