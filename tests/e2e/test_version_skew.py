"""Version skew in a rolling upgrade: workers of the previous release and of this one hand KV to
each other and serve, token for token as before.

The previous release is built from this repository's own history (``PREVIOUS_RELEASE``):
``git archive`` of its ``services`` folder, run by this interpreter with that folder first on
``PYTHONPATH``, so it reuses the installed dependencies (no downloads). The control plane
(coordinator, both pool managers, router) is this release, in this process; the workers are
processes of ``tiny`` engines (a real transformer whose KV crosses the wire over ``tcp``).

The upgrade runs the way the README says to roll one: decode first, prefill after — here both
directions, as a fleet mid-upgrade has every pairing at once:

1. old prefill -> new decode: the new receiver announces frame versions 1 and 2, the old sender
   writes version 1, the new receiver serves it;
2. the old prefill worker is replaced by a new one: new -> new runs at the release's highest
   version (3 where the CPU has a hardware CRC-32C, else 2: DONE carries the sender's KV
   checksum, CRC-32C or CRC-32, checked by the receiver);
3. the decode worker is replaced by one of the previous release (a rollback): the new sender
   finds no announced versions and writes version 1.

Every remote-prefill output must equal the same prompt's output prefilled on the decode worker
itself (greedy, deterministic engine), each handoff's KV checksum as the prefill side sent it
must equal the decode side's as it landed, and where a new worker took part its checksum
history names the frame version the handoff used.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2, worker_pb2_grpc
from pdserve.common.types import WorkerRole
from pdserve.worker.transports.frames import FRAME_VERSIONS

from .conftest import ServiceProcess, run_cli
from .test_token_exact import DEPLOYMENT, JOIN_TOKEN, MAX_TOKENS, TinyShape, TinyStack

pytestmark = pytest.mark.timeout(420)

PREVIOUS_RELEASE = "470412b75fe0775edf3b87bac5be6b2ede917a34"
"""The last commit before KV frame version 2 and the version fields (its frame format is
version 1 only; its workers report no software version)."""
REPO_ROOT = Path(__file__).resolve().parents[2]
SHAPE = TinyShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1,
                  block_size_tokens=16, max_num_blocks=256)
PROMPT_LENGTHS = (1, 17, 100, 333)
"""One token, just past a block edge, and a few blocks: every one is prefilled remotely."""
WORKER_READY_TIMEOUT_S = 90.0


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``services`` of ``PREVIOUS_RELEASE``, extracted into a temporary folder."""
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("no git history here (an sdist or an exported tree): the previous release "
                    "cannot be built")
    if _git("cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}").returncode != 0:
        pytest.fail(f"commit {PREVIOUS_RELEASE} (the previous release) is not in this clone: "
                    "fetch the history (a shallow clone lacks it), e.g. git fetch --unshallow")
    folder = tmp_path_factory.mktemp("previous-release")
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", PREVIOUS_RELEASE,
                              "services"], capture_output=True, timeout=120, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, timeout=120,
                   check=True)
    services = folder / "services"
    assert (services / "pdserve" / "worker" / "transports" / "frames.py").is_file()
    yield services
    shutil.rmtree(folder, ignore_errors=True)


