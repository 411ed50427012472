"""gRPC adapter of the router: ``Generate`` (server stream), ``Cancel``, ``ListModels``.

A ``Generate`` with ``resume_token_ids`` continues a stream another replica was serving when it
died (``router.failover``); with ``include_text``, the resumed stream's text starts after the
resumed tokens' text (the client has that)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.common.auth import current_tenant
from pdserve.common.errors import InvalidArgumentError
from pdserve.common.tokenizer import Tokenizer
from pdserve.router.detokenizer import IncrementalText
from pdserve.router.tokenizer_registry import TokenizerSource
from pdserve.router.types import (
    FINISH_REASON_TO_PB,
    GenerationBackend,
    GenerationRequest,
    PrefillMode,
)

SERVICE_NAME = "pdserve.api.v1.RouterService"

_MODE = {
    pb.PREFILL_MODE_UNSPECIFIED: PrefillMode.AUTO,
    pb.PREFILL_MODE_REMOTE: PrefillMode.REMOTE,
    pb.PREFILL_MODE_LOCAL: PrefillMode.LOCAL,
}


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """``tokenizers`` gives each deployment's tokenizer: prompt text is encoded with it (with
    the tokenizer's own special tokens, as for an OpenAI completion) and ``include_text`` text
    comes from its incremental decoder."""

    def __init__(self, backend: GenerationBackend, tokenizers: TokenizerSource) -> None:
        self._backend = backend
        self._tokenizers = tokenizers

    def _request(self, request: router_pb2.GenerateRequest, tenant: str,
                 tokenizer: Tokenizer) -> GenerationRequest:
        if request.prompt and request.prompt_token_ids:
            raise InvalidArgumentError("prompt: set prompt or prompt_token_ids, not both",
                                       field="prompt")
        if request.prompt_token_ids:
            vocab = tokenizer.vocab_size
            if any(t >= vocab for t in request.prompt_token_ids):
                raise InvalidArgumentError(
                    f"prompt_token_ids: ids must be < {vocab}", field="prompt_token_ids")
            token_ids = tuple(request.prompt_token_ids)
        else:
            token_ids = tuple(tokenizer.encode(request.prompt, add_special_tokens=True))
        if request.prefill_mode not in _MODE:
            raise InvalidArgumentError("prefill_mode: unknown value", field="prefill_mode")
        if any(t >= tokenizer.vocab_size for t in request.resume_token_ids):
            raise InvalidArgumentError(
                f"resume_token_ids: ids must be < {tokenizer.vocab_size}", field="resume_token_ids")
        sampling = request.sampling
        return GenerationRequest(
            request_id=request.request_id, model=request.model, prompt_token_ids=token_ids,
            max_tokens=sampling.max_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0, seed=sampling.seed, ignore_eos=True,
            stop=tuple(sampling.stop), prefill_mode=_MODE[request.prefill_mode], tenant=tenant,
            resume_token_ids=tuple(request.resume_token_ids),
        )

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        tokenizer = await self._tokenizers.for_model(request.model)
        generation = self._request(request, current_tenant(), tokenizer)
        request_id = generation.request_id
        text = IncrementalText(tokenizer)
        text.push(generation.resume_token_ids)  # released to the client by the replica that died
        async for chunk in self._backend.generate(generation):
            message = router_pb2.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids)
            if request.include_text:
                message.text = text.push(chunk.token_ids)
                if chunk.finish_reason is not None:
                    message.text += text.finish()
            if chunk.finish_reason is not None:
                message.finish_reason = FINISH_REASON_TO_PB[chunk.finish_reason]
                message.prefill_worker_id = chunk.prefill_worker_id
                message.decode_worker_id = chunk.decode_worker_id
            if chunk.usage is not None:
                message.usage.CopyFrom(pb.Usage(
                    prompt_tokens=chunk.usage.prompt_tokens,
                    completion_tokens=chunk.usage.completion_tokens,
                    cached_prompt_tokens=chunk.usage.cached_prompt_tokens))
            if chunk.timing is not None:
                message.timing.CopyFrom(router_pb2.RequestTiming(
                    ttft_ms=chunk.timing.ttft_ms, tpot_ms=chunk.timing.tpot_ms,
                    queue_ms=chunk.timing.queue_ms, is_local_prefill=chunk.timing.is_local_prefill,
                    num_attempts=chunk.timing.num_attempts,
                    num_failovers=chunk.timing.num_failovers))
            yield message

    async def Cancel(
        self, request: router_pb2.CancelRequest, context: grpc.aio.ServicerContext,
    ) -> router_pb2.CancelResponse:
        if not request.request_id:
            raise InvalidArgumentError("request_id: required", field="request_id")
        return router_pb2.CancelResponse(is_found=await self._backend.cancel(request.request_id))

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext,
    ) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(models=[
            router_pb2.ModelInfo(name=card.name, max_context_tokens=card.max_context_tokens,
                                 num_prefill_workers=card.num_prefill_workers,
                                 num_decode_workers=card.num_decode_workers)
            for card in self._backend.list_models()
        ])
