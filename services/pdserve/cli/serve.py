"""``pdserve serve <service>``: one service in this process (port 0 = any free port; the process
prints the addresses it bound, then a line starting with ``ready``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from pdserve.common.service_settings import (
    CoordinatorSettings,
    GovernorSettings,
    PoolSettings,
    RouterSettings,
    WorkerSettings,
)
from pdserve.common.settings_fields import add_settings_arguments, settings_from_namespace

_SETTINGS = {
    "router": RouterSettings,
    "prefill-pool": PoolSettings,
    "decode-pool": PoolSettings,
    "kv-transfer": CoordinatorSettings,
    "governor": GovernorSettings,
    "worker": WorkerSettings,
}
SERVICES = tuple(_SETTINGS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    services = parser.add_subparsers(dest="service", metavar="SERVICE", required=True)
    for name in SERVICES:
        sub = services.add_parser(name, help=f"run the {name} service",
                                  description=(_SETTINGS[name].__doc__ or "").strip())
        add_settings_arguments(sub, _SETTINGS[name])


def settings_for(args: argparse.Namespace) -> object:
    if args.service in ("prefill-pool", "decode-pool") and getattr(args, "role", None) is None:
        args.role = args.service.split("-")[0]
    if getattr(args, "service_name", None) is None:
        args.service_name = args.service
    return settings_from_namespace(_SETTINGS[args.service], args, os.environ)


def run(args: argparse.Namespace) -> int:
    settings = settings_for(args)
    return asyncio.run(_serve(args.service, settings))


def _announce(line: str) -> None:
    print(line, flush=True)


async def _serve(service: str, settings: object) -> int:
    from pdserve.common.runtime import setup_process, stop_on_signals

    runtime = setup_process(settings)  # type: ignore[arg-type]
    stop = asyncio.Event()
    stop_on_signals(stop)
    if runtime.metrics is not None:
        _announce(f"{service} metrics http://{settings.grpc_host}:{runtime.metrics.port}/metrics")  # type: ignore[attr-defined]
    try:
        if service == "worker":
            from pdserve.worker.process import run_worker

            await run_worker(settings, stop, _announce)  # type: ignore[arg-type]
            return 0
        await _serve_control_plane(service, settings, stop)
        return 0
    finally:
        runtime.close()


async def _serve_control_plane(service: str, settings: object, stop: asyncio.Event) -> None:
    from pdserve.cli.assembly import open_durable, open_stores
    from pdserve.common.grpc_server import GrpcServer
    from pdserve.db.durable import LifecycleSinkAdapter, TransferSinkAdapter, WindowWriterAdapter

    stores = open_stores(settings)  # type: ignore[arg-type]
    durable = open_durable(settings, migrate=False)  # type: ignore[arg-type]
    server = GrpcServer.from_settings(settings)  # type: ignore[arg-type]
    app: object
    if service == "kv-transfer":
        import time

        from pdserve.kv_transfer.app import CoordinatorApp
        from pdserve.kv_transfer.coordinator import CoordinatorPolicy

        policy = CoordinatorPolicy(settings.default_lease_s, settings.max_lease_s,  # type: ignore[attr-defined]
                                   settings.reap_interval_s)  # type: ignore[attr-defined]
        app = CoordinatorApp(stores.backend, time.time, policy, stores.rendezvous, settings,  # type: ignore[arg-type]
                             TransferSinkAdapter(durable) if durable else None)
    elif service in ("prefill-pool", "decode-pool"):
        import time

        from pdserve.pool.app import PoolApp
        from pdserve.pool.provisioner import LocalProcessProvisioner

        provisioner = LocalProcessProvisioner() if settings.is_provisioning else None  # type: ignore[attr-defined]
        lease = None
        if provisioner is not None:  # replicas of a pool: one actuates at a time
            from pdserve.common.leadership import holder_id, open_lease

            lease = open_lease(stores.redis_client, f"pool-actuation:{settings.role}",  # type: ignore[attr-defined]
                               holder_id())
        app = PoolApp(settings, stores.backend, stores.prefix_index, time.time, provisioner,  # type: ignore[arg-type]
                      LifecycleSinkAdapter(durable) if durable else None, lease)
    elif service == "router":
        from pdserve.common.grpc_client import open_channel
        from pdserve.router.app import RouterApp
        from pdserve.router.clients import GrpcTicketClient

        channel = open_channel(settings.coordinator_address, settings)  # type: ignore[attr-defined,arg-type]
        app = RouterApp(settings, stores.backend, stores.prefix_index, GrpcTicketClient(channel),  # type: ignore[arg-type]
                        WindowWriterAdapter(durable) if durable else None)
    elif service == "governor":
        from pdserve.common.leadership import holder_id, open_lease
        from pdserve.governor.app import GovernorApp

        app = GovernorApp(settings, durable,  # type: ignore[arg-type]
                          lease=open_lease(stores.redis_client, "governor", holder_id()),
                          lease_ttl_s=settings.leader_lease_s)  # type: ignore[attr-defined]
    else:  # pragma: no cover - argparse restricts the choices
        raise SystemExit(f"unknown service {service}")
    app.register(server)  # type: ignore[attr-defined]
    port = await server.start()
    start = app.start()  # type: ignore[attr-defined]
    if asyncio.iscoroutine(start):
        await start
    _announce(f"{service} grpc {settings.grpc_host}:{port}")  # type: ignore[attr-defined]
    http_port = getattr(app, "http_port", None)
    if http_port:
        _announce(f"{service} http http://{settings.http_host}:{http_port}")  # type: ignore[attr-defined]
    _announce(f"ready {service}")
    await stop.wait()
    await server.stop()
    await app.close()  # type: ignore[attr-defined]
    await stores.close()
    if durable is not None:
        durable.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
