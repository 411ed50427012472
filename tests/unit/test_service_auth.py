"""No open doors without mutual TLS: service tokens and worker credentials, over real gRPC.

Once any key file or a service token file is configured, the internal and operator methods need
a credential: an unauthenticated call to each method of ``METHOD_ROLES`` is refused (the table
is iterated, so a new RPC is covered as soon as it is placed there; ``Register`` alone reaches
the pool, whose join-token check is the door there); a worker credential acts only as the
worker id it names; a rotated service token is accepted without a restart and the
old one refused once its grace has passed (the clock is injected).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool

from pdserve.api.v1 import (
    common_pb2,
    governor_pb2_grpc,
    kv_transfer_pb2_grpc,
    pool_pb2,
    pool_pb2_grpc,
    router_pb2_grpc,
    worker_pb2_grpc,
)
from pdserve.common.auth import (
    JOIN_METHODS,
    METHOD_ROLES,
    Authenticator,
    AuthInterceptor,
    Role,
    auth_interceptor,
)
from pdserve.common.credentials import (
    ServiceTokens,
    bearer_interceptors,
    bearer_metadata,
    parse_service_token_file,
    token_digest_line,
    worker_credential,
)
from pdserve.common.errors import ConfigError
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.metrics import REGISTRY
from pdserve.common.settings import CommonSettings

SERVICE_TOKEN = "st-" + "s" * 29
NEW_SERVICE_TOKEN = "st-" + "n" * 29
ADMIN_KEY = "ak-" + "c" * 29
CLIENT_KEY = "ck-" + "a" * 29
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _write(path: Path, text: str) -> None:
    """Write and move the modification time on (a reload sees the change at any timestamp
    granularity)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def _refusals(code: str) -> float:
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name != "pdserve_grpc_auth_refused_calls":
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("code") == code:
                total += sample.value
    return total


# ------------------------------------------------------------------ tokens, credentials


def test_service_token_file_parsing_names_lines_never_tokens() -> None:
    digest = token_digest_line(SERVICE_TOKEN)
    tokens = parse_service_token_file(f"# comment\n{SERVICE_TOKEN}\n\n{digest}\n", "f")
    assert [t.raw for t in tokens] == [SERVICE_TOKEN, None]
    for text, expected in (("short\n", "f:1: token shorter"), ("a b\n", "f:1: expected one"),
                           ("sha256:12\n", "f:1: expected sha256"), ("# only\n", "no token"),
                           ("pdw1." + "x" * 20 + "\n", "worker credential form")):
        with pytest.raises(ConfigError) as caught:
            parse_service_token_file(text, "f")
        assert expected in caught.value.message and SERVICE_TOKEN not in caught.value.message


def test_a_rotated_token_is_accepted_without_a_restart_and_refused_after_its_grace(
        tmp_path: Path) -> None:
    path = tmp_path / "service-tokens"
    _write(path, f"{SERVICE_TOKEN}\n")
    clock = Clock()
    tokens = ServiceTokens(path, grace_s=30.0, poll_interval_s=0.0, clock=clock)
    old_credential = tokens.mint_worker_credential("w1")
    assert tokens.presented() == SERVICE_TOKEN and tokens.is_valid(SERVICE_TOKEN)
    assert tokens.verify_worker_credential(old_credential) == "w1"
    # Rotate, step 1: append the new token; both are valid, the new one is presented.
    _write(path, f"{SERVICE_TOKEN}\n{NEW_SERVICE_TOKEN}\n")
    clock.now_s = 1.0
    assert tokens.presented() == NEW_SERVICE_TOKEN
    assert tokens.is_valid(SERVICE_TOKEN) and tokens.is_valid(NEW_SERVICE_TOKEN)
    # Step 2: remove the old one; it stays valid for its grace, then it is refused.
    _write(path, f"{NEW_SERVICE_TOKEN}\n")
    clock.now_s = 2.0
    assert tokens.is_valid(SERVICE_TOKEN) and tokens.verify_worker_credential(old_credential)
    clock.now_s = 2.0 + 29.0
    assert tokens.is_valid(SERVICE_TOKEN)
    clock.now_s = 2.0 + 30.0
    assert not tokens.is_valid(SERVICE_TOKEN)
    assert tokens.verify_worker_credential(old_credential) is None
    assert tokens.is_valid(NEW_SERVICE_TOKEN)
    assert tokens.verify_worker_credential(tokens.mint_worker_credential("w1")) == "w1"
    # A bad edit keeps the tokens in place.
    _write(path, "short\n")
    clock.now_s = 40.0
    assert tokens.is_valid(NEW_SERVICE_TOKEN)


