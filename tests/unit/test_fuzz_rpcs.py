"""Hostile protobuf messages to every public RPC (hypothesis), over real gRPC.

``InProcessStack`` runs the real servicers as ``pdserve up`` wires them — coordinator, both pool
managers, router (gRPC and HTTP) and governor on one server, plus one prefill and one decode
worker (sim engine, tcp KV) on servers of their own that registered through the pool with the
join token — with the in-process state backend, on an event loop in a thread.

For every method of RouterService, PoolService, KvTransferService, CapacityGovernorService and
WorkerAgentService, hypothesis builds request messages from the method's descriptor: every field
maybe set, integers at their extremes, unknown enum values, long and odd strings, ids that exist
in the stack, nested messages, long repeated fields; and, for each method, raw bytes that may not
even parse. Every call must end with a clean status — never INTERNAL or UNKNOWN (a servicer
crashed), never a hang (a unary call answers within its deadline; a stream either sends or
ends) — and the server must still answer afterwards. Long polls (``AwaitDestination`` asked to
wait longer than the deadline) may run into the deadline; that is their contract.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.api.v1 import (
    common_pb2,
    governor_pb2,
    kv_transfer_pb2,
    pool_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)

T = TypeVar("T")
MODEL = "llama-3.1-8b"
JOIN_TOKEN = "fuzz-join-token-" + uuid.uuid4().hex
CALL_TIMEOUT_S = 5.0
MAX_STREAM_MESSAGES = 3
READY_TIMEOUT_S = 30.0


# ----------------------------------------------------------------------- in-process stack


class LoopThread:
    """An event loop in a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        self.loop.close()


@dataclass
class InProcessStack:
    """The control plane and two workers in this process (see the module docstring)."""

    loop: LoopThread = field(default_factory=LoopThread)
    address: str = ""
    http_url: str = ""
    worker_ids: dict[str, str] = field(default_factory=dict)
    """role -> worker id."""
    worker_addresses: dict[str, str] = field(default_factory=dict)
    known_strings: list[str] = field(default_factory=list)
    """Values that exist in the stack (model, worker ids, addresses): hostile messages use them
    so that calls reach past "not found" into the servicers' deeper paths."""
    _parts: dict[str, Any] = field(default_factory=dict)

    def start(self) -> InProcessStack:
        self.loop.run(self._start(), READY_TIMEOUT_S + 30)
        return self

    async def _start(self) -> None:
        from pdserve.api.v1 import pool_pb2_grpc
        from pdserve.common.grpc_server import GrpcServer
        from pdserve.common.settings import CommonSettings
        from pdserve.common.types import WorkerRole
        from pdserve.governor.app import GovernorApp
        from pdserve.governor.settings import GovernorSettings
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
        from pdserve.state.stores import open_stores
        from pdserve.worker.process import WorkerProcess
        from pdserve.worker.settings import WorkerSettings

        common = CommonSettings(redis_url="memory://", database_url="sqlite://",
                                metrics_port=-1, grace_period_s=0.0)
        stores = open_stores(common.redis_url)
        server = GrpcServer.from_settings(common)
        coordinator = CoordinatorApp(stores.backend, time.time, CoordinatorPolicy(),
                                     MemoryRendezvous(), common)
        coordinator.register(server)
        pools = {
            role: PoolApp(PoolSettings(role=role, join_token=JOIN_TOKEN, deployments=(MODEL,)),
                          stores.backend, stores.prefix_index, time.time)
            for role in (WorkerRole.PREFILL, WorkerRole.DECODE)
        }
        server.add_servicer(POOL_SERVICE, pool_pb2_grpc.add_PoolServiceServicer_to_server,
                            PoolServicer({r: p.manager for r, p in pools.items()},
                                         stores.backend.workers, stores.backend.events))
        router = RouterApp(RouterSettings(http_port=0, coordinator_address="127.0.0.1:1",
                                          metrics_port=-1, local_prefill_threshold_tokens=32),
                           stores.backend, stores.prefix_index,
                           LocalTicketClient(coordinator.coordinator))
        router.register(server)
        governor = GovernorApp(GovernorSettings(redis_url="memory://", database_url="sqlite://"),
                               None, stores.backend)
        governor.register(server)
        port = await server.start()
        self.address = f"127.0.0.1:{port}"
        coordinator.start()
        for pool in pools.values():
            await pool.start()
        await router.start()
        governor.start()
        self.http_url = f"http://127.0.0.1:{router.http_port}"

        stop = asyncio.Event()
        workers, tasks = [], []
        for role in (WorkerRole.PREFILL, WorkerRole.DECODE):
            worker = WorkerProcess(WorkerSettings(
                role=role, deployment=MODEL, model=MODEL, pool_address=self.address,
                coordinator_address=self.address, join_token=JOIN_TOKEN, speedup=1e4,
                max_num_blocks=512, num_kv_layers=4, metrics_port=-1, grace_period_s=0.0))
            await worker.start()
            workers.append(worker)
            tasks.append(asyncio.create_task(worker.run(stop)))
            self.worker_ids[role.value] = worker.agent.config.worker_id
            self.worker_addresses[role.value] = worker.address
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(router.view.ready(MODEL, role) for role in WorkerRole):
            if time.monotonic() > deadline:
                raise RuntimeError("the in-process workers never became ready")
            await asyncio.sleep(0.05)
        self.known_strings = [MODEL, *self.worker_ids.values(), *self.worker_addresses.values(),
                              self.address, "tcp", "prefill", "decode"]
        self._parts = dict(stores=stores, server=server, coordinator=coordinator, pools=pools,
                           router=router, governor=governor, workers=workers, tasks=tasks,
                           stop=stop)

    def stop(self) -> None:
        if self._parts:
            self.loop.run(self._stop())
        self.loop.close()

    async def _stop(self) -> None:
        parts = self._parts
        parts["stop"].set()
        await asyncio.gather(*parts["tasks"], return_exceptions=True)
        for worker in parts["workers"]:
            await worker.close()
        await parts["server"].stop(0)
        await parts["router"].close()
        await parts["governor"].close()
        for pool in parts["pools"].values():
            await pool.close()
        await parts["coordinator"].close()
        await parts["stores"].close()


