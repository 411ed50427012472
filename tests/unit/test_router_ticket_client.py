"""The router's coordinator client over real gRPC: a call the coordinator cancelled (a replica
shutting down as the call arrived; seen once in a rolling restart, where the request failed
CANCELLED before its first token) is UNAVAILABLE, which the router retries on another replica;
a refusal keeps its own status."""

from __future__ import annotations

import grpc
import pytest

from pdserve.api.v1 import kv_transfer_pb2 as kv_pb
from pdserve.api.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.common.errors import InvalidArgumentError, UnavailableError
from pdserve.common.types import TicketSpec
from pdserve.router.clients import GrpcTicketClient

SPEC = TicketSpec(deployment="m", decode_worker_id="d-1", prefill_worker_id="p-1", num_blocks=4,
                  lease_s=3.0, request_id="r-1", num_prompt_tokens=50)


class _Coordinator(kv_grpc.KvTransferServiceServicer):
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def OpenTicket(self, request: kv_pb.OpenTicketRequest,
                         context: grpc.aio.ServicerContext) -> kv_pb.OpenTicketResponse:
        await context.abort(self.code, "test: dropped")
        raise AssertionError("unreachable")


@pytest.mark.parametrize(("code", "expected"), [
    (grpc.StatusCode.CANCELLED, UnavailableError),
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
])
async def test_a_cancelled_open_is_unavailable_and_a_refusal_keeps_its_status(
        code: grpc.StatusCode, expected: type[Exception]) -> None:
    server = grpc.aio.server()
    kv_grpc.add_KvTransferServiceServicer_to_server(_Coordinator(code), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(expected) as caught:
                await GrpcTicketClient(channel).open(SPEC, 5.0)
        assert "dropped" in str(caught.value)
    finally:
        await server.stop(None)
