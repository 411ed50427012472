"""Wiring of the KV-transfer coordinator: core, servicer, worker notifier and reaper."""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.api.v1 import kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.common.convert import token_to_pb
from pdserve.common.grpc_client import open_channel
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.service import GrpcService
from pdserve.common.settings import CommonSettings
from pdserve.common.types import Clock, Ticket
from pdserve.db.durable import TransferSinkAdapter, open_durable
from pdserve.kv_transfer.coordinator import (
    CoordinatorPolicy,
    KvTransferCoordinator,
    TransferStatsSink,
)
from pdserve.kv_transfer.rendezvous import Rendezvous, open_rendezvous
from pdserve.kv_transfer.servicer import SERVICE_NAME, KvTransferServicer
from pdserve.kv_transfer.settings import CoordinatorSettings
from pdserve.state.interfaces import StateBackend, WorkerStore
from pdserve.state.stores import open_stores

logger = logging.getLogger(__name__)


class GrpcTicketNotifier:
    """Tells both workers of a ticket that ended early to drop it (DropTicket, short deadline)."""

    def __init__(
        self, workers: WorkerStore, settings: CommonSettings, timeout_s: float = 2.0
    ) -> None:
        self._workers = workers
        self._settings = settings
        self._timeout_s = timeout_s
        self._stubs: dict[str, worker_pb2_grpc.WorkerAgentServiceStub] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerAgentServiceStub:
        if address not in self._stubs:
            self._stubs[address] = worker_pb2_grpc.WorkerAgentServiceStub(
                open_channel(address, self._settings))
        return self._stubs[address]

    async def ticket_ended(self, ticket: Ticket) -> None:
        request = worker_pb2.DropTicketRequest(token=token_to_pb(ticket.token),
                                               reason=f"{ticket.state}: {ticket.reason}")
        calls = []
        for worker_id in (ticket.decode_worker_id, ticket.prefill_worker_id):
            if not worker_id:
                continue
            record = await self._workers.get(worker_id)
            if record is not None and record.address:
                calls.append(
                    self._stub(record.address).DropTicket(request, timeout=self._timeout_s)
                )
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                logger.debug("DropTicket for %s failed: %s", ticket.token, result)


class CoordinatorApp:
    def __init__(self, backend: StateBackend, clock: Clock, policy: CoordinatorPolicy,
                 rendezvous: Rendezvous, settings: CommonSettings,
                 stats_sink: TransferStatsSink | None = None) -> None:
        self.coordinator = KvTransferCoordinator(
            backend.tickets, backend.workers, clock, policy,
            GrpcTicketNotifier(backend.workers, settings), stats_sink)
        self.servicer = KvTransferServicer(self.coordinator, rendezvous)
        self._stop = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None

    def register(self, server: GrpcServer) -> None:
        server.add_servicer(
            SERVICE_NAME,
            kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server,
            self.servicer,
        )

    def start(self) -> None:
        self._reaper = asyncio.create_task(self.coordinator.run_reaper(self._stop))

    async def close(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            await self._reaper


def build(settings: CoordinatorSettings) -> GrpcService:
    """The coordinator as its own process: its stores and durable writer from ``settings``."""
    stores = open_stores(settings.redis_url)
    durable = open_durable(settings.database_url, settings.durable_spool_dir,
                           settings.service_name, migrate=False)
    policy = CoordinatorPolicy(settings.default_lease_s, settings.max_lease_s,
                               settings.reap_interval_s)
    app = CoordinatorApp(stores.backend, time.time, policy, open_rendezvous(stores.redis_client),
                         settings, TransferSinkAdapter(durable) if durable else None)
    return GrpcService(settings.service_name, settings, app,
                       [stores.close, *([durable.close] if durable else [])])
