"""Authentication and authorization: key files that reload, the method -> role table, and the
interceptor over real gRPC with mutual TLS (certificates made at test time)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from helpers.tokenizers import OneTokenizer

from pdserve.api.v1 import (
    governor_pb2,
    kv_transfer_pb2,
    pool_pb2,
    pool_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)
from pdserve.common.auth import (
    METHOD_ROLES,
    Authenticator,
    AuthInterceptor,
    Decision,
    Principal,
    Role,
    auth_interceptor,
    decide,
)
from pdserve.common.certs import IssuedCert, make_dev_certs
from pdserve.common.credentials import (
    KeyFile,
    TokenFile,
    bearer_key,
    bearer_metadata,
    parse_key_file,
)
from pdserve.common.errors import ConfigError, UnauthenticatedError
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings
from pdserve.common.tokenizer import ByteTokenizer
from pdserve.router.servicer import RouterServicer
from pdserve.router.types import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ModelCard,
)

CLIENT_KEY = "ck-" + "a" * 29
OTHER_CLIENT_KEY = "ck-" + "b" * 29
ADMIN_KEY = "ak-" + "c" * 29
SPIFFE = "spiffe://pdserve.local"


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _write(path: Path, text: str) -> None:
    """Write and move the modification time on, so a reload sees a change even when the test
    runs within the file system's timestamp granularity."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


# ------------------------------------------------------------------------------- key files


def test_key_file_parsing_reports_lines_never_keys() -> None:
    keys = parse_key_file(f"# clients\n\n{CLIENT_KEY} acme\n  {OTHER_CLIENT_KEY}   globex \n",
                          "keys.txt")
    assert keys == {CLIENT_KEY: "acme", OTHER_CLIENT_KEY: "globex"}
    for text, line in [("tinykey acme\n", 1), (f"{CLIENT_KEY}\n", 1),
                       (f"# x\n{CLIENT_KEY} acme extra\n", 2),
                       (f"{CLIENT_KEY} acme\n{CLIENT_KEY} globex\n", 2),
                       (f"{CLIENT_KEY} bad/name\n", 1)]:
        with pytest.raises(ConfigError) as info:
            parse_key_file(text, "keys.txt")
        assert info.value.message.startswith(f"keys.txt:{line}:")
        assert CLIENT_KEY not in info.value.message and "tinykey" not in info.value.message


def test_key_file_reloads_on_change_and_keeps_keys_on_a_bad_edit(tmp_path: Path) -> None:
    path = tmp_path / "api_keys"
    _write(path, f"{CLIENT_KEY} acme\n")
    clock = Clock()
    keys = KeyFile(path, poll_interval_s=1.0, clock=clock)
    assert keys.lookup(CLIENT_KEY) == "acme" and keys.lookup(OTHER_CLIENT_KEY) is None

    _write(path, f"{OTHER_CLIENT_KEY} globex\n")  # CLIENT_KEY revoked, another added
    assert keys.lookup(OTHER_CLIENT_KEY) is None  # not looked at within the poll interval
    clock.now_s = 1.0
    assert keys.lookup(OTHER_CLIENT_KEY) == "globex"
    assert keys.lookup(CLIENT_KEY) is None
    assert dict(keys.items()) == {OTHER_CLIENT_KEY: "globex"} and len(keys) == 1

    _write(path, "not a key file\n")
    clock.now_s = 2.0
    assert keys.lookup(OTHER_CLIENT_KEY) == "globex"  # the bad edit is ignored
    path.unlink()
    clock.now_s = 3.0
    assert keys.lookup(OTHER_CLIENT_KEY) == "globex"
    assert keys.num_reloads == 1
    with pytest.raises(ConfigError):
        KeyFile(tmp_path / "missing")


def test_token_file_rotation(tmp_path: Path) -> None:
    path = tmp_path / "join_tokens"
    _write(path, "old-token\n")
    clock = Clock()
    tokens = TokenFile(path, clock=clock)
    assert tokens.tokens() == ("old-token",)
    _write(path, "# rotating\nold-token\nnew-token\n")
    clock.now_s = 1.0
    assert tokens.tokens() == ("old-token", "new-token")
    _write(path, "\n")  # an empty file would lock every worker out: ignored
    clock.now_s = 2.0
    assert tokens.tokens() == ("old-token", "new-token")


