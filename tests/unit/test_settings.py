"""Settings: precedence (flag > environment > default), parsing of every kind, one-line errors."""

from __future__ import annotations

import argparse
import enum
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.settings import CommonSettings, LogFormat, LogLevel, TlsConfig
from pdserve.common.settings_fields import (
    add_settings_arguments,
    parse_settings,
    redacted,
    setting,
    settings_fields,
    settings_from_namespace,
)
from pdserve.common.settings_parsers import ADDRESS, DURATION_S, int_range, list_of


class Color(enum.StrEnum):
    RED = "red"
    GREEN = "green"


@dataclass(frozen=True, slots=True, kw_only=True)
class ExampleSettings(CommonSettings):
    """A service's settings: the common ones, one default changed, and its own."""

    service_name: str = setting("example", help="Service name.")
    max_inflight_requests: int = setting(help="Required, no default.", parser=int_range(1, 100))
    is_verbose: bool = setting(False, help="A boolean.")
    request_timeout_s: float = setting(30.0, parser=DURATION_S, help="A duration.")
    peer_address: str = setting("127.0.0.1:1", parser=ADDRESS, help="host:port.")
    color: Color = setting(Color.RED, help="An enum.")
    ports: tuple[int, ...] = setting((1, 2), parser=list_of(int_range(0, 65535)), help="A list.")
    tags: tuple[str, ...] = setting((), help="A list of strings.")
    weight: float = setting(1.5, help="A float.")
    data_dir: Path = setting(Path("data"), help="A path.")
    api_key: str = setting("", help="A secret.", is_secret=True)


REQUIRED = {"PDSERVE_MAX_INFLIGHT_REQUESTS": "10"}


def test_defaults_when_nothing_is_set() -> None:
    s = parse_settings(ExampleSettings, [], REQUIRED)
    assert s.service_name == "example"  # redeclared default wins over the common one
    assert s.grpc_port == 0
    assert s.metrics_port == 0
    assert s.log_level is LogLevel.INFO
    assert s.log_format is LogFormat.JSON
    assert s.otel_endpoint == ""
    assert s.redis_url == "memory://"
    assert s.tls is None
    assert s.ports == (1, 2)


def test_flag_beats_environment_beats_default() -> None:
    env = {**REQUIRED, "PDSERVE_GRPC_PORT": "7000", "PDSERVE_METRICS_PORT": "7001"}
    s = parse_settings(ExampleSettings, ["--grpc-port", "8000"], env)
    assert s.grpc_port == 8000  # flag over variable
    assert s.metrics_port == 7001  # variable over default
    assert s.grace_period_s == 15.0  # default


def test_each_type_parses() -> None:
    env = {
        **REQUIRED,
        "PDSERVE_IS_VERBOSE": "yes",
        "PDSERVE_REQUEST_TIMEOUT_S": "500ms",
        "PDSERVE_PEER_ADDRESS": "[::1]:50051",
        "PDSERVE_COLOR": "GREEN",
        "PDSERVE_PORTS": " 80, 443 ,,",
        "PDSERVE_TAGS": "a,b",
        "PDSERVE_WEIGHT": "2.25",
        "PDSERVE_DATA_DIR": "/srv/pdserve",
        "PDSERVE_REDIS_URL": "rediss://:pw@redis.internal:6380/2",
        "PDSERVE_DATABASE_URL": "postgresql+psycopg://u:pw@db:5432/pdserve",
        "PDSERVE_OTEL_ENDPOINT": "http://collector:4317",
        "PDSERVE_OTEL_SAMPLING_RATIO": "0.25",
        "PDSERVE_LOG_LEVEL": "Debug",
        "PDSERVE_LOG_FORMAT": "text",
        "PDSERVE_GRACE_PERIOD_S": "2m",
        "PDSERVE_METRICS_PORT": "-1",
        "PDSERVE_TLS_CERT_PATH": "/etc/pdserve/tls.crt",
        "PDSERVE_TLS_KEY_PATH": "/etc/pdserve/tls.key",
    }
    s = parse_settings(ExampleSettings, ["--is-verbose", "false"], env)
    assert s.is_verbose is False
    assert s.request_timeout_s == pytest.approx(0.5)
    assert s.peer_address == "[::1]:50051"
    assert s.color is Color.GREEN
    assert s.ports == (80, 443)
    assert s.tags == ("a", "b")
    assert s.weight == 2.25
    assert s.data_dir == Path("/srv/pdserve")
    assert s.redis_url.startswith("rediss://")
    assert s.otel_sampling_ratio == 0.25
    assert s.log_level is LogLevel.DEBUG and s.log_format is LogFormat.TEXT
    assert s.grace_period_s == 120.0
    assert s.metrics_port == -1
    assert s.tls == TlsConfig(Path("/etc/pdserve/tls.crt"), Path("/etc/pdserve/tls.key"), None)