def test_worker_credentials_name_one_worker_and_cannot_be_forged(tmp_path: Path) -> None:
    path = tmp_path / "service-tokens"
    _write(path, f"{SERVICE_TOKEN}\n")
    tokens = ServiceTokens(path)
    credential = tokens.mint_worker_credential("pre-1.a")
    assert credential == worker_credential(SERVICE_TOKEN, "pre-1.a")
    assert tokens.verify_worker_credential(credential) == "pre-1.a"
    mac = credential.rpartition(".")[2]
    for forged in (f"pdw1.pre-2.{mac}", credential[:-1] + ("0" if mac[-1] != "0" else "1"),
                   worker_credential(NEW_SERVICE_TOKEN, "pre-1.a"), "pdw1.x", credential[5:]):
        assert tokens.verify_worker_credential(forged) is None
    verify_only = tmp_path / "digests"
    _write(verify_only, token_digest_line(SERVICE_TOKEN) + "\n")
    checker = ServiceTokens(verify_only)
    assert checker.is_valid(SERVICE_TOKEN) and checker.presented() is None
    assert checker.verify_worker_credential(credential) is None  # it cannot check signatures
    with pytest.raises(ConfigError):
        checker.mint_worker_credential("w")


def test_the_open_default_holds_only_when_nothing_is_configured(tmp_path: Path) -> None:
    path = tmp_path / "service-tokens"
    _write(path, f"{SERVICE_TOKEN}\n")
    assert Authenticator(None, None, is_mutual_tls=False).is_open
    tokens_only = Authenticator(None, None, is_mutual_tls=False,
                                service_tokens=ServiceTokens(path))
    assert tokens_only.authenticate(None, None).roles == {Role.CLIENT, Role.ADMIN}
    service = tokens_only.authenticate(SERVICE_TOKEN, None)
    assert Role.SERVICE in service.roles and not service.worker_id
    worker = tokens_only.authenticate(worker_credential(SERVICE_TOKEN, "w9"), None)
    assert Role.WORKER in worker.roles and Role.SERVICE not in worker.roles
    assert worker.worker_id == "w9"


# -------------------------------------------------------------- every method, real gRPC


_SERVICERS = (
    (router_pb2_grpc.add_RouterServiceServicer_to_server, router_pb2_grpc.RouterServiceServicer),
    (pool_pb2_grpc.add_PoolServiceServicer_to_server, pool_pb2_grpc.PoolServiceServicer),
    (kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server,
     kv_transfer_pb2_grpc.KvTransferServiceServicer),
    (governor_pb2_grpc.add_CapacityGovernorServiceServicer_to_server,
     governor_pb2_grpc.CapacityGovernorServiceServicer),
    (worker_pb2_grpc.add_WorkerAgentServiceServicer_to_server,
     worker_pb2_grpc.WorkerAgentServiceServicer),
)
"""The generated base servicers: a call that gets past authorization ends UNIMPLEMENTED."""


@dataclass
class Stack:
    address: str
    server: GrpcServer


async def _serve_every_service(settings: CommonSettings) -> GrpcServer:
    server = GrpcServer.from_settings(settings)
    for add, servicer in _SERVICERS:
        name = add.__name__.removeprefix("add_").removesuffix("Servicer_to_server")
        server.add_servicer(f"pdserve.api.v1.{name}", add, servicer())
    return server


