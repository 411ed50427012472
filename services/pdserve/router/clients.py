"""The router's clients: the coordinator (over gRPC; the one-machine stack injects an in-process
``TicketClient`` from ``pdserve.kv_transfer.local_client``) and the worker agents (always gRPC).
Each returns core types and raises ``PdserveError``s."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2 as kv_pb
from pdserve.api.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.api.v1 import worker_pb2, worker_pb2_grpc
from pdserve.common.convert import token_from_pb, token_to_pb
from pdserve.common.errors import UnavailableError
from pdserve.common.grpc_client import error_from_rpc_error, open_channel
from pdserve.common.settings import CommonSettings
from pdserve.common.types import FencingToken, TicketSpec


class TicketClient(Protocol):
    async def open(self, spec: TicketSpec, timeout_s: float) -> FencingToken: ...

    async def abort(self, token: FencingToken, reason: str, timeout_s: float) -> None: ...


class GrpcTicketClient:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = kv_grpc.KvTransferServiceStub(channel)

    async def open(self, spec: TicketSpec, timeout_s: float) -> FencingToken:
        try:
            response = await self._stub.OpenTicket(kv_pb.OpenTicketRequest(
                deployment=spec.deployment, decode_worker_id=spec.decode_worker_id,
                prefill_worker_id=spec.prefill_worker_id, num_blocks=spec.num_blocks,
                lease_ms=int(spec.lease_s * 1000), request_id=spec.request_id,
                num_prompt_tokens=spec.num_prompt_tokens,
            ), timeout=timeout_s)
        except grpc.RpcError as exc:
            error = error_from_rpc_error(exc)
            if error.code is grpc.StatusCode.CANCELLED:
                # Not this router's doing (its own cancellation is asyncio's, not a status): the
                # coordinator dropped the call, e.g. a replica shutting down as it arrived. As
                # with UNAVAILABLE the outcome is unknown (a ticket opened meanwhile expires with
                # its lease), and the request is retried before its first token, not failed.
                raise UnavailableError(
                    f"the coordinator cancelled OpenTicket: {error.message}") from None
            raise error from None
        return token_from_pb(response.ticket.token)

    async def abort(self, token: FencingToken, reason: str, timeout_s: float) -> None:
        try:
            await self._stub.AbortTicket(kv_pb.AbortTicketRequest(
                token=token_to_pb(token), reason=reason, reporter_id="router"), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None


class WorkerClients:
    """One channel per worker address, opened on first use and kept."""

    def __init__(self, settings: CommonSettings) -> None:
        self._settings = settings
        self._stubs: dict[str, worker_pb2_grpc.WorkerAgentServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> worker_pb2_grpc.WorkerAgentServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, self._settings)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.WorkerAgentServiceStub(channel)
        return stub

    async def admit(self, address: str, token: FencingToken, num_prompt_tokens: int,
                    num_blocks: int, lease_s: float, transport: str,
                    timeout_s: float) -> pb.KvDestination:
        try:
            response = await self.stub(address).AdmitTicket(worker_pb2.AdmitTicketRequest(
                token=token_to_pb(token), num_prompt_tokens=num_prompt_tokens,
                num_blocks=num_blocks, lease_ms=int(lease_s * 1000), transport=transport,
            ), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
        return response.destination

    async def prefill(self, address: str, token: FencingToken, prompt_token_ids: list[int],
                      destination: pb.KvDestination, lease_s: float, request_id: str,
                      timeout_s: float) -> worker_pb2.PrefillResponse:
        try:
            return await self.stub(address).Prefill(worker_pb2.PrefillRequest(
                token=token_to_pb(token), prompt_token_ids=prompt_token_ids,
                destination=destination, lease_ms=int(lease_s * 1000), request_id=request_id,
            ), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None

    def decode(self, address: str, request: worker_pb2.DecodeRequest,
               timeout_s: float) -> grpc.aio.UnaryStreamCall:
        return self.stub(address).Decode(request, timeout=timeout_s)

    async def drop(self, address: str, token: FencingToken, reason: str, timeout_s: float) -> None:
        try:
            await self.stub(address).DropTicket(worker_pb2.DropTicketRequest(
                token=token_to_pb(token), reason=reason), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


async def iterate_stream(
    call: grpc.aio.UnaryStreamCall,
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """The call's messages; gRPC failures come out as ``PdserveError``."""
    try:
        async for message in call:
            yield message
    except grpc.RpcError as exc:
        raise error_from_rpc_error(exc) from None