@pytest.fixture(scope="module")
def stack() -> Iterator[InProcessStack]:
    stack = InProcessStack()
    try:
        yield stack.start()
    finally:
        stack.stop()


# ----------------------------------------------------------------------------- strategies


_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_ODD_STRINGS = ["", " ", "\x00", "../../etc/passwd", "é" * 3, "\ud7ff", "a" * 300,
                "x" * 70_000, "1e309", "-1", "NaN", "00000000-0000-0000-0000-000000000000",
                "host:99999", "[::1]:0", "{}", "%s%s%n"]


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({0, 1, low, high, min(high, 2), max(low, -1), high // 2, low // 2})
    return st.one_of(st.sampled_from(edges), st.integers(0, 64), st.integers(low, high))


def _strings(known: list[str]) -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=24), st.sampled_from(_ODD_STRINGS),
                     st.sampled_from(known or ["?"]), st.uuids().map(str))


def _scalar(fd: FieldDescriptor, known: list[str]) -> st.SearchStrategy[Any]:
    kind = fd.type
    if kind in _INT_RANGES:
        return _ints(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if kind == FieldDescriptor.TYPE_STRING:
        return _strings(known)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_ENUM:
        values = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(values), st.integers(-(2**31), 2**31 - 1))
    raise AssertionError(f"unhandled field type {kind} of {fd.full_name}")


def _is_map(fd: FieldDescriptor) -> bool:
    return bool(fd.message_type and fd.message_type.GetOptions().map_entry)


