"""Disaggregation changes nothing in the output: the same prompts through (a) one worker doing
prefill and decode and (b) prefill on one worker, decode on another, through the whole control
plane (router -> coordinator ticket -> decode admit -> prefill -> KV over ``tcp`` or ``nixl``
-> decode), give identical tokens, and every transferred KV block arrives with the checksum it
left with.

The control plane (coordinator, both pool managers, router, in-memory state) runs in this
process, and so do the two ``tiny`` workers (``WorkerProcess``), each with its own gRPC server:
every hop is real gRPC, and the KV moves over real sockets (``tcp``) or NIXL/UCX (``nixl``).
In-process keeps the sweep fast and lets the test see both workers' KV caches: a recording
wrapper around each worker's transport takes a checksum of every source block as the prefill
worker offers a layer, and of every destination block once the decode worker has the ticket's
KV (before decoding writes into the last block). One process also means one BLAS, so both
workers compute with the same thread count (a condition of bit-exact agreement).

Batch composition: requests of one sweep run concurrently, so decode batches differ between
(a) and (b); the tiny engine is batch-invariant (each sequence computed on its own), which this
test relies on and checks at the same time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import pool_pb2_grpc, router_pb2, router_pb2_grpc
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings
from pdserve.common.types import FencingToken, WorkerRole
from pdserve.kv_transfer.app import CoordinatorApp
from pdserve.kv_transfer.coordinator import CoordinatorPolicy
from pdserve.kv_transfer.local_client import LocalTicketClient
from pdserve.kv_transfer.rendezvous import MemoryRendezvous
from pdserve.pool.app import PoolApp
from pdserve.pool.servicer import SERVICE_NAME as POOL_SERVICE
from pdserve.pool.servicer import PoolServicer
from pdserve.pool.settings import PoolSettings
from pdserve.router.app import RouterApp
from pdserve.router.settings import RouterSettings
from pdserve.state.factory import open_backend
from pdserve.state.prefix_index import MemoryPrefixIndex
from pdserve.worker.engine import KvCache
from pdserve.worker.engines.tiny import kv_block_checksum
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.process import WorkerProcess
from pdserve.worker.settings import WorkerSettings
from pdserve.worker.transports import registry
from pdserve.worker.transports.base import KvReceiver, KvSender
from pdserve.worker.transports.values import KvDestinationSpec, TransferResult

pytestmark = pytest.mark.timeout(300)

DEPLOYMENT = "tiny"
JOIN_TOKEN = "token-exact-test"
MAX_TOKENS = 8
IS_CI = os.environ.get("CI", "").lower() == "true"


# ---- KV checksums on both sides -----------------------------------------------------------------


@dataclass
class KvLedger:
    """Checksums by ``(token, layer, destination block id)``: ``sent`` from the prefill worker's
    source block at offer time, ``landed`` from the decode worker's block once the KV is in."""

    sent: dict[tuple[FencingToken, int, int], int] = field(default_factory=dict)
    landed: dict[tuple[FencingToken, int, int], int] = field(default_factory=dict)

    def landed_tokens(self) -> set[FencingToken]:
        return {token for token, _, _ in self.landed}


class _RecordingSender:
    """A ``KvSender`` that checksums each offered source block (then forwards the call)."""

    def __init__(self, inner: KvSender, kv_cache: KvCache, ledger: KvLedger) -> None:
        self._inner, self._kv_cache, self._ledger = inner, kv_cache, ledger
        self._token: FencingToken | None = None
        self._dst: tuple[int, ...] = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        self._token, self._dst = token, dest.block_ids
        await self._inner.open(dest, token)

    async def offer_layer(self, layer: int, src_block_ids: Sequence[int],
                          dst_block_ids: Sequence[int] | None = None) -> None:
        self._record(layer, src_block_ids, dst_block_ids)
        await self._inner.offer_layer(layer, src_block_ids, dst_block_ids)

    async def offer_layers(self, layers: Sequence[int], src_block_ids: Sequence[int],
                           dst_block_ids: Sequence[int] | None = None) -> None:
        for layer in layers:
            self._record(layer, src_block_ids, dst_block_ids)
        await self._inner.offer_layers(layers, src_block_ids, dst_block_ids)

    def _record(self, layer: int, src_block_ids: Sequence[int],
                dst_block_ids: Sequence[int] | None) -> None:
        assert self._token is not None
        dst = self._dst if dst_block_ids is None else tuple(dst_block_ids)
        for src, dst_id in zip(src_block_ids, dst, strict=True):
            checksum = kv_block_checksum(self._kv_cache.layer_buffers[layer][src])
            self._ledger.sent[(self._token, layer, int(dst_id))] = checksum


