"""The one-machine stack (``pdserve up``) with every door closed: mutual TLS on gRPC, KV over
TLS, client API keys and separate admin keys. Certificates are made at test time.

Asserts that an unauthenticated client and a worker that is not registered are refused, that
refused workers never appear in the pool or receive a request, that a client key cannot use the
operator API, that requests still complete (prefill on the other worker, KV over TLS), and that
a distinctive prompt never shows up in any log line of the stack at DEBUG level, error paths
included. A second part checks the KV data path's TLS on its own: a sender from another CA or
without a worker identity is refused and nothing lands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import pool_pb2, pool_pb2_grpc, router_pb2, router_pb2_grpc
from pdserve.common.credentials import bearer_metadata

pytest.importorskip("cryptography", reason="pdserve certs needs 'cryptography'")

from pdserve.common.certs import IssuedCert, PeerKind, make_dev_certs  # noqa: E402

pytestmark = pytest.mark.timeout(180)

MODEL = "llama-3.1-8b"
CLIENT_KEY = "ck-" + uuid.uuid4().hex
ADMIN_KEY = "ak-" + uuid.uuid4().hex
JOIN_TOKEN = "jt-" + uuid.uuid4().hex
MARKER = "zq" + uuid.uuid4().hex[:12] + "xv"
"""A prompt fragment that cannot occur in a log line by chance."""
READY_TIMEOUT_S = 60.0


class Process:
    """``python -m pdserve <args>``, output captured line by line (stdout and stderr)."""

    def __init__(self, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "OTEL_"))}
        env["PYTHONUNBUFFERED"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_line(self, prefix: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                if self.process.poll() is not None and not self._reader.is_alive():
                    pytest.fail(f"exited before '{prefix}':\n{self.output()[-4000:]}")
                if time.monotonic() > deadline:
                    pytest.fail(f"no '{prefix}' within {timeout_s}s:\n{self.output()[-4000:]}")
                self._cond.wait(0.2)

    def wait_exit(self, timeout_s: float) -> int:
        code = self.process.wait(timeout_s)
        self._reader.join(5.0)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15.0)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(5.0)
        self._reader.join(5.0)


@dataclass
class Stack:
    up: Process
    grpc_address: str
    http_url: str
    ca: Path
    certs: dict[str, IssuedCert]
    foreign: dict[str, IssuedCert]

    def channel(self, cert: str | None = "alice", *, foreign: bool = False) -> grpc.Channel:
        chosen = (self.foreign if foreign else self.certs).get(cert or "")
        credentials = grpc.ssl_channel_credentials(
            self.ca.read_bytes(),
            chosen.key_path.read_bytes() if chosen else None,
            chosen.cert_path.read_bytes() if chosen else None)
        return grpc.secure_channel(self.grpc_address, credentials)

    def generate(self, request: router_pb2.GenerateRequest, key: str | None = CLIENT_KEY,
                 cert: str | None = "alice") -> list[router_pb2.GenerateResponse]:
        with self.channel(cert) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            metadata = bearer_metadata(key) if key else None
            return list(stub.Generate(request, metadata=metadata, timeout=30))

    def workers(self) -> list[pb.WorkerInfo]:
        with self.channel() as channel:
            stub = pool_pb2_grpc.PoolServiceStub(channel)
            response = stub.ListWorkers(pool_pb2.ListWorkersRequest(deployment=MODEL),
                                        metadata=bearer_metadata(ADMIN_KEY), timeout=10)
        return list(response.workers)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("tls")
    certs = {c.name: c for c in make_dev_certs(directory / "pki", ["up", "worker"],
                                               client_names=["alice"])}
    foreign = {c.name: c for c in make_dev_certs(directory / "foreign", ["worker"],
                                                 client_names=["alice"])}
    (directory / "api_keys").write_text(f"{CLIENT_KEY} acme\n")
    (directory / "admin_keys").write_text(f"{ADMIN_KEY} ops\n")
    pki = directory / "pki"
    up = Process([
        "up", "--grpc-port", "0", "--http-port", "0", "--speedup", "100",
        "--num-prefill", "1", "--num-decode", "1", "--local-prefill-threshold-tokens", "0",
        "--log-level", "debug", "--log-format", "text", "--join-token", JOIN_TOKEN,
        "--tls-cert-path", str(pki / "up.pem"), "--tls-key-path", str(pki / "up.key"),
        "--tls-ca-path", str(pki / "ca.pem"), "--kv-tls",
        "--api-keys-path", str(directory / "api_keys"),
        "--admin-keys-path", str(directory / "admin_keys"),
    ])
    try:
        up.wait_line("ready")
        grpc_address = up.wait_line("grpc ").split()[1]
        http_url = up.wait_line("http ").split()[1]
        yield Stack(up, grpc_address, http_url, pki / "ca.pem", certs, foreign)
    finally:
        up.stop()


def _request(prompt: str, **fields: object) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model=MODEL, prompt=prompt,
                                      sampling=pb.SamplingParams(max_tokens=4), **fields)


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _http(stack: Stack, path: str, body: bytes, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(stack.http_url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_unauthenticated_clients_are_refused(stack: Stack) -> None:
    prompt = f"hello {MARKER} unauthenticated"
    assert (
        _code(lambda: stack.generate(_request(prompt), key=None)) is grpc.StatusCode.UNAUTHENTICATED
    )
    assert _code(lambda: stack.generate(_request(prompt), key="ck-" + "0" * 32)) is (
        grpc.StatusCode.UNAUTHENTICATED)
    # No client certificate, or one from another CA: the TLS handshake itself fails.
    assert _code(lambda: stack.generate(_request(prompt), cert=None)) is grpc.StatusCode.UNAVAILABLE
    with stack.channel("alice", foreign=True) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        assert _code(lambda: list(stub.Generate(_request(prompt), timeout=10,
                                                metadata=bearer_metadata(CLIENT_KEY)))) is (
            grpc.StatusCode.UNAVAILABLE)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    assert _http(stack, "/v1/completions", body, None) == 401
    assert _http(stack, "/v1/completions", body, "ck-" + "0" * 32) == 401
    assert _http(stack, "/v1/completions", body, CLIENT_KEY) == 200


def test_authenticated_requests_complete_with_kv_over_tls(stack: Stack) -> None:
    chunks = stack.generate(_request(f"The {MARKER} prompt " * 20,
                                     prefill_mode=pb.PREFILL_MODE_REMOTE))
    assert sum(len(c.token_ids) for c in chunks) == 4
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert chunks[-1].prefill_worker_id.startswith("p-")  # the KV crossed the TLS data path


def test_client_keys_cannot_use_the_operator_api(stack: Stack) -> None:
    request = pool_pb2.SetTargetSizeRequest(deployment=MODEL, role=pb.WORKER_ROLE_DECODE,
                                            num_workers=1, set_by="test")
    with stack.channel() as channel:
        stub = pool_pb2_grpc.PoolServiceStub(channel)
        assert _code(lambda: stub.SetTargetSize(request, metadata=bearer_metadata(CLIENT_KEY),
                                                timeout=10)) is grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: stub.SetTargetSize(request, timeout=10)) is (
            grpc.StatusCode.UNAUTHENTICATED)
        assert _code(lambda: stub.SetTargetSize(request, metadata=bearer_metadata(ADMIN_KEY),
                                                timeout=10)) is grpc.StatusCode.OK


def _rogue_worker(stack: Stack, cert: IssuedCert, ca: Path, join_token: str) -> Process:
    return Process([
        "serve", "worker", "--role", "decode", "--deployment", MODEL,
        "--pool-address", stack.grpc_address, "--coordinator-address", stack.grpc_address,
        "--join-token", join_token, "--speedup", "100", "--log-format", "text",
        "--tls-cert-path", str(cert.cert_path), "--tls-key-path", str(cert.key_path),
        "--tls-ca-path", str(ca), "--metrics-port", "-1",
        # A handshake the pool refuses reads as UNAVAILABLE to the worker, which asks again
        # until its registration deadline (60 s by default) before it gives up.
        "--register-timeout-s", "5",
    ])


def test_unregistered_workers_are_refused_and_never_receive_traffic(stack: Stack) -> None:
    legit_ids = {w.worker_id for w in stack.workers()}
    assert len(legit_ids) == 2
    # A worker certificate of this cluster but a wrong join token; a certificate from another
    # CA with the right token. Both try to join the decode pool while requests flow.
    wrong_token = _rogue_worker(stack, stack.certs["worker"], stack.ca, "jt-wrong-" + "x" * 20)
    foreign_ca = _rogue_worker(stack, stack.foreign["worker"], stack.foreign["worker"].cert_path
                               .parent / "ca.pem", JOIN_TOKEN)
    used: set[str] = set()
    try:
        for i in range(6):
            chunks = stack.generate(_request(f"request {i} {MARKER} " * 10))
            used |= {chunks[-1].decode_worker_id, chunks[-1].prefill_worker_id}
            assert {w.worker_id for w in stack.workers()} == legit_ids
        assert wrong_token.wait_exit(60) != 0
        assert foreign_ca.wait_exit(60) != 0
    finally:
        wrong_token.stop()
        foreign_ca.stop()
    assert "join_token" in wrong_token.output(), wrong_token.output()[-2000:]
    assert used - {""} <= legit_ids
    assert {w.worker_id for w in stack.workers()} == legit_ids
    # The right token from a client certificate (no worker identity), with or without a client
    # key, does not make a worker either.
    worker = pb.WorkerInfo(deployment=MODEL, role=pb.WORKER_ROLE_DECODE, address="127.0.0.1:1",
                           kv_layout=pb.KvLayout(num_blocks=16))
    register = pool_pb2.RegisterRequest(join_token=JOIN_TOKEN, worker=worker)
    with stack.channel("alice") as channel:
        stub = pool_pb2_grpc.PoolServiceStub(channel)
        assert _code(lambda: stub.Register(register, timeout=10)) is (
            grpc.StatusCode.UNAUTHENTICATED)
        assert _code(lambda: stub.Register(register, timeout=10,
                                           metadata=bearer_metadata(CLIENT_KEY))) is (
            grpc.StatusCode.PERMISSION_DENIED)
    assert {w.worker_id for w in stack.workers()} == legit_ids


def test_prompt_text_never_appears_in_logs(stack: Stack) -> None:
    prompt = f"Please keep {MARKER} private"
    stack.generate(_request(prompt))
    failing = [
        _request(prompt, prompt_token_ids=[1, 2, 3]),  # both prompt forms: INVALID_ARGUMENT
        router_pb2.GenerateRequest(model=MODEL, prompt=prompt,
                                   sampling=pb.SamplingParams(max_tokens=2**31)),
        router_pb2.GenerateRequest(model="no-such-model", prompt=prompt),
        router_pb2.GenerateRequest(model=MODEL, prompt=prompt * 20_000),  # beyond the context
    ]
    codes = [_code(lambda r=r: stack.generate(r)) for r in failing]
    assert grpc.StatusCode.OK not in codes, codes
    bodies = [
        {"model": MODEL, "prompt": prompt, "max_tokens": 2},
        {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2},
        {"model": MODEL, "prompt": prompt, "temperature": "hot"},
        {"model": MODEL, "prompt": prompt, "logprobs": 3},
        {"model": MODEL, "messages": [{"role": "wizard", "content": prompt}]},
    ]
    statuses = [_http(stack, "/v1/completions" if "prompt" in b else "/v1/chat/completions",
                      json.dumps(b).encode(), CLIENT_KEY) for b in bodies]
    statuses.append(_http(stack, "/v1/completions", f'{{"prompt": "{prompt}"'.encode(),
                          CLIENT_KEY))  # not JSON
    assert statuses[:2] == [200, 200] and all(s == 400 for s in statuses[2:]), statuses
    stack.generate(_request("flush"))  # a request after them, so their log lines are written
    output = stack.up.output()
    assert " DEBUG " in output, "the stack did not log at DEBUG: the check would be vacuous"
    leaked = [line for line in output.splitlines() if MARKER in line]
    assert leaked == [], leaked[:5]


# ------------------------------------------------------------------------ KV path over TLS


async def _transfer(sender_cert: IssuedCert, sender_ca: Path, receiver_cert: IssuedCert,
                    receiver_ca: Path) -> tuple[bool, bool]:
    """One ticket from a sender with ``sender_cert`` to a receiver with ``receiver_cert``:
    ``(sender succeeded, destination blocks changed)``."""
    from pdserve.common.types import FencingToken
    from pdserve.worker.engine import KvCache, KvLayout
    from pdserve.worker.kv_owner import BlockOwnerTable
    from pdserve.worker.transports.tcp.backend import TcpBackend
    from pdserve.worker.transports.tcp.settings import KvTls, TcpTransportSettings
    from pdserve.worker.transports.values import KvDestinationSpec, TransferFailedError

    layout = KvLayout(num_layers=2, num_blocks=8, block_size_tokens=16, block_nbytes=1024)
    source, destination = KvCache(layout), KvCache(layout)
    for buffer in source.layer_buffers:
        buffer[:] = np.random.default_rng(3).integers(0, 256, buffer.shape, dtype=np.uint8)
    before = [b.copy() for b in destination.layer_buffers]

    def backend(cert: IssuedCert, ca: Path) -> TcpBackend:
        tls = KvTls(cert.cert_path, cert.key_path, ca)
        return TcpBackend(TcpTransportSettings(tls=tls, connect_timeout_s=5.0))

    owners = BlockOwnerTable(layout.num_blocks)
    receiver = backend(receiver_cert, receiver_ca).create_receiver(destination, owners)
    address = await receiver.start("127.0.0.1", 0)
    token, block_ids = FencingToken.new(), list(range(layout.num_blocks))
    owners.assign(token, block_ids)
    receiver.expect(token, block_ids, layout.num_layers)
    sender = backend(sender_cert, sender_ca).create_sender(source)
    is_ok = True
    try:
        await sender.open(KvDestinationSpec(address, tuple(block_ids), "tcp", layout), token)
        for layer in range(layout.num_layers):
            await sender.offer_layer(layer, block_ids)
        await sender.finish(1, 0.0)
        await receiver.wait(token, 10.0)
    except TransferFailedError:
        is_ok = False
    finally:
        await sender.close()
        await receiver.close()
    if is_ok:
        assert all(np.array_equal(a, b) for a, b in zip(source.layer_buffers,
                                                        destination.layer_buffers, strict=True))
    changed = any(not np.array_equal(a, b) for a, b in zip(before, destination.layer_buffers,
                                                           strict=True))
    return is_ok, changed


async def test_kv_tls_moves_kv_between_workers_and_refuses_others(
        tmp_path: Path) -> None:
    ours = {c.name: c for c in make_dev_certs(tmp_path / "pki", ["worker-a", "worker-b",
                                                                  "router"])}
    theirs = {c.name: c for c in make_dev_certs(tmp_path / "other", ["worker-x"])}
    ca, other_ca = tmp_path / "pki" / "ca.pem", tmp_path / "other" / "ca.pem"
    assert ours["router"].kind is PeerKind.SERVICE
    assert await _transfer(ours["worker-a"], ca, ours["worker-b"], ca) == (True, True)
    # Another CA's worker, or a certificate that is no worker's: refused, nothing written.
    assert await _transfer(theirs["worker-x"], other_ca, ours["worker-b"], ca) == (False, False)
    assert await _transfer(ours["router"], ca, ours["worker-b"], ca) == (False, False)