def test_bare_boolean_flag_means_true() -> None:
    assert parse_settings(ExampleSettings, ["--is-verbose"], REQUIRED).is_verbose is True


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("PDSERVE_GRPC_PORT", "abc", "expected an integer port 0-65535, got 'abc'"),
        ("PDSERVE_GRPC_PORT", "70000", "expected an integer port 0-65535"),
        ("PDSERVE_METRICS_PORT", "-2", "or -1 for off"),
        ("PDSERVE_MAX_INFLIGHT_REQUESTS", "0", "expected an integer 1-100"),
        ("PDSERVE_WEIGHT", "heavy", "expected a finite number"),
        ("PDSERVE_WEIGHT", "nan", "expected a finite number"),
        ("PDSERVE_IS_VERBOSE", "maybe", "expected one of true/false/1/0/yes/no"),
        ("PDSERVE_REQUEST_TIMEOUT_S", "-3", "expected a duration in seconds >= 0"),
        ("PDSERVE_REQUEST_TIMEOUT_S", "5 days", "expected a duration in seconds >= 0"),
        ("PDSERVE_OTEL_SAMPLING_RATIO", "1.5", "expected a number between 0 and 1"),
        ("PDSERVE_PEER_ADDRESS", "localhost", "expected host:port"),
        ("PDSERVE_PEER_ADDRESS", "::1:80", "expected host:port"),
        ("PDSERVE_PEER_ADDRESS", "host:99999", "expected host:port"),
        ("PDSERVE_GRPC_HOST", "bad host!", "expected a host name or IP address"),
        ("PDSERVE_COLOR", "blue", "expected one of red|green"),
        ("PDSERVE_LOG_FORMAT", "xml", "expected one of json|text"),
        ("PDSERVE_PORTS", "80,http", "expected a comma-separated list, each an integer 0-65535"),
        ("PDSERVE_DATA_DIR", "  ", "expected a file system path"),
        ("PDSERVE_REDIS_URL", "http://redis:6379", "expected a URL starting with one of redis://"),
        ("PDSERVE_REDIS_URL", "redis://", "expected a URL"),
        ("PDSERVE_REDIS_URL", "redis://host:port/0", "expected a URL"),
        ("PDSERVE_DATABASE_URL", "mysql://db/x", "postgresql+psycopg://"),
        ("PDSERVE_OTEL_ENDPOINT", "ftp://collector", "expected an OTLP gRPC endpoint"),
        ("PDSERVE_GRPC_MAX_MESSAGE_BYTES", "1k", "expected an integer 1024-"),
    ],
)
def test_malformed_variable_gives_one_line_naming_it(name: str, raw: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(ExampleSettings, [], {**REQUIRED, name: raw})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{name}: ")
    assert expected in message
    assert info.value.field == name.removeprefix("PDSERVE_").lower()


def test_malformed_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(ExampleSettings, ["--grpc-port", "abc"], REQUIRED)
    assert str(info.value) == "--grpc-port: expected an integer port 0-65535, got 'abc'"


def test_secret_value_is_not_echoed_in_errors_or_repr() -> None:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class WithSecretPort(CommonSettings):
        token_port: int = setting(1, help="x", is_secret=True)

    with pytest.raises(ConfigError) as info:
        parse_settings(WithSecretPort, [], {"PDSERVE_TOKEN_PORT": "hunter2"})
    assert "hunter2" not in str(info.value)
    s = parse_settings(ExampleSettings, [], {**REQUIRED, "PDSERVE_API_KEY": "hunter2"})
    assert "hunter2" not in repr(s)
    assert redacted(s)["api_key"] == "***"


def test_missing_required_and_unknown_flags_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="PDSERVE_MAX_INFLIGHT_REQUESTS: required"):
        parse_settings(ExampleSettings, [], {})
    with pytest.raises(ConfigError, match="unrecognized arguments: --nope"):
        parse_settings(ExampleSettings, ["--nope"], REQUIRED)
    with pytest.raises(ConfigError, match="--grpc-port"):
        parse_settings(ExampleSettings, ["--grpc-port"], REQUIRED)