# ------------------------------------------------------------------------ roles and table


def _rpc_names() -> set[str]:
    names = set()
    for module in (router_pb2, pool_pb2, kv_transfer_pb2, governor_pb2, worker_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            names |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return names


def test_every_rpc_is_in_the_table_and_nothing_else() -> None:
    assert set(METHOD_ROLES) == _rpc_names()
    assert all(METHOD_ROLES.values())  # no method that nobody may call


def test_decisions() -> None:
    client = Principal(frozenset({Role.CLIENT}), tenant="acme", has_credential=True)
    anonymous = Principal(frozenset())
    worker = Principal(frozenset({Role.WORKER}), name="w", has_credential=True)
    generate = "/pdserve.api.v1.RouterService/Generate"
    set_target = "/pdserve.api.v1.PoolService/SetTargetSize"
    assert decide(generate, client) is Decision.ALLOW
    assert decide(generate, anonymous) is Decision.UNAUTHENTICATED
    assert decide(set_target, client) is Decision.PERMISSION_DENIED
    assert decide(set_target, worker) is Decision.PERMISSION_DENIED
    assert decide("/pdserve.api.v1.PoolService/Register", worker) is Decision.ALLOW
    assert decide("/grpc.health.v1.Health/Check", anonymous) is Decision.ALLOW
    assert decide("/pdserve.api.v1.NewService/Thing", client) is Decision.PERMISSION_DENIED


def test_only_an_admin_pins_the_local_prefill_threshold() -> None:
    admin = Principal(frozenset({Role.ADMIN}), name="ops", has_credential=True)
    service = Principal(frozenset({Role.SERVICE}), has_credential=True)
    client = Principal(frozenset({Role.CLIENT}), tenant="acme", has_credential=True)
    pin = "/pdserve.api.v1.CapacityGovernorService/SetLocalPrefillThreshold"
    show = "/pdserve.api.v1.CapacityGovernorService/GetLocalPrefillThreshold"
    assert decide(pin, admin) is Decision.ALLOW
    assert decide(pin, service) is Decision.PERMISSION_DENIED
    assert decide(pin, client) is Decision.PERMISSION_DENIED
    assert decide(show, service) is Decision.ALLOW and decide(show, admin) is Decision.ALLOW
    assert decide(show, client) is Decision.PERMISSION_DENIED


def test_authenticator_roles(tmp_path: Path) -> None:
    (tmp_path / "api").write_text(f"{CLIENT_KEY} acme\n")
    (tmp_path / "admin").write_text(f"{ADMIN_KEY} ops\n")
    strict = Authenticator(KeyFile(tmp_path / "api"), KeyFile(tmp_path / "admin"),
                           is_mutual_tls=True)
    assert strict.authenticate(None, None) == Principal(frozenset())
    client = strict.authenticate(CLIENT_KEY, None)
    assert client.roles == {Role.CLIENT} and client.tenant == "acme"
    assert strict.authenticate(ADMIN_KEY, None).roles == {Role.ADMIN}
    assert strict.authenticate(None, f"{SPIFFE}/worker/w1").roles == {Role.WORKER}
    assert strict.authenticate(None, f"{SPIFFE}/service/router").roles == {Role.SERVICE}
    # A client certificate proves nothing beyond being allowed to connect.
    assert strict.authenticate(None, f"{SPIFFE}/client/bob") == Principal(frozenset(), name="bob")
    assert strict.authenticate(None, "spiffe://elsewhere/service/x").roles == frozenset()
    for bad in (OTHER_CLIENT_KEY, ""):
        with pytest.raises(UnauthenticatedError):
            strict.authenticate(bad, None)
    # Without mTLS, once any key is configured the internal roles need a service token or a
    # worker credential: a caller without one gets only what no key file guards (admin here).
    keys_only = Authenticator(KeyFile(tmp_path / "api"), None, is_mutual_tls=False)
    assert keys_only.authenticate(None, None).roles == {Role.ADMIN}
    # Nothing configured at all: the laptop default, every role for everyone.
    assert Authenticator(None, None, is_mutual_tls=False).is_open
    assert auth_interceptor(CommonSettings()) is None


def test_bearer_parsing() -> None:
    assert bearer_key([("authorization", f"Bearer {CLIENT_KEY}")]) == CLIENT_KEY
    assert bearer_key([("x-other", "1"), ("authorization", f"bearer  {CLIENT_KEY} ")]) == CLIENT_KEY
    assert bearer_key([("authorization", f"Basic {CLIENT_KEY}")]) == ""
    assert bearer_key([("x-other", "1")]) is None and bearer_key(None) is None


# ------------------------------------------------------------------- over real gRPC + mTLS


class RecordingBackend:
    """Answers every request with one token and remembers the tenant it came with."""

    def __init__(self) -> None:
        self.tenants: list[str] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.tenants.append(request.tenant)
        yield GenerationChunk(token_ids=(65,), finish_reason=FinishReason.LENGTH)

    async def cancel(self, request_id: str) -> bool:
        return False

    def list_models(self) -> list[ModelCard]:
        return [ModelCard("m", max_context_tokens=128)]


class FakePool(pool_pb2_grpc.PoolServiceServicer):
    async def SetTargetSize(self, request, context):  # type: ignore[no-untyped-def]
        return pool_pb2.SetTargetSizeResponse(previous_num_workers=1)


@dataclass
class Pki:
    directory: Path
    certs: dict[str, IssuedCert]
    other_ca_client: IssuedCert

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def credentials(self, name: str | None) -> grpc.ChannelCredentials:
        if name is None:
            return grpc.ssl_channel_credentials(self.ca.read_bytes())
        cert = self.other_ca_client if name == "foreign" else self.certs[name]
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), cert.key_path.read_bytes(),
                                            cert.cert_path.read_bytes())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pytest.importorskip("cryptography", reason="pdserve certs needs 'cryptography'")
    directory = tmp_path_factory.mktemp("pki")
    certs = {c.name: c for c in make_dev_certs(directory, ["router", "governor", "worker-1"],
                                               client_names=["alice"])}
    foreign = make_dev_certs(tmp_path_factory.mktemp("foreign-pki"), [], client_names=["alice"])
    return Pki(directory, certs, foreign[0])


