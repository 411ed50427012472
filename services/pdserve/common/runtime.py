"""Process set-up shared by every service: logs, tracing, metrics endpoint, signal-driven stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from typing import Any

from pdserve.common.logging import configure_logging
from pdserve.common.metrics import MetricsServer, gauge, start_metrics_server
from pdserve.common.settings import CommonSettings
from pdserve.common.telemetry import configure_tracing, is_tracing_enabled
from pdserve.common.version import software_version


@dataclass(slots=True)
class ProcessRuntime:
    tracer_provider: Any
    metrics: MetricsServer | None

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.tracer_provider is not None:
            with contextlib.suppress(Exception):
                self.tracer_provider.shutdown()


def setup_process(settings: CommonSettings) -> ProcessRuntime:
    configure_logging(settings.log_level, settings.log_format, settings.service_name)
    provider = None
    if is_tracing_enabled(settings):
        provider = configure_tracing(settings.service_name, settings.otel_endpoint,
                                     settings.otel_sampling_ratio)
    metrics = start_metrics_server(settings.metrics_port, settings.grpc_host)
    set_build_info(settings.service_name)
    return ProcessRuntime(provider, metrics)


def set_build_info(service_name: str) -> None:
    """``pdserve_process_build_info{service, version} 1``: which release each process of a
    fleet runs (mid-upgrade, a query by ``version`` shows what is left to roll)."""
    gauge("process", "build", "info", "The pdserve release this process runs (always 1)",
          ("service", "version")).labels(service_name, software_version()).set(1)


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set ``stop`` (graceful: the service drains and exits)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


def install_fast_event_loop(is_enabled: bool | None = None) -> bool:
    """Use uvloop's event loop for every ``asyncio.run`` of this process when it is installed
    (a dependency on Linux and macOS; without it the standard loop stays). ``is_enabled`` None
    reads ``PDSERVE_UVLOOP`` (``0``, ``false`` or ``no`` keep the standard loop). Call before the
    first loop starts. True if uvloop is now the loop policy."""
    if is_enabled is None:
        is_enabled = os.environ.get("PDSERVE_UVLOOP", "1").lower() not in ("0", "false", "no")
    if not is_enabled:
        return False
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
