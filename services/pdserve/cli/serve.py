"""``pdserve serve <service>``: one service in this process (port 0 = any free port; the process
prints the addresses it bound, then a line starting with ``ready``).

A table of services: each names its settings class and the module whose ``build(settings)``
makes it (imported only when that service runs). Nothing here knows how a service is wired.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from dataclasses import dataclass

from pdserve.common.runtime import install_fast_event_loop, setup_process, stop_on_signals
from pdserve.common.service import Service
from pdserve.common.settings import CommonSettings
from pdserve.common.settings_fields import add_settings_arguments, settings_from_namespace
from pdserve.governor.settings import GovernorSettings
from pdserve.kv_transfer.settings import CoordinatorSettings
from pdserve.pool.settings import PoolSettings
from pdserve.router.settings import RouterSettings
from pdserve.worker.settings import WorkerSettings


@dataclass(frozen=True, slots=True)
class ServiceEntry:
    settings: type[CommonSettings]
    build_module: str
    """Module with ``build(settings) -> Service``."""
    role: str | None = None
    """The pool managers: the role this name implies (``--role`` need not be given)."""


SERVICES: dict[str, ServiceEntry] = {
    "router": ServiceEntry(RouterSettings, "pdserve.router.app"),
    "prefill-pool": ServiceEntry(PoolSettings, "pdserve.pool.app", role="prefill"),
    "decode-pool": ServiceEntry(PoolSettings, "pdserve.pool.app", role="decode"),
    "kv-transfer": ServiceEntry(CoordinatorSettings, "pdserve.kv_transfer.app"),
    "governor": ServiceEntry(GovernorSettings, "pdserve.governor.app"),
    "worker": ServiceEntry(WorkerSettings, "pdserve.worker.app"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    services = parser.add_subparsers(dest="service", metavar="SERVICE", required=True)
    for name, entry in SERVICES.items():
        sub = services.add_parser(name, help=f"run the {name} service",
                                  description=(entry.settings.__doc__ or "").strip())
        add_settings_arguments(sub, entry.settings)


def settings_for(args: argparse.Namespace) -> CommonSettings:
    entry = SERVICES[args.service]
    if entry.role is not None and getattr(args, "role", None) is None:
        args.role = entry.role
    if getattr(args, "service_name", None) is None:
        args.service_name = args.service
    return settings_from_namespace(entry.settings, args, os.environ)


def run(args: argparse.Namespace) -> int:
    settings = settings_for(args)
    install_fast_event_loop()
    return asyncio.run(_serve(SERVICES[args.service], settings))


def _announce(line: str) -> None:
    print(line, flush=True)


async def _serve(entry: ServiceEntry, settings: CommonSettings) -> int:
    runtime = setup_process(settings)
    stop = asyncio.Event()
    stop_on_signals(stop)
    if runtime.metrics is not None:
        _announce(f"{settings.service_name} metrics "
                  f"http://{settings.grpc_host}:{runtime.metrics.port}/metrics")
    try:
        service: Service = importlib.import_module(entry.build_module).build(settings)
        await service.run(stop, _announce)
        return 0
    finally:
        runtime.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