@dataclass
class Stack:
    address: str
    backend: RecordingBackend
    api_keys_path: Path


@pytest.fixture
async def stack(pki: Pki, tmp_path: Path) -> AsyncIterator[Stack]:
    api_keys = tmp_path / "api_keys"
    admin_keys = tmp_path / "admin_keys"
    _write(api_keys, f"{CLIENT_KEY} acme\n")
    _write(admin_keys, f"{ADMIN_KEY} ops\n")
    settings = CommonSettings(
        tls_cert_path=pki.certs["router"].cert_path, tls_key_path=pki.certs["router"].key_path,
        tls_ca_path=pki.ca, api_keys_path=api_keys, admin_keys_path=admin_keys)
    interceptor = auth_interceptor(settings)
    assert isinstance(interceptor, AuthInterceptor)
    # Reload checks on every use, so the test need not wait out the default poll interval.
    interceptor.authenticator.api_keys = KeyFile(api_keys, poll_interval_s=0.0)
    server = GrpcServer(tls=settings.tls, interceptors=[interceptor])
    backend = RecordingBackend()
    server.add_servicer("pdserve.api.v1.RouterService",
                        router_pb2_grpc.add_RouterServiceServicer_to_server,
                        RouterServicer(backend, OneTokenizer(ByteTokenizer())))
    server.add_servicer("pdserve.api.v1.PoolService",
                        pool_pb2_grpc.add_PoolServiceServicer_to_server, FakePool())
    port = await server.start()
    yield Stack(f"localhost:{port}", backend, api_keys)
    await server.stop(0)


