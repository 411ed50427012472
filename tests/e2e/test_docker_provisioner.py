"""The Docker provisioner under a real pool manager, against the real Docker engine: worker
containers (from the pdserve image, on the host's network) register with a pool manager served
over gRPC in this process, go LOADING -> READY, drain when the target drops and have exactly their
container removed; a container whose worker never becomes ready is replaced.

The image: ``PDSERVE_TEST_WORKER_IMAGE`` if set, else built here (docker compose, BuildKit; the
base image from the Debian mirror when missing) and removed afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from helpers.requirements import require_docker_engine

from pdserve.api.v1 import pool_pb2_grpc
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings
from pdserve.common.types import WorkerRole, WorkerState
from pdserve.pool.manager import PoolManager, PoolPolicy
from pdserve.pool.servicer import SERVICE_NAME, PoolServicer
from pdserve.state.stores import Stores, open_stores

docker = pytest.importorskip("docker", reason="pip install 'pdserve[docker]'")

from pdserve.pool.provisioner_docker import (  # noqa: E402
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    LABEL_SCOPE,
    LABEL_WORKER_ID,
    DockerProvisioner,
    DockerWorkerSpec,
)

# The first test may build the image (minutes, cold); the rest take about a minute each.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "docker-provisioner-test-join-token"
GOOD, STUCK = "llama-3.1-8b", "stuck-model"
READY_TIMEOUT_S = 25.0
WAIT_S = 120.0


@pytest.fixture(scope="module")
def worker_image() -> Iterator[str]:
    require_docker_engine()
    named = os.environ.get("PDSERVE_TEST_WORKER_IMAGE")
    if named:
        yield named
        return
    image = f"pdserve:provisioner-test-{uuid.uuid4().hex[:6]}"
    base = os.environ.get("PDSERVE_SMOKE_BASE_IMAGE", "local/debian:bookworm")
    built_base = subprocess.run(["docker", "image", "inspect", base],
                                capture_output=True).returncode != 0
    env = dict(os.environ, PDSERVE_COMPOSE_IMAGE=image, PDSERVE_COMPOSE_BASE_IMAGE=base,
               COMPOSE_PROFILES="", COMPOSE_PROJECT_NAME="pdserve-provisioner-test")
    extra_ca = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    if extra_ca and "PDSERVE_COMPOSE_EXTRA_CA_FILE" not in env:
        bundle = Path(os.environ.get("TMPDIR", "/tmp")) / f"{image.replace(':', '-')}-ca.pem"
        bundle.write_text("".join(p.read_text() for p in extra_ca))
        env["PDSERVE_COMPOSE_EXTRA_CA_FILE"] = str(bundle)
    try:
        if built_base:
            subprocess.run([str(ROOT / "scripts" / "build_base_image.sh"), base], check=True)
        subprocess.run(["docker", "compose", "build", "--quiet", "secrets"], cwd=ROOT, env=env,
                       check=True, timeout=1800)
        yield image
    finally:
        subprocess.run(["docker", "image", "rm", image], capture_output=True)
        if built_base:
            subprocess.run(["docker", "image", "rm", base], capture_output=True)


@dataclasses.dataclass
class Stack:
    manager: PoolManager
    provisioner: DockerProvisioner
    client: docker.DockerClient
    scope: str

    def containers(self, deployment: str) -> dict[str, str]:
        """Worker id -> container status, this test's containers of ``deployment``."""
        found = self.client.containers.list(all=True, filters={"label": [
            f"{LABEL_SCOPE}={self.scope}", f"{LABEL_DEPLOYMENT}={deployment}"]})
        return {c.labels[LABEL_WORKER_ID]: c.status for c in found}

    async def states(self, deployment: str) -> dict[str, WorkerState]:
        return {w.worker_id: w.state for w in await self.manager.list_workers(deployment)}


async def wait_until(what: str, probe: Callable[[], object], stack: Stack) -> object:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        result = probe()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(0.5)
    logs = {c.name: c.logs(tail=15).decode(errors="replace")
            for c in stack.client.containers.list(
                all=True, filters={"label": f"{LABEL_SCOPE}={stack.scope}"})}
    raise AssertionError(f"not within {WAIT_S:.0f} s: {what}; containers' output: {logs}")


