"""The router's tokenizers: which one a deployment uses (loaded by the digest its workers
advertise, ahead of the first request), the model's context limit, and gRPC text streamed in
whole characters by the model's own decoder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import tokenizers
from helpers import StepClock
from helpers.tokenizers import build_tokenizer_folder

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import router_pb2
from pdserve.common import tokenizer as tk
from pdserve.common.errors import InvalidArgumentError, UnavailableError
from pdserve.common.hf_tokenizer import HfTokenizer
from pdserve.common.tokenizer import ByteTokenizer
from pdserve.common.tokenizer_bundle import TokenizerBundle, bundle_from_folder
from pdserve.common.types import WorkerRecord, WorkerRole, WorkerState
from pdserve.router.core import Router, RouterConfig
from pdserve.router.pool_view import PoolView
from pdserve.router.servicer import RouterServicer
from pdserve.router.tokenizer_registry import TokenizerRegistry
from pdserve.router.types import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ModelCard,
    Usage,
)
from pdserve.state.memory.tokenizers import MemoryTokenizerStore


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> TokenizerBundle:
    return bundle_from_folder(build_tokenizer_folder(tmp_path_factory.mktemp("tok")))


def record(worker_id: str, sha256: str = "", *, role: WorkerRole = WorkerRole.DECODE,
           state: WorkerState = WorkerState.READY, num_blocks: int = 64,
           max_model_len: int = 0) -> WorkerRecord:
    info = pb.WorkerInfo(worker_id=worker_id, kv_layout=pb.KvLayout(
        block_size_tokens=16, num_blocks=num_blocks), tokenizer_sha256=sha256,
        max_model_len=max_model_len)
    return WorkerRecord(worker_id=worker_id, deployment="m", role=role, state=state,
                        address=f"{worker_id}:1", spec=info.SerializeToString())


class CountingStore(MemoryTokenizerStore):
    def __init__(self) -> None:
        super().__init__(StepClock())
        self.num_gets = 0

    async def get(self, sha256: str) -> TokenizerBundle | None:
        self.num_gets += 1
        return await super().get(sha256)


# -- which tokenizer --------------------------------------------------------------------------


async def test_deployments_without_a_digest_use_the_byte_tokenizer() -> None:
    view = PoolView()
    view.replace("m", [record("d0")])
    registry = TokenizerRegistry(view, CountingStore())
    assert isinstance(await registry.for_model("m"), ByteTokenizer)
    assert isinstance(await registry.for_model("unknown"), ByteTokenizer)


async def test_a_digest_in_the_view_is_loaded_once_before_any_request(
    bundle: TokenizerBundle,
) -> None:
    view, store = PoolView(), CountingStore()
    await store.put(bundle, ttl_s=60.0)
    registry = TokenizerRegistry(view, store)
    view.upsert(record("d0", bundle.sha256))
    view.upsert(record("p0", bundle.sha256, role=WorkerRole.PREFILL))
    for _ in range(200):  # the load starts in the background, before any request
        if store.num_gets:
            break
        await asyncio.sleep(0.01)
    assert store.num_gets == 1
    tokenizer = await registry.for_model("m")  # awaits that load, or has its result
    assert isinstance(tokenizer, HfTokenizer) and tokenizer.sha256 == bundle.sha256
    assert await registry.for_model("m") is tokenizer
    assert store.num_gets == 1


async def test_a_bundle_missing_from_the_store_is_unavailable_until_it_comes(
    bundle: TokenizerBundle,
) -> None:
    view, store = PoolView(), CountingStore()
    registry = TokenizerRegistry(view, store)
    view.replace("m", [record("d0", bundle.sha256)])
    with pytest.raises(UnavailableError, match="not in the store"):
        await registry.for_model("m")
    await store.put(bundle, ttl_s=60.0)  # the worker's next heartbeat brought it back
    assert isinstance(await registry.for_model("m"), HfTokenizer)


def test_the_digest_most_ready_workers_serve_wins() -> None:
    view = PoolView()
    view.replace("m", [record("d0", "a"), record("d1", "b"), record("d2", "b"),
                       record("d3", "c", state=WorkerState.LOADING),
                       record("d4", "c", state=WorkerState.LOADING),
                       record("d5", "c", state=WorkerState.LOADING)])
    assert view.tokenizer_sha256("m") == "b"
    view.replace("m", [record("d0", "b"), record("d1", "a")])
    assert view.tokenizer_sha256("m") == "a"  # a tie: the smaller digest
    view.replace("m", [record("d0", "c", state=WorkerState.LOADING)])
    assert view.tokenizer_sha256("m") == "c"  # none ready yet
    assert view.tokenizer_sha256("none") == ""


# -- context limits ---------------------------------------------------------------------------


def test_the_context_is_the_kv_cache_capped_by_the_models_limit() -> None:
    view = PoolView()
    view.replace("m", [record("d0", num_blocks=64)])
    assert view.max_context_tokens("m") == 64 * 16
    view.replace("m", [record("d0", num_blocks=64, max_model_len=512),
                       record("p0", role=WorkerRole.PREFILL, max_model_len=100)])
    assert view.max_context_tokens("m") == 512
    view.replace("m", [record("d0", num_blocks=4, max_model_len=512)])
    assert view.max_context_tokens("m") == 64


@pytest.mark.parametrize(("num_prompt_tokens", "max_tokens", "field"), [
    (512, 1, "prompt"), (600, 1, "prompt"), (500, 13, "max_tokens")])
async def test_a_prompt_over_the_models_context_is_refused_naming_the_field(
    num_prompt_tokens: int, max_tokens: int, field: str,
) -> None:
    view = PoolView()
    view.replace("m", [record("d0", num_blocks=1024, max_model_len=512)])
    router = Router(RouterConfig(), view, tickets=None, workers=None)  # type: ignore[arg-type]
    request = GenerationRequest(request_id="r", model="m", max_tokens=max_tokens,
                                prompt_token_ids=tuple(range(num_prompt_tokens)))
    with pytest.raises(InvalidArgumentError) as info:
        async for _ in router.generate(request):
            pass
    assert info.value.field == field
    assert "512" in info.value.message


# -- gRPC text --------------------------------------------------------------------------------


class SplittingBackend:
    """Replies with ``reply_ids``, one token per chunk."""

    def __init__(self, reply_ids: list[int]) -> None:
        self.reply_ids = reply_ids
        self.requests: list[GenerationRequest] = []

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[GenerationChunk]:
        for index, token_id in enumerate(self.reply_ids):
            is_last = index == len(self.reply_ids) - 1
            yield GenerationChunk(
                token_ids=(token_id,), finish_reason=FinishReason.LENGTH if is_last else None,
                usage=Usage(1, len(self.reply_ids)) if is_last else None)

    async def cancel(self, request_id: str) -> bool:
        return False

    def list_models(self) -> list[ModelCard]:
        return []


class ModelTokenizer:
    def __init__(self, tokenizer: HfTokenizer) -> None:
        self.tokenizer = tokenizer

    async def for_model(self, deployment: str) -> HfTokenizer:
        return self.tokenizer


async def test_grpc_text_streams_whole_characters_with_the_models_decoder(
    bundle: TokenizerBundle,
) -> None:
    tokenizer = HfTokenizer.from_bundle(bundle)
    library = tokenizers.Tokenizer.from_str(bundle.tokenizer_json.decode("utf-8"))
    text = "héllo 🙂 日本語"
    byte_chars = tk._byte_to_unicode()  # one token per byte: characters split across chunks
    reply_ids = [library.token_to_id(byte_chars[b]) for b in text.encode("utf-8")]
    backend = SplittingBackend(reply_ids)
    servicer = RouterServicer(backend, ModelTokenizer(tokenizer))
    request = router_pb2.GenerateRequest(model="m", prompt="The quick brown fox",
                                         include_text=True)
    request.sampling.max_tokens = len(reply_ids)
    texts = [m.text async for m in servicer.Generate(request, None)]  # type: ignore[arg-type]
    assert "".join(texts) == text
    assert not any("\ufffd" in piece for piece in texts)
    assert backend.requests[0].prompt_token_ids == tuple(tokenizer.encode("The quick brown fox"))