async def _call(stack: Stack, pki: Pki, cert: str | None, method: str,
                key: str | None = None) -> grpc.StatusCode:
    metadata = bearer_metadata(key) if key else None
    async with grpc.aio.secure_channel(stack.address, pki.credentials(cert)) as channel:
        try:
            if method == "Generate":
                stub = router_pb2_grpc.RouterServiceStub(channel)
                request = router_pb2.GenerateRequest(model="m", prompt="hi")
                async for _ in stub.Generate(request, metadata=metadata, timeout=5):
                    pass
            elif method == "SetTargetSize":
                await pool_pb2_grpc.PoolServiceStub(channel).SetTargetSize(
                    pool_pb2.SetTargetSizeRequest(deployment="m", num_workers=2),
                    metadata=metadata, timeout=5)
            else:
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_mtls_refuses_a_client_without_a_certificate_or_from_another_ca(
        stack: Stack, pki: Pki) -> None:
    assert await _call(stack, pki, None, "Check") is grpc.StatusCode.UNAVAILABLE
    assert await _call(stack, pki, "foreign", "Check") is grpc.StatusCode.UNAVAILABLE
    assert await _call(stack, pki, "alice", "Check") is grpc.StatusCode.OK  # health is public
    assert stack.backend.tenants == []


async def test_client_keys_map_to_tenants_and_unauthenticated_is_refused(
        stack: Stack, pki: Pki) -> None:
    assert await _call(stack, pki, "alice", "Generate") is grpc.StatusCode.UNAUTHENTICATED
    assert (await _call(stack, pki, "alice", "Generate", OTHER_CLIENT_KEY)
            is grpc.StatusCode.UNAUTHENTICATED)
    # A worker or service certificate is no client credential.
    assert await _call(stack, pki, "worker-1", "Generate") is grpc.StatusCode.PERMISSION_DENIED
    assert stack.backend.tenants == []
    assert await _call(stack, pki, "alice", "Generate", CLIENT_KEY) is grpc.StatusCode.OK
    assert stack.backend.tenants == ["acme"]


async def test_admin_methods_need_admin_keys_or_a_service_identity(stack: Stack, pki: Pki) -> None:
    codes = {
        "client key": await _call(stack, pki, "alice", "SetTargetSize", CLIENT_KEY),
        "no key": await _call(stack, pki, "alice", "SetTargetSize"),
        "worker cert": await _call(stack, pki, "worker-1", "SetTargetSize"),
        "admin key": await _call(stack, pki, "alice", "SetTargetSize", ADMIN_KEY),
        "service cert": await _call(stack, pki, "governor", "SetTargetSize"),
    }
    assert codes == {
        "client key": grpc.StatusCode.PERMISSION_DENIED,
        "no key": grpc.StatusCode.UNAUTHENTICATED,
        "worker cert": grpc.StatusCode.PERMISSION_DENIED,
        "admin key": grpc.StatusCode.OK,
        "service cert": grpc.StatusCode.OK,
    }


async def test_api_keys_reload_without_a_restart(stack: Stack, pki: Pki) -> None:
    _write(stack.api_keys_path, f"{OTHER_CLIENT_KEY} globex\n")
    assert await _call(stack, pki, "alice", "Generate", OTHER_CLIENT_KEY) is grpc.StatusCode.OK
    assert (await _call(stack, pki, "alice", "Generate", CLIENT_KEY)
            is grpc.StatusCode.UNAUTHENTICATED)
    assert stack.backend.tenants == ["globex"]