class UpgradeStack(TinyStack):
    """``TinyStack``'s control plane (this release, in this process) with worker processes of
    either release, started and stopped one at a time."""

    def __init__(self, previous_services: Path) -> None:
        super().__init__(SHAPE, "tcp")
        self.previous_services = previous_services
        self.processes: dict[str, ServiceProcess] = {}

    async def start_control_plane(self) -> None:
        port = await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.coordinator.start()
        for pool in self.pools.values():
            await pool.start()
        await self.router.start()
        self._channel = grpc.aio.insecure_channel(self.address)

    async def start_worker(self, role: WorkerRole, release: str) -> ServiceProcess:
        """A worker of ``release`` ("old" or "new") with id ``<role>-<release>``, READY in the
        router's view."""
        services = self.previous_services if release == "old" else REPO_ROOT / "services"
        worker_id = f"{role.value}-{release}"
        s = self.shape
        process = ServiceProcess(worker_id, [
            "serve", "worker", "--role", role.value, "--deployment", DEPLOYMENT,
            "--engine", "tiny", "--worker-id", worker_id, "--transport", self.transport,
            "--pool-address", self.address, "--coordinator-address", self.address,
            "--metrics-port", "-1", "--block-size-tokens", str(s.block_size_tokens),
            "--max-num-blocks", str(s.max_num_blocks), "--tiny-num-layers", str(s.num_layers),
            "--tiny-hidden-size", str(s.hidden_size), "--tiny-num-heads", str(s.num_heads),
            "--tiny-num-kv-heads", str(s.num_kv_heads),
        ], {"PDSERVE_JOIN_TOKEN": JOIN_TOKEN, "PDSERVE_LOG_FORMAT": "text",
            "PYTHONPATH": os.pathsep.join([str(services), os.environ.get("PYTHONPATH", "")])})
        self.processes[worker_id] = process.start()
        await self._until_ready(role, worker_id, process)
        return process

    async def stop_worker(self, worker_id: str) -> None:
        """SIGTERM (the worker drains and leaves), then wait until the router stops choosing it."""
        process = self.processes.pop(worker_id)
        code = await asyncio.to_thread(process.stop)
        assert code is not None, f"{worker_id} had to be killed\n{process.describe()}"
        deadline = time.monotonic() + 30
        while any(w.worker_id == worker_id for role in WorkerRole
                  for w in self.router.view.ready(DEPLOYMENT, role)):
            assert time.monotonic() < deadline, f"{worker_id} still READY after it stopped"
            await asyncio.sleep(0.05)

    async def _until_ready(self, role: WorkerRole, worker_id: str,
                           process: ServiceProcess) -> None:
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while not any(w.worker_id == worker_id for w in self.router.view.ready(DEPLOYMENT, role)):
            if process.returncode is not None or time.monotonic() > deadline:
                pytest.fail(f"{worker_id} did not become READY\n{process.describe()}")
            await asyncio.sleep(0.1)

    async def status(self, worker_id: str) -> worker_pb2.GetStatusResponse:
        process = self.processes[worker_id]
        async with grpc.aio.insecure_channel(process.grpc_address) as channel:
            stub = worker_pb2_grpc.WorkerAgentServiceStub(channel)
            return await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)

    async def close(self) -> None:
        for worker_id in list(self.processes):
            await asyncio.to_thread(self.processes.pop(worker_id).stop)
        await super().close()


@pytest.fixture
async def stack(previous_release: Path) -> AsyncIterator[UpgradeStack]:
    stack = UpgradeStack(previous_release)
    try:
        await stack.start_control_plane()
        yield stack
    finally:
        await stack.close()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(16)
    return [rng.integers(3, 256, n).tolist() for n in PROMPT_LENGTHS]


async def _remote_outputs(stack: UpgradeStack, prompts: list[list[int]], prefill_id: str,
                          decode_id: str) -> list[list[int]]:
    """Each prompt prefilled remotely, checked to have run on the expected pair."""
    runs = await asyncio.gather(*(stack.generate(p, pb.PREFILL_MODE_REMOTE) for p in prompts))
    for tokens, last in runs:
        assert (last.prefill_worker_id, last.decode_worker_id) == (prefill_id, decode_id)
        assert not last.timing.is_local_prefill
        assert len(tokens) == MAX_TOKENS
    return [tokens for tokens, _ in runs]


def _checksums(status: worker_pb2.GetStatusResponse) -> dict[str, worker_pb2.KvChecksum]:
    return {f"{c.token.ticket_id}#{c.token.attempt}": c for c in status.kv_checksums}