@pytest.fixture
async def locked(tmp_path: Path) -> AsyncIterator[Stack]:
    """A server with API keys, admin keys and a service token file, and no mutual TLS."""
    (tmp_path / "api").write_text(f"{CLIENT_KEY} acme\n")
    (tmp_path / "admin").write_text(f"{ADMIN_KEY} ops\n")
    (tmp_path / "tokens").write_text(f"{SERVICE_TOKEN}\n")
    server = await _serve_every_service(CommonSettings(
        api_keys_path=tmp_path / "api", admin_keys_path=tmp_path / "admin",
        service_tokens_path=tmp_path / "tokens"))
    port = await server.start()
    try:
        yield Stack(f"127.0.0.1:{port}", server)
    finally:
        await server.stop(0)


async def _call(channel: grpc.aio.Channel, method: str,
                credential: str | None) -> grpc.StatusCode:
    """Call ``method`` with an empty request; the status it ends with."""
    service_name, _, method_name = method.strip("/").partition("/")
    descriptor = descriptor_pool.Default().FindServiceByName(
        service_name).methods_by_name[method_name]
    metadata = bearer_metadata(credential) if credential else None
    try:
        if descriptor.client_streaming:
            stream = channel.stream_unary(method)(iter([b""]), metadata=metadata, timeout=5)
            await stream
        elif descriptor.server_streaming:
            async for _ in channel.unary_stream(method)(b"", metadata=metadata, timeout=5):
                pass
        else:
            await channel.unary_unary(method)(b"", metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_an_unauthenticated_call_to_every_method_is_refused(locked: Stack) -> None:
    before = _refusals("unauthenticated")
    async with grpc.aio.insecure_channel(locked.address) as channel:
        for method in METHOD_ROLES:
            code = await _call(channel, method, None)
            if method in JOIN_METHODS:  # the join token in the request is checked by the pool
                assert code is grpc.StatusCode.UNIMPLEMENTED, method  # reached the handler
            else:
                assert code is grpc.StatusCode.UNAUTHENTICATED, method
            assert await _call(channel, method, "not-a-known-key-0123") is (
                grpc.StatusCode.UNAUTHENTICATED), method
    assert _refusals("unauthenticated") - before == 2 * len(METHOD_ROLES) - len(JOIN_METHODS)


async def test_each_credential_reaches_exactly_its_roles_methods(locked: Stack) -> None:
    credentials = {Role.SERVICE: SERVICE_TOKEN, Role.ADMIN: ADMIN_KEY, Role.CLIENT: CLIENT_KEY,
                   Role.WORKER: worker_credential(SERVICE_TOKEN, "w1")}
    before = _refusals("permission_denied")
    num_denied = 0
    async with grpc.aio.insecure_channel(locked.address) as channel:
        for method, roles in METHOD_ROLES.items():
            for role, credential in credentials.items():
                code = await _call(channel, method, credential)
                if role in roles:
                    assert code not in REFUSED, (method, role)
                else:
                    assert code is grpc.StatusCode.PERMISSION_DENIED, (method, role)
                    num_denied += 1
    assert num_denied > 0 and _refusals("permission_denied") - before == num_denied


async def test_keys_without_a_service_token_file_lock_the_internal_methods(
        tmp_path: Path) -> None:
    (tmp_path / "admin").write_text(f"{ADMIN_KEY} ops\n")
    server = await _serve_every_service(CommonSettings(admin_keys_path=tmp_path / "admin"))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method, roles in METHOD_ROLES.items():
                code = await _call(channel, method, None)
                if roles & {Role.CLIENT} or method in JOIN_METHODS:  # no API key file: open
                    assert code not in REFUSED, method
                else:
                    assert code is grpc.StatusCode.UNAUTHENTICATED, method
    finally:
        await server.stop(0)


async def test_services_present_a_rotated_token_and_the_old_one_lapses(tmp_path: Path) -> None:
    """One server, never restarted: the client's channel moves to the new token as soon as its
    file says so; the old token works through its grace, then is refused."""
    path = tmp_path / "tokens"
    _write(path, f"{SERVICE_TOKEN}\n")
    clock = Clock()
    server_tokens = ServiceTokens(path, grace_s=60.0, poll_interval_s=0.0, clock=clock)
    client_tokens = ServiceTokens(path, grace_s=60.0, poll_interval_s=0.0, clock=clock)
    server = grpc.aio.server(interceptors=[AuthInterceptor(Authenticator(
        None, None, is_mutual_tls=False, service_tokens=server_tokens))])
    for add, servicer in _SERVICERS:
        add(servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    method = "/pdserve.api.v1.KvTransferService/OpenTicket"  # service only
    try:
        async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}",
                interceptors=bearer_interceptors(client_tokens.presented)) as presenting, \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            assert await _call(presenting, method, None) not in REFUSED
            # The server-streaming shape carries it too (an aio channel files interceptors by
            # shape: one for unary calls would leave Decode without a credential).
            assert await _call(presenting, "/pdserve.api.v1.WorkerAgentService/Decode",
                               None) not in REFUSED
            assert await _call(plain, method, None) is grpc.StatusCode.UNAUTHENTICATED
            _write(path, f"{NEW_SERVICE_TOKEN}\n")
            clock.now_s = 1.0
            assert client_tokens.presented() == NEW_SERVICE_TOKEN
            assert await _call(presenting, method, None) not in REFUSED
            assert await _call(plain, method, SERVICE_TOKEN) not in REFUSED  # in its grace
            clock.now_s = 61.0
            assert await _call(plain, method, SERVICE_TOKEN) is grpc.StatusCode.UNAUTHENTICATED
            assert await _call(presenting, method, None) not in REFUSED
            # A call that carries its own authorization keeps it (an operator's key).
            assert await _call(presenting, method, "not-a-known-key-0123") is (
                grpc.StatusCode.UNAUTHENTICATED)
    finally:
        await server.stop(0)


