"""Test session set-up: markers by directory, and the real Redis/Postgres integration tests use.

Services are found in this order: a URL from the environment (``PDSERVE_TEST_REDIS_URL``,
``PDSERVE_TEST_DATABASE_URL``; CI sets both); a throwaway container through testcontainers when a
Docker engine is reachable; otherwise the test fails and says what to set. Nothing is skipped.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_MARK_BY_DIR = {"integration": "integration", "e2e": "e2e"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
        mark = _MARK_BY_DIR.get(parts[0]) if parts else None
        if mark:
            item.add_marker(getattr(pytest.mark, mark))


def _docker_reachable() -> bool:
    if os.environ.get("DOCKER_HOST"):
        return True
    return Path("/var/run/docker.sock").exists() and shutil.which("docker") is not None


def _container_url(kind: str) -> Iterator[str]:
    if kind == "redis":
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7.4-alpine") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"
    else:
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver="psycopg") as container:
            yield container.get_connection_url()


def _service_url(env_name: str, kind: str) -> Iterator[str]:
    url = os.environ.get(env_name)
    if url:
        yield url
        return
    if _docker_reachable():
        try:
            yield from _container_url(kind)
            return
        except Exception as exc:  # noqa: BLE001 - say what to set instead
            pytest.fail(f"{env_name} is not set and starting a {kind} container failed: {exc}")
    pytest.fail(
        f"{env_name} is not set and no Docker engine is reachable: set {env_name} to a {kind} "
        f"URL (e.g. redis://127.0.0.1:6379/0 or postgresql+psycopg://postgres@127.0.0.1:5432/test)"
    )


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis that tests may write to (they use their own key prefixes / db)."""
    yield from _service_url("PDSERVE_TEST_REDIS_URL", "redis")


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """SQLAlchemy URL of a real Postgres database that tests may create schemas in."""
    yield from _service_url("PDSERVE_TEST_DATABASE_URL", "postgres")


@pytest.fixture(scope="session")
def shared_data_dir() -> Path | None:
    """``shared/data`` beside the project, if present. Tests that need it skip without it."""
    candidate = ROOT.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None