@pytest.fixture
async def stack(worker_image: str) -> AsyncIterator[Stack]:
    stores: Stores = open_stores("memory://")
    scope = f"pdserve-test-{uuid.uuid4().hex[:8]}"
    client = docker.from_env()
    server = GrpcServer.from_settings(CommonSettings(grpc_host="127.0.0.1", grpc_port=0))
    spec = DockerWorkerSpec(image=worker_image, scope=scope, network="host", stop_timeout_s=10)
    provisioner = DockerProvisioner(spec, lambda: TOKEN, client)
    common = ("--gpu", "h100-sxm-80gb", "--speedup", "10", "--max-num-blocks", "256",
              "--grpc-host", "127.0.0.1", "--kv-host", "127.0.0.1", "--log-format", "text")
    policy = PoolPolicy(
        role=WorkerRole.DECODE, join_token=TOKEN, ready_timeout_s=READY_TIMEOUT_S,
        heartbeat_timeout_s=15.0, actuate_interval_s=0.5,
        launch_args={GOOD: ("--model", GOOD, *common),
                     # Loads for ever: never READY.
                     STUCK: ("--model", GOOD, "--cold-start-s", "1000000", *common)})
    manager = PoolManager(policy, stores.backend, stores.prefix_index, time.time, provisioner)
    server.add_servicer(SERVICE_NAME, pool_pb2_grpc.add_PoolServiceServicer_to_server,
                        PoolServicer({WorkerRole.DECODE: manager}, stores.backend.workers,
                                     stores.backend.events))
    port = await server.start()
    provisioner.spec = dataclasses.replace(spec, base_args=(
        "--pool-address", f"127.0.0.1:{port}", "--coordinator-address", f"127.0.0.1:{port}"))
    stop = asyncio.Event()
    task = asyncio.create_task(manager.run(stop, (GOOD, STUCK)))
    try:
        yield Stack(manager, provisioner, client, scope)
    finally:
        stop.set()
        await task
        for container in client.containers.list(all=True,
                                                filters={"label": f"{LABEL_SCOPE}={scope}"}):
            container.remove(force=True)
        await manager.close()
        await server.stop()
        await stores.close()


async def test_a_worker_container_starts_serves_drains_and_is_removed(stack: Stack) -> None:
    await stack.manager.set_target(GOOD, 1)

    async def one_ready() -> str | None:
        ready = [w for w, s in (await stack.states(GOOD)).items() if s is WorkerState.READY]
        return ready[0] if ready else None

    worker_id = str(await wait_until("a READY worker", one_ready, stack))
    assert stack.containers(GOOD) == {worker_id: "running"}
    container = stack.client.containers.get(stack.provisioner.container_name(worker_id))
    assert container.labels[LABEL_SCOPE] == stack.scope
    assert container.labels[LABEL_ROLE] == "decode"
    assert container.labels[LABEL_DEPLOYMENT] == GOOD
    # Scale to zero: the worker drains (it is told on its next heartbeat), reports DRAINED, and
    # exactly its container goes.
    await stack.manager.set_target(GOOD, 0)
    saw = set()

    async def removed() -> bool:
        states = await stack.states(GOOD)
        saw.update(states.values())
        return not stack.containers(GOOD) and not states

    await wait_until("the drained worker's container removed", removed, stack)
    assert WorkerState.READY not in saw or WorkerState.DRAINING in saw, saw
    assert await stack.provisioner.handles(GOOD, "decode") == []


async def test_a_container_that_never_becomes_ready_is_replaced(stack: Stack) -> None:
    await stack.manager.set_target(STUCK, 1)

    async def loading() -> str | None:
        states = await stack.states(STUCK)
        return next((w for w, s in states.items() if s is WorkerState.LOADING), None)

    first = str(await wait_until("a LOADING worker", loading, stack))
    started = time.monotonic()

    def replaced() -> str | None:
        containers = stack.containers(STUCK)
        others = [w for w in containers if w != first]
        return others[0] if others and first not in containers else None

    second = str(await wait_until("the never-ready container replaced", replaced, stack))
    assert time.monotonic() - started >= READY_TIMEOUT_S - 10
    assert stack.containers(STUCK) == {second: "running"}
    await stack.manager.set_target(STUCK, 0)
    await wait_until("no container left", lambda: not stack.containers(STUCK), stack)
