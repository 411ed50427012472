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
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

_MARK_BY_DIR = {"integration": "integration", "e2e": "e2e"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        mark = _MARK_BY_DIR.get(_top_folder(item))
        if mark:
            item.add_marker(getattr(pytest.mark, mark))
    # The longest work first (see _scope_of): the vLLM folder, then the services, then the
    # unit tests, which fill the workers' last gaps. A stable sort: each folder keeps its order.
    items.sort(key=lambda item: _RUN_ORDER.get(_top_folder(item), len(_RUN_ORDER)))


# -- parallel runs: pytest-xdist (``-n auto --dist loadscope`` in pyproject.toml) -------------

_RUN_ORDER = {"vllm_engine": 0, "e2e": 1, "integration": 2, "unit": 3}
_SERIAL_FOLDERS = frozenset({"vllm_engine"})
"""Folders whose tests all run on one worker, one after another: each vLLM module's engines
keep this machine's cores busy on their own, so two of them side by side only slow each other
(and one process keeps ``stack_support``'s session cache of reference outputs)."""
MAX_WORKERS = 4
"""``-n auto``'s ceiling: every e2e module leases one of 12 logical Redis databases, and the
service processes of many modules at once would outgrow a small machine's memory."""


def _top_folder(item: pytest.Item) -> str:
    """The folder under ``tests/`` that holds the item's module ("" for one directly there)."""
    parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
    return parts[0] if len(parts) > 1 else ""


def _scope_of(nodeid: str) -> str:
    """The unit of work one xdist worker takes whole: a module (its module-scoped fixtures start
    real services once), or a whole folder of ``_SERIAL_FOLDERS``."""
    path = nodeid.split("::", 1)[0]
    folders = path.split("/")[:-1]
    for depth, folder in enumerate(folders):
        if folder in _SERIAL_FOLDERS:
            return "/".join(folders[:depth + 1])
    return path


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist (and `-o addopts=`): serial runs, as before
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class _ModuleScheduling(LoadScopeScheduling):
        """xdist's ``loadscope``, in collection order, with ``_scope_of``'s units."""

        def _split_scope(self, nodeid: str) -> str:
            return _scope_of(nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        if config.getoption("dist") != "loadscope":
            return None  # another --dist asked for: xdist's own
        config.option.loadscopereorder = False
        return _ModuleScheduling(config, log)

    def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
        if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
            return None  # the operator's count: xdist's own reading of it
        return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


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
