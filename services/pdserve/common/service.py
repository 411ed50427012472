"""What ``pdserve serve <service>`` runs, and the shape every control-plane service shares.

Each service package builds itself from its own settings: ``<service>.app.build(settings)``
returns a ``Service``. ``pdserve serve`` sets up the process (logs, tracing, metrics), builds the
service, runs it until SIGTERM/SIGINT, and knows nothing else about it.

Control-plane services (router, pool managers, coordinator, governor) are a ``GrpcApp`` (its
servicers, background tasks, optional HTTP endpoint) on one gRPC server, plus whatever the build
opened for it (stores, the durable writer): ``GrpcService`` runs that shape.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings

Announce = Callable[[str], None]
"""Prints one line of what the process bound or reached (``<service> grpc host:port``,
``ready <service>``), flushed, for whoever started it."""

Closer = Callable[[], Awaitable[None] | None]
"""Closes something a build opened (a store, a channel, the durable writer)."""


class Service(Protocol):
    async def run(self, stop: asyncio.Event, announce: Announce) -> None:
        """Start; announce the addresses bound, then a line starting with ``ready``; serve until
        ``stop`` is set (a signal, or the service itself giving up); then shut down gracefully."""
        ...


class GrpcApp(Protocol):
    """A control-plane service's own parts: ``register`` adds its servicers to the server,
    ``start`` starts its background work once the server listens, ``close`` stops it."""

    def register(self, server: GrpcServer) -> None: ...

    def start(self) -> Awaitable[None] | None: ...

    async def close(self) -> None: ...


class GrpcService:
    """One control-plane service in its own process: ``app`` on a gRPC server made from
    ``settings``; ``closers`` (what the build opened) run after the app closed, last first.
    ``http_port`` (an attribute of the app, when it serves HTTP) is announced too."""

    def __init__(self, name: str, settings: CommonSettings, app: GrpcApp,
                 closers: Sequence[Closer] = ()) -> None:
        self.name = name
        self.settings = settings
        self.app = app
        self.closers = list(closers)

    async def run(self, stop: asyncio.Event, announce: Announce) -> None:
        server = GrpcServer.from_settings(self.settings)
        self.app.register(server)
        port = await server.start()
        try:
            started = self.app.start()
            if started is not None:
                await started
            announce(f"{self.name} grpc {self.settings.grpc_host}:{port}")
            http_port = getattr(self.app, "http_port", None)
            http_host = getattr(self.settings, "http_host", self.settings.grpc_host)
            scheme = getattr(self.app, "http_scheme", "http")
            if http_port:
                announce(f"{self.name} http {scheme}://{http_host}:{http_port}")
            announce(f"ready {self.name}")
            await stop.wait()
        finally:
            await server.stop()
            await self.app.close()
            for closer in reversed(self.closers):
                result = closer()
                if inspect.isawaitable(result):
                    await result
