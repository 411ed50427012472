"""The calls the expert-placement loop makes to workers (``WorkerPlacementClient``) and their
gRPC implementation: apply a placement, ask a worker its instance shape and the version in
force. Every call has the client's deadline; errors are ``PdserveError``s."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import grpc

from pdserve.api.v1 import worker_pb2, worker_pb2_grpc
from pdserve.common.grpc_client import error_from_rpc_error, open_channel
from pdserve.governor.expert_convert import WorkerInstance, instance_from_info


class WorkerPlacementClient(Protocol):
    """The calls the loop makes to workers; errors are ``PdserveError``s."""

    async def apply(self, address: str, request: worker_pb2.ApplyExpertPlacementRequest) -> int:
        """The version the worker acknowledges as in force."""
        ...

    async def status(self, address: str) -> WorkerInstance: ...

    async def retain(self, addresses: Iterable[str]) -> None:
        """Forget connections to every other address."""
        ...

    async def close(self) -> None: ...


class GrpcWorkerPlacementClient:
    """``WorkerPlacementClient`` over gRPC, one channel per worker address."""

    def __init__(self, settings: Any = None, timeout_s: float = 5.0) -> None:
        self._settings = settings
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerAgentServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            if self._settings is not None:
                channel = open_channel(address, self._settings)
            else:
                channel = grpc.aio.insecure_channel(address)
            self._channels[address] = channel
        return worker_pb2_grpc.WorkerAgentServiceStub(channel)

    async def apply(self, address: str, request: worker_pb2.ApplyExpertPlacementRequest) -> int:
        try:
            response = await self._stub(address).ApplyExpertPlacement(request,
                                                                      timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
        return int(response.version)

    async def status(self, address: str) -> WorkerInstance:
        try:
            response = await self._stub(address).GetStatus(worker_pb2.GetStatusRequest(),
                                                           timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
        return instance_from_info(response.worker, int(response.expert_placement_version))

    async def retain(self, addresses: Iterable[str]) -> None:
        keep = set(addresses)
        for address in [a for a in self._channels if a not in keep]:
            await self._channels.pop(address).close()

    async def close(self) -> None:
        await self.retain(())
