"""Wiring of a router replica: pool view, router core, gRPC servicer, OpenAI HTTP API, outcomes."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING

from pdserve.api.v1 import router_pb2_grpc
from pdserve.common.grpc_client import open_channel
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.service import GrpcService
from pdserve.db.durable import WindowWriterAdapter, open_durable
from pdserve.router.admission import AdmissionConfig
from pdserve.router.clients import GrpcTicketClient, TicketClient, WorkerClients
from pdserve.router.core import Router, RouterConfig
from pdserve.router.failover import FailoverLimits
from pdserve.router.outcomes import OutcomeAggregator, WindowWriter
from pdserve.router.policy import RoutingConfig
from pdserve.router.pool_view import PoolFollower, PoolView
from pdserve.router.servicer import SERVICE_NAME, RouterServicer
from pdserve.router.settings import RouterSettings
from pdserve.router.thresholds import PublishedThresholds
from pdserve.router.tokenizer_registry import TokenizerRegistry
from pdserve.state.interfaces import StateBackend
from pdserve.state.prefix_index import PrefixIndex
from pdserve.state.stores import open_stores

if TYPE_CHECKING:
    from aiohttp import web

logger = logging.getLogger(__name__)


def replica_id() -> str:
    """This router replica's name in durable records: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


def router_config(settings: RouterSettings) -> RouterConfig:
    return RouterConfig(
        routing=RoutingConfig(
            local_prefill_threshold_tokens=settings.local_prefill_threshold_tokens,
            prefill_saturation_tokens=settings.prefill_saturation_tokens,
        ),
        max_attempts=settings.max_attempts, max_in_flight=settings.max_in_flight,
        max_tokens_limit=settings.max_tokens_limit, lease_s=settings.lease_s,
        stream_idle_timeout_s=settings.stream_idle_timeout_s,
        transport=settings.transport, slo_ttft_ms=settings.slo_ttft_ms,
        slo_tpot_ms=settings.slo_tpot_ms, admission=admission_config(settings),
        failover=FailoverLimits(max_failovers=settings.max_failovers,
                                max_failover_s=settings.max_failover_s),
    )


def admission_config(settings: RouterSettings) -> AdmissionConfig:
    return AdmissionConfig(
        slo_ttft_s=settings.slo_ttft_ms / 1000, ttft_budget_fraction=settings.shed_ttft_fraction,
        fair_share_onset=settings.fair_share_onset,
        is_shedding_enabled=settings.is_shedding_enabled, max_in_flight=settings.max_in_flight,
        max_pending=settings.max_pending_requests, tenant_share=settings.tenant_share,
        tenant_max_in_flight=settings.tenant_max_in_flight,
        tenant_weights=settings.tenant_weights,
        max_retry_after_s=settings.max_retry_after_s,
    )


class RouterApp:
    def __init__(self, settings: RouterSettings, backend: StateBackend, prefix_index: PrefixIndex,
                 tickets: TicketClient, window_writer: WindowWriter | None = None) -> None:
        self.settings = settings
        self.view = PoolView()
        self.tokenizers = TokenizerRegistry(self.view, backend.tokenizers)
        self.follower = PoolFollower(backend, self.view)
        self.workers = WorkerClients(settings)
        self.outcomes = OutcomeAggregator(settings.slo_ttft_ms, settings.slo_tpot_ms,
                                          settings.outcome_window_s, writer=window_writer,
                                          source=replica_id())
        config = router_config(settings)
        self.thresholds = PublishedThresholds(backend.thresholds, config.routing,
                                              settings.threshold_refresh_s)
        self.router = Router(config, self.view, tickets, self.workers, prefix_index,
                             self.outcomes, thresholds=self.thresholds)
        self.servicer = RouterServicer(self.router, self.tokenizers)
        self.http_port: int | None = None
        self.http_scheme = "https" if settings.http_tls_cert_path is not None else "http"
        self._http_runner: web.AppRunner | None = None
        self._stop = asyncio.Event()
        self._outcome_task: asyncio.Task[None] | None = None

    def register(self, server: GrpcServer) -> None:
        server.add_servicer(SERVICE_NAME, router_pb2_grpc.add_RouterServiceServicer_to_server,
                            self.servicer)

    async def start(self) -> None:
        await self.follower.start()
        await self.thresholds.start()
        self._outcome_task = asyncio.create_task(self.outcomes.run(self._stop))
        if self.settings.http_port >= 0:
            from pdserve.common.credentials import load_key_file
            from pdserve.router.http_api import create_app, server_ssl_context, start_http_server

            settings = self.settings
            ssl_context = None
            if settings.http_tls_cert_path is not None and settings.http_tls_key_path is not None:
                ssl_context = server_ssl_context(settings.http_tls_cert_path,
                                                 settings.http_tls_key_path)
            app = create_app(self.router, self.tokenizers,
                             api_keys=load_key_file(settings.api_keys_path))
            self._http_runner, self.http_port = await start_http_server(
                app, settings.http_host, settings.http_port, ssl_context)

    async def close(self) -> None:
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        self._stop.set()
        if self._outcome_task is not None:
            await self._outcome_task
        await self.thresholds.close()
        await self.follower.close()
        await self.workers.close()


def build(settings: RouterSettings) -> GrpcService:
    """A router replica as its own process: it follows the pools in the shared stores and opens
    tickets at the coordinator over gRPC."""
    stores = open_stores(settings.redis_url)
    durable = open_durable(settings.database_url, settings.durable_spool_dir,
                           settings.service_name, migrate=False)
    channel = open_channel(settings.coordinator_address, settings)
    app = RouterApp(settings, stores.backend, stores.prefix_index, GrpcTicketClient(channel),
                    WindowWriterAdapter(durable) if durable else None)
    return GrpcService(settings.service_name, settings, app,
                       [stores.close, *([durable.close] if durable else []), channel.close])
