"""The decode worker admits a ticket at the start of its Decode stream (``DecodeRequest.admit``):
one router->decode call per request where there were two (``AdmitTicket``, then ``Decode``).

A whole stack in this process, real gRPC between every part, sim workers whose KV crosses a real
socket: a decode worker that says ``admits_in_decode`` is sent no ``AdmitTicket``; one that does
not (a release before the field, as mid-upgrade) is admitted the old way; both serve the same
tokens. And the worker's side of the contract, called directly: the admission message comes
first and carries the destination ``AdmitTicket`` would have; an admission it refuses fails the
stream with the status ``AdmitTicket`` would have, naming the field.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest
from helpers.local_stack import LocalStack, local_stack

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2, worker_pb2_grpc
from pdserve.common.convert import token_to_pb
from pdserve.common.types import TicketSpec, WorkerRole
from pdserve.worker.process import WorkerProcess

MODEL = "llama-3.1-8b"
JOIN_TOKEN = "join-" + "j" * 27
PROMPTS = ("a prompt long enough to prefill remotely, once",
           "another prompt, long enough to be prefilled on the prefill worker")
MAX_TOKENS = 6


@dataclass
class Stack:
    local: LocalStack
    admit_calls: list[str] = field(default_factory=list)
    """Decode workers the router sent ``AdmitTicket`` (by address)."""
    decode_admits: list[bool] = field(default_factory=list)
    """``DecodeRequest.admit`` of each Decode call the router made."""

    @property
    def workers(self) -> dict[WorkerRole, WorkerProcess]:
        return self.local.workers

    async def complete(self, prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{self.local.http_url}/v1/completions",
                                    json=body) as response:
                assert response.status == 200, await response.text()
                payload = await response.json()
        assert payload["usage"]["completion_tokens"] == MAX_TOKENS
        return str(payload["choices"][0]["text"])


@contextlib.asynccontextmanager
async def _stack(*, decode_admits_in_decode: bool) -> AsyncIterator[Stack]:
    """The decode worker describing itself with or without ``admits_in_decode``; every prompt
    prefilled remotely."""
    def prepare(worker: WorkerProcess) -> None:
        if worker.settings.role is WorkerRole.DECODE and not decode_admits_in_decode:
            worker.describe = _without_admits_in_decode(worker.describe)  # type: ignore[method-assign]

    async with local_stack(MODEL, JOIN_TOKEN, local_prefill_threshold_tokens=4,
                           prepare_worker=prepare) as local:
        stack = Stack(local)
        _spy_on_calls(stack)
        yield stack


def _without_admits_in_decode(describe: Callable[[], pb.WorkerInfo]) -> Callable[[], pb.WorkerInfo]:
    def described() -> pb.WorkerInfo:
        info = describe()
        info.ClearField("admits_in_decode")
        return info
    return described


def _spy_on_calls(stack: Stack) -> None:
    clients = stack.local.router.workers
    admit, decode = clients.admit, clients.decode

    async def spied_admit(address: str, *args: Any, **kwargs: Any) -> pb.KvDestination:
        stack.admit_calls.append(address)
        return await admit(address, *args, **kwargs)

    def spied_decode(address: str, request: worker_pb2.DecodeRequest,
                     timeout_s: float) -> grpc.aio.UnaryStreamCall:
        stack.decode_admits.append(request.admit)
        return decode(address, request, timeout_s)

    clients.admit = spied_admit  # type: ignore[method-assign]
    clients.decode = spied_decode  # type: ignore[method-assign]


async def _serve_all(stack: Stack) -> list[str]:
    outputs = [await stack.complete(prompt) for prompt in PROMPTS]
    assert len(stack.decode_admits) == len(PROMPTS)
    return outputs


async def test_a_decode_worker_that_admits_in_decode_gets_one_call_per_request() -> None:
    async with _stack(decode_admits_in_decode=True) as stack:
        await _serve_all(stack)
        assert stack.admit_calls == []
        assert stack.decode_admits == [True] * len(PROMPTS)
        decode = stack.workers[WorkerRole.DECODE].agent
        assert decode.tickets() == []  # each request's blocks freed after its last token
        assert len(decode.kv_checksums) == len(PROMPTS)  # each KV landed over the socket


async def test_an_older_decode_worker_is_admitted_by_admit_ticket_and_serves_the_same() -> None:
    async with _stack(decode_admits_in_decode=True) as new:
        expected = await _serve_all(new)
    async with _stack(decode_admits_in_decode=False) as old:
        assert await _serve_all(old) == expected
        assert len(old.admit_calls) == len(PROMPTS)
        assert old.decode_admits == [False] * len(PROMPTS)
        assert len(old.workers[WorkerRole.DECODE].agent.kv_checksums) == len(PROMPTS)


async def _open(stack: Stack, num_blocks: int = 4) -> pb.FencingToken:
    ticket = await stack.local.stores.backend.tickets.open(TicketSpec(
        MODEL, "d-1", "p-1", num_blocks, 30.0, num_prompt_tokens=40))
    return token_to_pb(ticket.token)


async def test_the_admission_message_comes_first_with_admit_tickets_destination() -> None:
    async with _stack(decode_admits_in_decode=True) as stack:
        decode = stack.workers[WorkerRole.DECODE]
        async with grpc.aio.insecure_channel(decode.address) as channel:
            stub = worker_pb2_grpc.WorkerAgentServiceStub(channel)
            by_admit_ticket = await stub.AdmitTicket(worker_pb2.AdmitTicketRequest(
                token=await _open(stack), num_prompt_tokens=40, num_blocks=4,
                transport="tcp"), timeout=5)
            call = stub.Decode(worker_pb2.DecodeRequest(
                token=await _open(stack), prompt_token_ids=list(range(40)), num_blocks=4,
                sampling=pb.SamplingParams(max_tokens=2), kv_wait_timeout_ms=200, admit=True,
                transport="tcp"), timeout=5)
            first = await call.read()
            assert first.is_admitted and not first.token_ids
            assert first.destination.kv_address == by_admit_ticket.destination.kv_address != ""
            assert len(first.destination.block_ids) == len(by_admit_ticket.destination.block_ids)
            assert set(first.destination.block_ids).isdisjoint(
                by_admit_ticket.destination.block_ids)  # its own blocks
            assert len(decode.agent.tickets()) == 2
            call.cancel()


@pytest.mark.parametrize(("change", "field_name"), [
    ({"transport": "nixl"}, "transport"),
    ({"is_local_prefill": True}, "admit"),
])
async def test_an_admission_the_worker_refuses_fails_the_stream_naming_the_field(
        change: dict[str, Any], field_name: str) -> None:
    async with _stack(decode_admits_in_decode=True) as stack:
        decode = stack.workers[WorkerRole.DECODE]
        async with grpc.aio.insecure_channel(decode.address) as channel:
            stub = worker_pb2_grpc.WorkerAgentServiceStub(channel)
            request = {"token": await _open(stack), "prompt_token_ids": list(range(40)),
                       "num_blocks": 4, "sampling": pb.SamplingParams(max_tokens=2),
                       "admit": True, "transport": "tcp", **change}
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Decode(worker_pb2.DecodeRequest(**request), timeout=5):
                    pass
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert field_name in (caught.value.details() or "")
            assert decode.agent.tickets() == []  # nothing admitted, nothing held


async def test_a_prefill_worker_refuses_an_admitting_decode() -> None:
    async with _stack(decode_admits_in_decode=True) as stack:
        prefill = stack.workers[WorkerRole.PREFILL]
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            stub = worker_pb2_grpc.WorkerAgentServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Decode(worker_pb2.DecodeRequest(
                        token=await _open(stack), prompt_token_ids=list(range(40)),
                        num_blocks=4, sampling=pb.SamplingParams(max_tokens=2), admit=True),
                        timeout=5):
                    pass
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