class _RecordingReceiver:
    """A ``KvReceiver`` that checksums a ticket's destination blocks when its KV is complete."""

    def __init__(self, inner: KvReceiver, ledger: KvLedger) -> None:
        self._inner, self._ledger = inner, ledger
        self._dst: dict[FencingToken, list[int]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def expect(self, token: FencingToken, dst_block_ids: Sequence[int], num_layers: int) -> None:
        self._inner.expect(token, dst_block_ids, num_layers)
        self._dst[token] = [int(b) for b in dst_block_ids]

    async def wait(self, token: FencingToken, timeout_s: float) -> TransferResult:
        result = await self._inner.wait(token, timeout_s)
        buffers = self._inner.kv_cache.layer_buffers
        for layer, buffer in enumerate(buffers):
            for block_id in self._dst[token]:
                self._ledger.landed[(token, layer, block_id)] = kv_block_checksum(buffer[block_id])
        return result


class RecordingBackend:
    """Wraps a registered transport backend; every sender and receiver records checksums."""

    def __init__(self, inner: Any, ledger: KvLedger) -> None:
        self._inner, self.ledger = inner, ledger
        self.name, self.is_pull = inner.name, inner.is_pull
        self.frame_versions = inner.frame_versions

    def is_available(self) -> tuple[bool, str]:
        return self._inner.is_available()

    def create_receiver(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                        **kwargs: Any) -> Any:
        return _RecordingReceiver(self._inner.create_receiver(kv_cache, owner_table, **kwargs),
                                  self.ledger)

    def create_sender(self, kv_cache: KvCache, **kwargs: Any) -> Any:
        return _RecordingSender(self._inner.create_sender(kv_cache, **kwargs), kv_cache,
                                self.ledger)


# ---- the stack -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TinyShape:
    """A tiny engine configuration (every worker of a stack uses it)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    block_size_tokens: int
    max_num_blocks: int = 2048

    @property
    def label(self) -> str:
        kind = "gqa" if self.num_kv_heads < self.num_heads else "mha"
        return (f"{self.num_layers}L-h{self.hidden_size}-{kind}{self.num_heads}x"
                f"{self.num_kv_heads}-bs{self.block_size_tokens}")


class TinyStack:
    """Coordinator, prefill and decode pool managers and router on one gRPC server (in-memory
    state), plus one prefill and one decode ``tiny`` worker, each with its own gRPC server.

    ``transport_wrapper`` (optional) wraps each worker's transport backend before it starts.
    """

    def __init__(self, shape: TinyShape, transport: str, *, lease_s: float = 10.0,
                 reap_interval_s: float = 0.5, kv_wait_timeout_s: float = 30.0,
                 max_attempts: int = 3) -> None:
        self.shape, self.transport = shape, transport
        self.backend = open_backend("memory://", time.time)
        prefix_index = MemoryPrefixIndex()
        self.server = GrpcServer()
        self.coordinator = CoordinatorApp(
            self.backend, time.time,
            CoordinatorPolicy(default_lease_s=lease_s, reap_interval_s=reap_interval_s),
            MemoryRendezvous(), CommonSettings())
        self.pools = {
            role: PoolApp(PoolSettings(role=role, join_token=JOIN_TOKEN, heartbeat_interval_s=0.1,
                                       heartbeat_timeout_s=30.0),
                          self.backend, prefix_index, time.time)
            for role in (WorkerRole.PREFILL, WorkerRole.DECODE)
        }
        self.router = RouterApp(
            RouterSettings(http_port=-1, coordinator_address="127.0.0.1:1", transport=transport,
                           local_prefill_threshold_tokens=0, lease_s=lease_s,
                           max_attempts=max_attempts, is_shedding_enabled=False),
            self.backend, prefix_index, LocalTicketClient(self.coordinator.coordinator))
        self.router.router.config = dataclasses.replace(self.router.router.config,
                                                        kv_wait_timeout_s=kv_wait_timeout_s)
        self.coordinator.register(self.server)
        self.server.add_servicer(
            POOL_SERVICE, pool_pb2_grpc.add_PoolServiceServicer_to_server,
            PoolServicer({r: p.manager for r, p in self.pools.items()}, self.backend.workers,
                         self.backend.events))
        self.router.register(self.server)
        self.address = ""
        self.workers: dict[WorkerRole, WorkerProcess] = {}
        self._stop = asyncio.Event()
        self._runs: list[asyncio.Task[None]] = []
        self._channel: grpc.aio.Channel | None = None

    def worker_settings(self, role: WorkerRole) -> WorkerSettings:
        s = self.shape
        return WorkerSettings(
            role=role, deployment=DEPLOYMENT, engine="tiny", pool_address=self.address,
            coordinator_address=self.address, join_token=JOIN_TOKEN, transport=self.transport,
            block_size_tokens=s.block_size_tokens, max_num_blocks=s.max_num_blocks,
            tiny_num_layers=s.num_layers, tiny_hidden_size=s.hidden_size,
            tiny_num_heads=s.num_heads, tiny_num_kv_heads=s.num_kv_heads, metrics_port=-1,
            worker_id=f"{role.value}-0")

    async def start(self, wrap: Any = None) -> None:
        port = await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.coordinator.start()
        for pool in self.pools.values():
            await pool.start()
        for role in (WorkerRole.DECODE, WorkerRole.PREFILL):
            worker = WorkerProcess(self.worker_settings(role))
            if wrap is not None:
                worker.agent.transport = wrap(worker.agent.transport)
            await worker.start()
            self.workers[role] = worker
            self._runs.append(asyncio.create_task(worker.run(self._stop)))
        await self.router.start()
        deadline = time.monotonic() + 30
        view = self.router.view
        while time.monotonic() < deadline:
            if all(view.ready(DEPLOYMENT, role) for role in WorkerRole if role in self.workers):
                self._channel = grpc.aio.insecure_channel(self.address)
                return
            await asyncio.sleep(0.05)
        raise AssertionError("tiny workers did not become READY in the router's view")

    @property
    def decode(self) -> WorkerProcess:
        return self.workers[WorkerRole.DECODE]

    @property
    def prefill(self) -> WorkerProcess:
        return self.workers[WorkerRole.PREFILL]

    async def generate(self, prompt: list[int], mode: int, max_tokens: int = MAX_TOKENS,
                       timeout_s: float = 120.0) -> tuple[list[int], router_pb2.GenerateResponse]:
        """Tokens of one request through the router, and its last chunk."""
        assert self._channel is not None
        stub = router_pb2_grpc.RouterServiceStub(self._channel)
        request = router_pb2.GenerateRequest(
            model=DEPLOYMENT, prompt_token_ids=prompt, prefill_mode=mode,
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        tokens: list[int] = []
        last = None
        async for chunk in stub.Generate(request, timeout=timeout_s):
            tokens += chunk.token_ids
            last = chunk
        assert last is not None
        return tokens, last

    async def close(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._runs, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
        await self.server.stop(0)
        for worker in self.workers.values():
            await worker.close()
        await self.router.close()
        for pool in self.pools.values():
            await pool.close()
        await self.coordinator.close()
        await self.backend.close()


def _openblas_thread_functions() -> tuple[Any, Any] | None:
    """``(get, set)`` of the OpenBLAS that numpy bundles, or None (another BLAS, or none)."""
    import ctypes
    import glob

    libs_dir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libs_dir, "*openblas*")):
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas{}_num_threads64_", "openblas_{}_num_threads"):
            get = getattr(lib, name.format("get"), None)
            set_ = getattr(lib, name.format("set"), None)
            if get is not None and set_ is not None:
                get.restype = ctypes.c_int
                return get, set_
    return None


@pytest.fixture(autouse=True)
def one_blas_thread() -> Any:
    """Workers run one BLAS thread (``pdserve serve worker`` sets OPENBLAS_NUM_THREADS=1); this
    process imported numpy long before, so set it through OpenBLAS itself for the test."""
    functions = _openblas_thread_functions()
    if functions is None:
        yield
        return
    get, set_ = functions
    before = get()
    set_(1)
    yield
    set_(before)


def require_transport(name: str) -> None:
    """Skip (outside CI) or fail (in CI) when a transport is unavailable here."""
    status = registry.backend_status().get(name, "unknown transport")
    if status:
        if IS_CI:
            pytest.fail(f"CI must run transport {name}: {status}")
        pytest.skip(f"{name}: {status}")


# ---- the test -----------------------------------------------------------------------------------

SWEEP_LENGTHS = (1, 2, 15, 16, 17, 64, 333, 1024, 2000)
"""Prompt lengths of the sweep over small shapes: 1 token, around block edges, up to 2,000."""
SHAPES = (
    (TinyShape(2, 64, 4, 1, 16), SWEEP_LENGTHS),  # grouped-query (4 query heads per KV head)
    (TinyShape(3, 64, 4, 4, 5), SWEEP_LENGTHS),  # one KV head per query head, odd block size
    (TinyShape(2, 96, 6, 2, 32), SWEEP_LENGTHS),  # grouped-query, large blocks
    (TinyShape(8, 256, 8, 2, 16), (1, 100, 700)),  # the default tiny model: a few prompts
)


def _prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lengths]


@pytest.fixture(params=["tcp", "nixl"])
def transport(request: pytest.FixtureRequest) -> str:
    require_transport(request.param)
    return str(request.param)


@pytest.fixture(params=SHAPES, ids=[shape.label for shape, _ in SHAPES])
async def stack_and_lengths(request: pytest.FixtureRequest, transport: str
                            ) -> AsyncIterator[tuple[TinyStack, KvLedger, tuple[int, ...]]]:
    shape, lengths = request.param
    ledger = KvLedger()
    stack = TinyStack(shape, transport)
    try:
        await stack.start(wrap=lambda backend: RecordingBackend(backend, ledger))
        yield stack, ledger, lengths
    finally:
        await stack.close()


async def test_disaggregated_tokens_and_kv_equal_colocated(
        stack_and_lengths: tuple[TinyStack, KvLedger, tuple[int, ...]]) -> None:
    stack, ledger, lengths = stack_and_lengths
    prompts = _prompts(lengths, seed=len(lengths) + stack.shape.block_size_tokens)
    local_runs = await asyncio.gather(
        *(stack.generate(p, pb.PREFILL_MODE_LOCAL) for p in prompts))
    remote_runs = await asyncio.gather(
        *(stack.generate(p, pb.PREFILL_MODE_REMOTE) for p in prompts))

    for prompt, (local, local_last), (remote, remote_last) in zip(
            prompts, local_runs, remote_runs, strict=True):
        assert local_last.timing.is_local_prefill and not local_last.prefill_worker_id
        assert not remote_last.timing.is_local_prefill
        assert remote_last.prefill_worker_id == stack.prefill.agent.config.worker_id
        assert len(local) == MAX_TOKENS
        assert remote == local, f"prompt of {len(prompt)} tokens: tokens differ"

    # Every handoff landed, and each block of each layer arrived with its source's checksum.
    tokens = ledger.landed_tokens()
    assert len(tokens) == len(prompts)
    block_size = stack.shape.block_size_tokens
    expected_blocks = sum(-(-len(p) // block_size) for p in prompts) * stack.shape.num_layers
    assert len(ledger.landed) == expected_blocks
    mismatched = [key for key, value in ledger.landed.items() if ledger.sent.get(key) != value]
    assert not mismatched, f"{len(mismatched)} KV blocks differ from their source, e.g. " \
                           f"{mismatched[:3]}"
    # Nothing was refused, and both workers have every block back.
    receiver = stack.decode.agent._receiver
    assert receiver is not None and receiver.num_rejections == 0
    for worker in (stack.decode, stack.prefill):
        await _until(lambda w=worker: w.agent.allocator.num_free_blocks
                     == w.agent.allocator.num_blocks, "blocks freed")


async def _until(predicate: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)
