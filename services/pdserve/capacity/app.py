"""Wiring of the capacity governor service."""

from __future__ import annotations

from pdserve.api.v1 import governor_pb2_grpc
from pdserve.capacity.servicer import SERVICE_NAME, CapacityGovernorServicer
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.service_settings import GovernorSettings


class GovernorApp:
    def __init__(self, settings: GovernorSettings, durable: object = None) -> None:
        self.settings = settings
        self.servicer = CapacityGovernorServicer()

    def register(self, server: GrpcServer) -> None:
        server.add_servicer(SERVICE_NAME,
                            governor_pb2_grpc.add_CapacityGovernorServiceServicer_to_server,
                            self.servicer)

    def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
