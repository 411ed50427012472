"""Wiring of the capacity governor service."""

from __future__ import annotations

from pdserve.api.v1 import governor_pb2_grpc
from pdserve.capacity.experts import ExpertPlacementService
from pdserve.capacity.servicer import SERVICE_NAME, CapacityGovernorServicer
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.service_settings import GovernorSettings
from pdserve.state.interfaces import StateBackend


class GovernorApp:
    def __init__(self, settings: GovernorSettings, durable: object = None,
                 backend: StateBackend | None = None) -> None:
        """``backend``: the hot state shared with the pool managers (``pdserve up``); by
        default the governor opens its own from ``settings.redis_url``."""
        self.settings = settings
        self.servicer = CapacityGovernorServicer()
        # Expert placement (EPLB): loads from the pools' hot state, versions in the durable store.
        self.experts = ExpertPlacementService(
            settings, backend, getattr(durable, "repository", None))
        self.servicer.experts = self.experts

    def register(self, server: GrpcServer) -> None:
        server.add_servicer(SERVICE_NAME,
                            governor_pb2_grpc.add_CapacityGovernorServiceServicer_to_server,
                            self.servicer)

    def start(self) -> None:
        self.experts.start()

    async def close(self) -> None:
        await self.experts.close()
