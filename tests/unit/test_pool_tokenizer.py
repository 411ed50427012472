"""A worker's tokenizer bundle through its pool manager: stored at registration, refused naming
the field when bad, kept alive by heartbeats and asked for again after a store restart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from helpers import StepClock
from helpers.tokenizers import build_tokenizer_folder

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import pool_pb2
from pdserve.common.errors import InvalidArgumentError, UnauthenticatedError
from pdserve.common.tokenizer_bundle import TokenizerBundle, bundle_from_folder, bundle_to_pb
from pdserve.common.types import WorkerRole
from pdserve.pool.manager import PoolManager, PoolPolicy
from pdserve.pool.servicer import PoolServicer
from pdserve.state.factory import open_backend
from pdserve.state.interfaces import StateBackend
from pdserve.state.prefix_index import MemoryPrefixIndex

JOIN_TOKEN = "join"
RECORD_TTL_S = 60.0


@dataclass
class Pool:
    backend: StateBackend
    servicer: PoolServicer


def pool(clock: StepClock) -> Pool:
    backend = open_backend(None, clock)
    policy = PoolPolicy(role=WorkerRole.DECODE, join_token=JOIN_TOKEN, record_ttl_s=RECORD_TTL_S)
    manager = PoolManager(policy, backend, MemoryPrefixIndex(), clock)
    return Pool(backend, PoolServicer({WorkerRole.DECODE: manager}, backend.workers,
                                      backend.events))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> TokenizerBundle:
    return bundle_from_folder(build_tokenizer_folder(tmp_path_factory.mktemp("tok")))


def worker(sha256: str, worker_id: str = "") -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=worker_id, deployment="m", role=pb.WORKER_ROLE_DECODE,
                         address="127.0.0.1:1", kv_layout=pb.KvLayout(num_blocks=64),
                         tokenizer_sha256=sha256, max_model_len=512)


def register(info: pb.WorkerInfo,
             tokenizer: pb.TokenizerBundle | None) -> pool_pb2.RegisterRequest:
    return pool_pb2.RegisterRequest(join_token=JOIN_TOKEN, worker=info, tokenizer=tokenizer)


def heartbeat(info: pb.WorkerInfo,
              tokenizer: pb.TokenizerBundle | None = None) -> pool_pb2.HeartbeatRequest:
    return pool_pb2.HeartbeatRequest(worker_id=info.worker_id, state=pb.WORKER_STATE_LOADING,
                                     load=pb.WorkerLoad(num_total_blocks=64), join_token=JOIN_TOKEN,
                                     worker=info, tokenizer=tokenizer)


async def test_registration_stores_the_bundle_and_heartbeats_keep_it(
    bundle: TokenizerBundle,
) -> None:
    clock = StepClock()
    target = pool(clock)
    info = worker(bundle.sha256)
    response = await target.servicer.Register(
        register(info, bundle_to_pb(bundle)), None)
    assert await target.backend.tokenizers.get(bundle.sha256) == bundle
    record = await target.backend.workers.get(response.worker_id)
    assert record is not None
    assert pb.WorkerInfo.FromString(record.spec).tokenizer_sha256 == bundle.sha256
    info.worker_id = response.worker_id
    for _ in range(3):  # heartbeats carry only the digest, and keep the bundle alive
        clock.advance(RECORD_TTL_S / 2)
        beat = await target.servicer.Heartbeat(heartbeat(info), None)
        assert not beat.should_send_tokenizer
    assert await target.backend.tokenizers.get(bundle.sha256) == bundle


async def test_after_a_store_restart_the_worker_is_asked_for_its_bundle(
    bundle: TokenizerBundle,
) -> None:
    info = worker(bundle.sha256, worker_id="d-1")
    restarted = pool(StepClock())  # a pool manager whose store lost everything
    beat = await restarted.servicer.Heartbeat(heartbeat(info), None)
    assert beat.was_readopted and beat.should_send_tokenizer
    assert await restarted.backend.tokenizers.get(bundle.sha256) is None
    beat = await restarted.servicer.Heartbeat(
        heartbeat(info, bundle_to_pb(bundle)), None)
    assert not beat.should_send_tokenizer
    assert await restarted.backend.tokenizers.get(bundle.sha256) == bundle


async def test_only_members_may_send_a_bundle_with_a_heartbeat(bundle: TokenizerBundle) -> None:
    target = pool(StepClock())
    request = heartbeat(worker(bundle.sha256, worker_id="d-1"), bundle_to_pb(bundle))
    request.join_token = "wrong"
    with pytest.raises(UnauthenticatedError):
        await target.servicer.Heartbeat(request, None)
    assert await target.backend.tokenizers.get(bundle.sha256) is None


async def test_workers_without_a_tokenizer_are_never_asked() -> None:
    target = pool(StepClock())
    response = await target.servicer.Register(
        register(worker(""), None), None)
    beat = await target.servicer.Heartbeat(
        heartbeat(worker("", response.worker_id)), None)
    assert not beat.should_send_tokenizer


def _with(message: pb.TokenizerBundle, **fields: object) -> pb.TokenizerBundle:
    changed = pb.TokenizerBundle()
    changed.CopyFrom(message)
    for name, value in fields.items():
        setattr(changed, name, value)
    return changed


def _resigned(bundle: TokenizerBundle, **fields: object) -> pb.TokenizerBundle:
    """A bundle with changed content and a digest that matches it."""
    return bundle_to_pb(TokenizerBundle(**{
        "tokenizer_json": bundle.tokenizer_json, "chat_template": bundle.chat_template,
        "eos_token": bundle.eos_token, "max_model_len": bundle.max_model_len, **fields}))


_BAD: list[tuple[str, Callable[[TokenizerBundle], tuple[str, pb.TokenizerBundle]]]] = [
    ("tokenizer.sha256", lambda b: (b.sha256, _with(bundle_to_pb(b), sha256="0" * 64))),
    ("tokenizer.tokenizer_json",
     lambda b: (b.sha256, _with(bundle_to_pb(b), tokenizer_json=b"\xff"))),
    ("tokenizer.tokenizer_json", lambda b: (
        (bad := _resigned(b, tokenizer_json=b'{"not": "a tokenizer"}')).sha256, bad)),
    ("tokenizer.chat_template",
     lambda b: ((bad := _resigned(b, chat_template="{% for %}")).sha256, bad)),
    ("worker.tokenizer_sha256", lambda b: ("f" * 64, bundle_to_pb(b))),
]


@pytest.mark.parametrize(("field", "make"), _BAD, ids=[f for f, _ in _BAD])
async def test_bad_bundles_are_refused_naming_the_field(
    bundle: TokenizerBundle, field: str,
    make: Callable[[TokenizerBundle], tuple[str, pb.TokenizerBundle]],
) -> None:
    target = pool(StepClock())
    advertised, message = make(bundle)
    with pytest.raises(InvalidArgumentError) as info:
        await target.servicer.Register(
            register(worker(advertised), message), None)
    assert info.value.field == field
    assert await target.backend.workers.list() == []
    assert await target.backend.tokenizers.get(message.sha256 or advertised) is None