async def test_server_certificate_reloads_without_a_restart(pki: Pki, tmp_path: Path) -> None:
    """A renewed server certificate is what new connections see, with no restart."""
    import ssl

    from pdserve.common.certs import CertificateAuthority, ReloadingServerCredentials

    ca = CertificateAuthority(pki.ca, pki.directory / "ca.key")
    served = ca.issue(tmp_path, "router")
    clock = Clock()
    reloading = ReloadingServerCredentials(served.tls(pki.ca), poll_interval_s=1.0, clock=clock)
    server = grpc.aio.server()
    port = server.add_secure_port("127.0.0.1:0", reloading.credentials())
    await server.start()

    def presented_certificate() -> bytes:
        context = ssl.create_default_context(cafile=pki.ca)
        context.load_cert_chain(pki.certs["alice"].cert_path, pki.certs["alice"].key_path)
        context.set_alpn_protocols(["h2"])
        with context.wrap_socket(__import__("socket").create_connection(("127.0.0.1", port)),
                                 server_hostname="localhost") as sock:
            return sock.getpeercert(binary_form=True) or b""

    import asyncio

    try:
        before = await asyncio.to_thread(presented_certificate)
        assert before == ssl.PEM_cert_to_DER_cert(served.cert_path.read_text())
        ca.issue(tmp_path, "router")  # renewal in place
        clock.now_s = 2.0
        after = await asyncio.to_thread(presented_certificate)
        assert after == ssl.PEM_cert_to_DER_cert(served.cert_path.read_text()) != before
        assert reloading.num_reloads == 1
    finally:
        await server.stop(0)


def test_settings_check_kv_tls_needs_tls_files() -> None:
    with pytest.raises(ConfigError):
        CommonSettings(kv_tls=True).check()
    CommonSettings(kv_tls=True, tls_cert_path=Path("c"), tls_key_path=Path("k"),
                   tls_ca_path=Path("ca")).check()


# ------------------------------------------------------------------------ join tokens


async def test_pool_join_tokens_rotate_without_a_restart(tmp_path: Path) -> None:
    import time

    from pdserve.common.types import WorkerRole
    from pdserve.pool.app import PoolApp
    from pdserve.pool.manager import Registration
    from pdserve.pool.settings import PoolSettings
    from pdserve.state.factory import open_backend
    from pdserve.state.prefix_index import MemoryPrefixIndex

    path = tmp_path / "join_tokens"
    _write(path, "token-one\n")
    settings = PoolSettings(role=WorkerRole.PREFILL, join_token_path=path)
    settings.check()
    backend = open_backend("memory://", time.time)
    app = PoolApp(settings, backend, MemoryPrefixIndex(), time.time)
    assert app.manager.join_token_source is not None  # the file, not policy.join_token
    clock = Clock()
    app.manager.join_token_source = TokenFile(path, clock=clock).tokens  # a clock we move
    registration = Registration(worker_id="", deployment="m", address="127.0.0.1:1")
    try:
        assert (await app.manager.register(registration, "token-one")).worker_id
        for wrong in ("token-two", "", "token-on"):
            with pytest.raises(UnauthenticatedError):
                await app.manager.register(registration, wrong)
        _write(path, "token-two\n")  # rotate: the old token is revoked, the new one works
        clock.now_s = 1.0
        assert (await app.manager.register(registration, "token-two")).worker_id
        with pytest.raises(UnauthenticatedError):
            await app.manager.register(registration, "token-one")
        workers = await backend.workers.list("m", WorkerRole.PREFILL)
        assert len(workers) == 2
    finally:
        await backend.close()
    with pytest.raises(ConfigError):
        PoolSettings(role=WorkerRole.PREFILL).check()  # neither a token nor a token file


async def test_http_api_keys_map_to_tenants_and_reload(tmp_path: Path) -> None:
    import aiohttp

    from pdserve.router.http_api import create_app, start_http_server

    path = tmp_path / "api_keys"
    _write(path, f"{CLIENT_KEY} acme\n")
    backend = RecordingBackend()
    app = create_app(backend, OneTokenizer(ByteTokenizer()),
                     api_keys=KeyFile(path, poll_interval_s=0.0))
    runner, port = await start_http_server(app, "127.0.0.1", 0)
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}

    async def status(session: aiohttp.ClientSession, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                headers=headers) as response:
            return response.status

    try:
        async with aiohttp.ClientSession() as session:
            assert await status(session, None) == 401
            assert await status(session, OTHER_CLIENT_KEY) == 401
            assert await status(session, CLIENT_KEY) == 200
            _write(path, f"{OTHER_CLIENT_KEY} globex\n")
            assert await status(session, CLIENT_KEY) == 401
            assert await status(session, OTHER_CLIENT_KEY) == 200
    finally:
        await runner.cleanup()
    assert backend.tenants == ["acme", "globex"]