def test_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match="TLS_KEY_PATH"):
        parse_settings(ExampleSettings, ["--tls-cert-path", "c.pem"], REQUIRED)
    with pytest.raises(ConfigError, match="PDSERVE_METRICS_PORT"):
        parse_settings(ExampleSettings, ["--grpc-port", "9000", "--metrics-port", "9000"], REQUIRED)


def test_subcommand_parser_and_namespace() -> None:
    cli = argparse.ArgumentParser(prog="pdserve")
    sub = cli.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    add_settings_arguments(serve, ExampleSettings)
    namespace = cli.parse_args(["serve", "--max-inflight-requests", "3", "--color", "green"])
    s = settings_from_namespace(ExampleSettings, namespace, {"PDSERVE_MAX_INFLIGHT_REQUESTS": "9"})
    assert namespace.command == "serve"
    assert s.max_inflight_requests == 3 and s.color is Color.GREEN
    assert "PDSERVE_GRPC_PORT" in serve.format_help()


def test_settings_are_frozen_and_field_names_derive_env_and_flag() -> None:
    s = parse_settings(ExampleSettings, [], REQUIRED)
    with pytest.raises(FrozenInstanceError):
        s.grpc_port = 1  # type: ignore[misc]
    spec = {f.name: f for f in settings_fields(ExampleSettings)}["grace_period_s"]
    assert (spec.env, spec.flag) == ("PDSERVE_GRACE_PERIOD_S", "--grace-period-s")


def test_redacted_masks_url_passwords() -> None:
    env = {**REQUIRED, "PDSERVE_DATABASE_URL": "postgresql://app:s3cret@db:5432/pdserve"}
    shown = redacted(parse_settings(ExampleSettings, [], env))
    assert shown["database_url"] == "postgresql://app:***@db:5432/pdserve"
    assert "s3cret" not in repr(shown)


def test_address_of_ipv6_host_is_bracketed() -> None:
    s = parse_settings(ExampleSettings, ["--grpc-host", "::", "--grpc-port", "5"], REQUIRED)
    assert s.grpc_address == "[::]:5"


def test_a_vllm_engine_gets_its_share_of_the_cores_as_openmp_threads() -> None:
    from pdserve.worker.engines.vllm.agents import engine_environment
    from pdserve.worker.settings import WorkerSettings

    base = ["--role", "decode", "--pool-address", "127.0.0.1:1",
            "--coordinator-address", "127.0.0.1:2", "--join-token", "t" * 32]
    shared = parse_settings(WorkerSettings, [*base, "--vllm-cpu-threads", "3"], environ={})
    assert engine_environment(shared)["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in engine_environment(parse_settings(WorkerSettings, base,
                                                                      environ={}))
    with pytest.raises(ConfigError):
        parse_settings(WorkerSettings, [*base, "--vllm-cpu-threads", "-1"], environ={})