# --------------------------------------------------------- a worker acts only as itself


async def test_a_worker_credential_acts_only_as_its_own_worker_id(tmp_path: Path) -> None:
    from pdserve.common.types import WorkerRole
    from pdserve.pool.app import PoolApp
    from pdserve.pool.settings import PoolSettings
    from pdserve.state.factory import open_backend
    from pdserve.state.prefix_index import MemoryPrefixIndex

    (tmp_path / "tokens").write_text(f"{SERVICE_TOKEN}\n")
    (tmp_path / "admin").write_text(f"{ADMIN_KEY} ops\n")
    settings = PoolSettings(role=WorkerRole.PREFILL, join_token="join-token-0123456789",
                            service_tokens_path=tmp_path / "tokens",
                            admin_keys_path=tmp_path / "admin")
    backend = open_backend("memory://", time.time)
    app = PoolApp(settings, backend, MemoryPrefixIndex(), time.time)
    server = GrpcServer.from_settings(settings)
    app.register(server)
    port = await server.start()
    assert auth_interceptor(settings) is not None

    def register(worker_id: str) -> pool_pb2.RegisterRequest:
        info = common_pb2.WorkerInfo(worker_id=worker_id, deployment="m",
                                     role=common_pb2.WORKER_ROLE_PREFILL, address="127.0.0.1:1")
        return pool_pb2.RegisterRequest(join_token=settings.join_token, worker=info)

    w1 = bearer_metadata(worker_credential(SERVICE_TOKEN, "w1"))
    before = _refusals("permission_denied")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pool_pb2_grpc.PoolServiceStub(channel)
            assert (await stub.Register(register("w1"), metadata=w1, timeout=5)).worker_id == "w1"
            await stub.Register(register("w2"), timeout=5, metadata=bearer_metadata(
                worker_credential(SERVICE_TOKEN, "w2")))
            for call in (stub.Register(register("w2"), metadata=w1, timeout=5),
                         stub.Register(register(""), metadata=w1, timeout=5),
                         stub.Heartbeat(pool_pb2.HeartbeatRequest(
                             worker_id="w2", join_token=settings.join_token), metadata=w1,
                             timeout=5),
                         stub.Deregister(pool_pb2.DeregisterRequest(
                             worker_id="w2", join_token=settings.join_token), metadata=w1,
                             timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
                assert "w1" in (caught.value.details() or "")
            # A worker its provisioner could not name (a Deployment's pod) joins by the join
            # token alone and is handed a credential for the id it registered, and only that.
            joined = await stub.Register(register("pod-7"), timeout=5)
            assert joined.worker_credential == worker_credential(SERVICE_TOKEN, "pod-7")
            with pytest.raises(grpc.aio.AioRpcError) as caught:  # not another live worker's id
                await stub.Register(register("w1"), timeout=5)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "worker.worker_id" in (caught.value.details() or "")
            bad_token = register("pod-8")
            bad_token.join_token = "not-the-join-token"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Register(bad_token, timeout=5)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as caught:  # a heartbeat needs the credential
                await stub.Heartbeat(pool_pb2.HeartbeatRequest(
                    worker_id="pod-7", join_token=settings.join_token), timeout=5)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
            beat = await stub.Heartbeat(pool_pb2.HeartbeatRequest(
                worker_id="pod-7", join_token=settings.join_token,
                state=common_pb2.WORKER_STATE_READY), timeout=5,
                metadata=bearer_metadata(joined.worker_credential))
            assert beat.worker_credential == joined.worker_credential  # re-signed, same token
            await stub.Heartbeat(pool_pb2.HeartbeatRequest(
                worker_id="w1", join_token=settings.join_token,
                state=common_pb2.WORKER_STATE_READY), metadata=w1, timeout=5)
            # Operators and services are not bound to a worker id.
            await stub.Drain(pool_pb2.DrainRequest(worker_id="w2"), timeout=5,
                             metadata=bearer_metadata(ADMIN_KEY))
            with pytest.raises(grpc.aio.AioRpcError) as caught:  # a worker is no operator
                await stub.Drain(pool_pb2.DrainRequest(worker_id="w1"), metadata=w1, timeout=5)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert sorted(w.worker_id for w in await backend.workers.list("m", WorkerRole.PREFILL)
                      if w.state.value != "draining") == ["pod-7", "w1"]
    finally:
        await server.stop(0)
        await app.manager.close()
        await backend.close()
    assert _refusals("permission_denied") - before == 6


# ------------------------------------------------------------------------------ pdserve up


def test_up_wires_a_service_token_only_when_keys_need_one(tmp_path: Path) -> None:
    from pdserve.cli.up import UpSettings, internal_credentials, write_token_digests

    open_stack, workers_file = internal_credentials(UpSettings(), tmp_path)
    assert open_stack.service_tokens_path is None and workers_file is None
    (tmp_path / "admin").write_text(f"{ADMIN_KEY} ops\n")
    locked, workers_file = internal_credentials(
        UpSettings(admin_keys_path=tmp_path / "admin"), tmp_path)
    assert locked.service_tokens_path is not None and workers_file is not None
    services = ServiceTokens(Path(locked.service_tokens_path))
    workers = ServiceTokens(workers_file)
    token = services.presented()
    assert token is not None and workers.is_valid(token)
    assert workers.presented() is None  # a worker can check a service's token, not present it
    assert token not in workers_file.read_text()
    # A rotation of the services' file reaches the workers' copy.
    _write(Path(locked.service_tokens_path), f"{token}\n{NEW_SERVICE_TOKEN}\n")
    assert write_token_digests(Path(locked.service_tokens_path), workers_file)
    assert not write_token_digests(Path(locked.service_tokens_path), workers_file)
    assert ServiceTokens(workers_file).is_valid(NEW_SERVICE_TOKEN)