async def _handoffs(stack: UpgradeStack, prefill_id: str, decode_id: str, seen: set[str]
                    ) -> list[tuple[worker_pb2.KvChecksum, worker_pb2.KvChecksum]]:
    """(sent, landed) checksums of the handoffs between the two workers not in ``seen``."""
    sent = _checksums(await stack.status(prefill_id))
    landed = _checksums(await stack.status(decode_id))
    new = sorted((set(sent) & set(landed)) - seen)
    seen.update(new)
    return [(sent[key], landed[key]) for key in new]


async def test_old_and_new_workers_hand_over_kv_and_serve_token_exact(
        stack: UpgradeStack) -> None:
    prompts = _prompts()
    seen: set[str] = set()

    # 1. A new decode worker beside the old prefill worker: old -> new at version 1.
    await stack.start_worker(WorkerRole.DECODE, "new")
    await stack.start_worker(WorkerRole.PREFILL, "old")
    new_info = (await stack.status("decode-new")).worker
    old_info = (await stack.status("prefill-old")).worker
    assert new_info.software_version and list(new_info.kv_frame_versions) == list(FRAME_VERSIONS)
    assert old_info.software_version == "" and not old_info.kv_frame_versions  # really the old
    status = await asyncio.to_thread(run_cli, ["status", "--address", stack.address])
    assert status.returncode == 0, status.stderr
    versions = {row[2]: row[-1] for row in map(str.split, status.stdout.splitlines())
                if row and row[0] == DEPLOYMENT}
    assert versions == {"decode-new": new_info.software_version, "prefill-old": "-"}, \
        status.stdout
    reference = [tokens for tokens, _ in await asyncio.gather(
        *(stack.generate(p, pb.PREFILL_MODE_LOCAL) for p in prompts))]
    assert all(len(tokens) == MAX_TOKENS for tokens in reference)
    outputs = await _remote_outputs(stack, prompts, "prefill-old", "decode-new")
    assert outputs == reference
    handoffs = await _handoffs(stack, "prefill-old", "decode-new", seen)
    assert len(handoffs) == len(prompts)
    for sent, landed in handoffs:
        assert sent.crc32 == landed.crc32 and sent.num_blocks == landed.num_blocks
        assert landed.kv_frame_version == 1 and sent.kv_frame_version == 0  # old: no such field

    # 2. The prefill worker upgraded: new -> new at this release's highest version.
    await stack.stop_worker("prefill-old")
    await stack.start_worker(WorkerRole.PREFILL, "new")
    outputs = await _remote_outputs(stack, prompts, "prefill-new", "decode-new")
    assert outputs == reference
    handoffs = await _handoffs(stack, "prefill-new", "decode-new", seen)
    assert len(handoffs) == len(prompts)
    for sent, landed in handoffs:
        assert sent.crc32 == landed.crc32
        assert sent.kv_frame_version == landed.kv_frame_version == FRAME_VERSIONS[-1]

    # 3. The decode worker rolled back to the previous release: new -> old at version 1.
    await stack.stop_worker("decode-new")
    await stack.start_worker(WorkerRole.DECODE, "old")
    old_local = [tokens for tokens, _ in await asyncio.gather(
        *(stack.generate(p, pb.PREFILL_MODE_LOCAL) for p in prompts))]
    assert old_local == reference  # both releases compute the same tokens
    outputs = await _remote_outputs(stack, prompts, "prefill-new", "decode-old")
    assert outputs == reference
    handoffs = await _handoffs(stack, "prefill-new", "decode-old", seen)
    assert len(handoffs) == len(prompts)
    for sent, landed in handoffs:
        assert sent.crc32 == landed.crc32
        assert sent.kv_frame_version == 1 and landed.kv_frame_version == 0
    for worker_id in ("prefill-new", "decode-old"):
        status = await stack.status(worker_id)
        assert status.num_refused_frames == 0, f"{worker_id} refused frames"