def messages(
    descriptor: Descriptor, known: list[str], depth: int = 0
) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor`` with any subset of fields set to hostile values."""
    from google.protobuf import message_factory

    message_class = message_factory.GetMessageClass(descriptor)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for fd in descriptor.fields:
        if fd.message_type is not None and not _is_map(fd):
            if depth >= 3:
                continue
            value = st.deferred(lambda fd=fd: messages(fd.message_type, known, depth + 1))
        elif _is_map(fd):
            key_fd, value_fd = (
                fd.message_type.fields_by_name["key"],
                fd.message_type.fields_by_name["value"],
            )
            value_strategy = (messages(value_fd.message_type, known, depth + 1)
                              if value_fd.message_type else _scalar(value_fd, known))
            value = st.lists(st.tuples(_scalar(key_fd, known), value_strategy), max_size=4)
        else:
            value = _scalar(fd, known)
        if fd.is_repeated and not _is_map(fd):
            value = st.one_of(st.lists(value, max_size=6),
                              st.lists(value, min_size=200, max_size=400) if depth == 0
                              and fd.message_type is None else st.just([]))
        optional[fd.name] = value

    def build(values: dict[str, Any]) -> Message:
        message = message_class()
        for name, value in values.items():
            fd = descriptor.fields_by_name[name]
            target = (
                getattr(message, name) if fd.message_type is not None or fd.is_repeated else None
            )
            if _is_map(fd):
                for key, item in value:
                    if isinstance(item, Message):
                        target[key].CopyFrom(item)
                    else:
                        target[key] = item
            elif fd.is_repeated:
                target.extend(value)
            elif fd.message_type is not None:
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


# -------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    path: str
    """``/package.Service/Method``."""
    request: Descriptor
    response_class: type[Message]
    is_stream: bool
    target: str
    """Which server: ``control``, ``prefill`` or ``decode``."""

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]

    def __repr__(self) -> str:  # the pytest id
        return f"{self.path.split('.')[-1]}@{self.target}"


def _methods() -> list[Method]:
    from google.protobuf import message_factory

    found = []
    # Pools last: their Drain and SetTargetSize may take workers out of service.
    for module in (router_pb2, kv_transfer_pb2, governor_pb2, worker_pb2, pool_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            targets = ["prefill", "decode"] if service.name == "WorkerAgentService" else ["control"]
            for target in targets:
                for method in service.methods:
                    found.append(Method(
                        f"/{service.full_name}/{method.name}", method.input_type,
                        message_factory.GetMessageClass(method.output_type),
                        method.server_streaming, target))
    return found


METHODS = _methods()
WATCHES = {"WatchPool", "WatchTickets"}
"""Streams that wait for changes by contract: silence until the deadline is no hang."""
LONG_POLLS = {"AwaitDestination", *WATCHES}
"""Methods that wait by contract; AwaitDestination up to ``timeout_ms`` (5 s when 0, at most
60 s). They are called with a short deadline."""
LONG_POLL_TIMEOUT_S = 0.25
CLEAN_CODES = set(grpc.StatusCode) - {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                      grpc.StatusCode.DEADLINE_EXCEEDED}


def _address(stack: InProcessStack, method: Method) -> str:
    return stack.address if method.target == "control" else stack.worker_addresses[method.target]


_CHANNELS: dict[str, grpc.Channel] = {}


def _channel(address: str) -> grpc.Channel:
    if address not in _CHANNELS:
        _CHANNELS[address] = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
    return _CHANNELS[address]


def call(stack: InProcessStack, method: Method, payload: bytes,
         timeout_s: float = CALL_TIMEOUT_S) -> tuple[grpc.StatusCode, str]:
    """Send ``payload`` (serialized request) and return how the call ended. A stream is read
    for at most ``MAX_STREAM_MESSAGES`` messages and then cancelled (it did not hang)."""
    channel = _channel(_address(stack, method))
    if method.is_stream:
        stream = channel.unary_stream(method.path, request_serializer=None,
                                      response_deserializer=method.response_class.FromString)
        responses = stream(payload, timeout=timeout_s)
        try:
            for count, _ in enumerate(responses, start=1):
                if count >= MAX_STREAM_MESSAGES:
                    responses.cancel()
                    return grpc.StatusCode.OK, "streaming"
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""
    unary = channel.unary_unary(method.path, request_serializer=None,
                                response_deserializer=method.response_class.FromString)
    try:
        unary(payload, timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _long_poll_wait_s(request: Message | None) -> float:
    timeout_ms = getattr(request, "timeout_ms", 0) if request is not None else 0
    return min(timeout_ms / 1000 if timeout_ms else 5.0, 60.0)


def assert_clean(method: Method, request: Message | None, outcome: tuple[grpc.StatusCode, str],
                 *, is_raw: bool = False, timeout_s: float = CALL_TIMEOUT_S) -> None:
    code, details = outcome
    if code in CLEAN_CODES:
        return
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and (
            method.name in WATCHES
            or (method.name in LONG_POLLS
                and (is_raw or _long_poll_wait_s(request) >= timeout_s * 0.5))):
        return  # a watch, or asked to wait about as long as the deadline or longer
    pytest.fail(f"{method.path} -> {code.name}: {details!r}\nrequest: {request!r:.2000}")


FUZZ = settings(max_examples=30, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


def test_the_stack_serves_before_fuzzing(stack: InProcessStack) -> None:
    """The fuzzing below reaches a working stack (a disaggregated request completes)."""
    stub = router_pb2_grpc.RouterServiceStub(_channel(stack.address))
    request = router_pb2.GenerateRequest(model=MODEL, prompt_token_ids=list(range(1, 200)),
                                         sampling=common_pb2.SamplingParams(max_tokens=3),
                                         prefill_mode=common_pb2.PREFILL_MODE_REMOTE)
    chunks = list(stub.Generate(request, timeout=CALL_TIMEOUT_S * 2))
    assert sum(len(c.token_ids) for c in chunks) == 3
    assert chunks[-1].prefill_worker_id == stack.worker_ids["prefill"]


def _timeout_s(method: Method) -> float:
    return LONG_POLL_TIMEOUT_S if method.name in LONG_POLLS else CALL_TIMEOUT_S


def _fuzz_one(stack: InProcessStack, method: Method, data: st.DataObject) -> None:
    request = data.draw(messages(method.request, stack.known_strings), label="request")
    timeout_s = _timeout_s(method)
    assert_clean(method, request, call(stack, method, request.SerializeToString(), timeout_s),
                 timeout_s=timeout_s)


@pytest.mark.parametrize("method", [m for m in METHODS if m.name not in LONG_POLLS], ids=repr)
@FUZZ
@given(data=st.data())
def test_hostile_messages_get_clean_statuses(stack: InProcessStack, method: Method,
                                             data: st.DataObject) -> None:
    _fuzz_one(stack, method, data)


@pytest.mark.parametrize("method", [m for m in METHODS if m.name in LONG_POLLS], ids=repr)
@settings(FUZZ, max_examples=12)
@given(data=st.data())
def test_hostile_messages_to_long_polls(stack: InProcessStack, method: Method,
                                        data: st.DataObject) -> None:
    """Fewer examples: a call that waits as asked costs its whole (short) deadline."""
    _fuzz_one(stack, method, data)


@pytest.mark.parametrize("method", METHODS, ids=repr)
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=512))
def test_raw_bytes_get_clean_statuses(stack: InProcessStack, method: Method,
                                      payload: bytes) -> None:
    timeout_s = _timeout_s(method)
    assert_clean(method, None, call(stack, method, payload, timeout_s), is_raw=True,
                 timeout_s=timeout_s)


def test_every_server_is_still_up(stack: InProcessStack) -> None:
    """Every server still answers (the fuzzing may have drained or deregistered the workers,
    so the model may be gone from the router's view: that is what those calls ask for)."""
    for address in (stack.address, *stack.worker_addresses.values()):
        health = health_pb2_grpc.HealthStub(_channel(address))
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S).status
        assert status == health_pb2.HealthCheckResponse.SERVING, address
    stub = router_pb2_grpc.RouterServiceStub(_channel(stack.address))
    stub.ListModels(router_pb2.ListModelsRequest(), timeout=CALL_TIMEOUT_S)
    from pdserve.api.v1 import pool_pb2_grpc, worker_pb2_grpc

    pools = pool_pb2_grpc.PoolServiceStub(_channel(stack.address))
    pools.ListWorkers(pool_pb2.ListWorkersRequest(deployment=MODEL), timeout=CALL_TIMEOUT_S)
    for address in stack.worker_addresses.values():
        worker = worker_pb2_grpc.WorkerAgentServiceStub(_channel(address))
        worker.GetStatus(worker_pb2.GetStatusRequest(), timeout=CALL_TIMEOUT_S)


async def test_a_method_the_servicer_lacks_is_unimplemented_not_internal() -> None:
    """Regression (found by the fuzzing above): a generated servicer base raises
    NotImplementedError for a method the service does not implement; the error mapping turned
    that into INTERNAL with a logged traceback."""
    from pdserve.api.v1 import governor_pb2_grpc
    from pdserve.common.grpc_server import GrpcServer

    server = GrpcServer()
    server.add_servicer("pdserve.api.v1.CapacityGovernorService",
                        governor_pb2_grpc.add_CapacityGovernorServiceServicer_to_server,
                        governor_pb2_grpc.CapacityGovernorServiceServicer())
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.WhatIfPlan(governor_pb2.WhatIfPlanRequest(), timeout=5)
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(0)
