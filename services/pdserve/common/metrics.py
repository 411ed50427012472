"""Prometheus metrics: names that follow the house grammar, and the /metrics endpoint.

Built on ``prometheus-client`` (the Prometheus project's own Python client): histograms with
fixed buckets, the text exposition format and a threaded HTTP endpoint are what it does, and a
hand-rolled copy would be more code to get wrong than the dependency weighs.

Names are ``pdserve_<area>_<noun>_<unit>``: ``area`` is the service or subsystem (``router``,
``pool``, ``kvtransfer``, ``governor``, ``worker``, ``grpc``), ``noun`` what is measured, ``unit``
a base unit (``seconds``, ``bytes``, ``ratio``) or the thing counted (``tokens``, ``blocks``,
``requests``, ...). Counters get ``_total`` appended by the client library. Milliseconds,
kilobytes and percentages are refused: Prometheus convention is base units, and dashboards divide.

``counter``/``gauge``/``histogram`` return the existing metric when called again with the same name
and shape, because several services may share one process (``pdserve up``) and one registry;
instances of a service tell themselves apart by labels (e.g. ``role="prefill"``), not by names.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY: CollectorRegistry = prometheus_client.REGISTRY
"""The process-wide registry (also holds the client library's process and GC metrics)."""

UNITS = frozenset(
    {
        "seconds", "bytes", "ratio", "bytes_per_second",
        "tokens", "blocks", "requests", "calls", "errors", "events", "decisions",
        "workers", "instances", "replicas", "gpus", "sequences", "tickets", "transfers",
        "layers", "experts", "messages", "info",
    }
)
"""Units a metric name may end in. Add to this set rather than working around it."""

_NON_BASE_UNITS = {
    "ms": "seconds", "milliseconds": "seconds", "us": "seconds", "microseconds": "seconds",
    "minutes": "seconds", "hours": "seconds", "kb": "bytes", "mb": "bytes", "gb": "bytes",
    "kib": "bytes", "mib": "bytes", "gib": "bytes", "percent": "ratio", "pct": "ratio",
}

_SEGMENT_RE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
)
"""Seconds, 1 ms to 2 min: covers time per output token (ms) up to time to first token of a
long prompt under load (tens of seconds)."""


def metric_name(area: str, noun: str, unit: str) -> str:
    """``pdserve_<area>_<noun>_<unit>``, validated; raises ValueError naming what is wrong.

    ``area`` is one word; ``noun`` may be several joined by underscores; ``unit`` is in ``UNITS``.
    """
    if not re.fullmatch(r"[a-z][a-z0-9]*", area):
        raise ValueError(f"metric area must be one lowercase word, got {area!r}")
    if not _SEGMENT_RE.fullmatch(noun):
        raise ValueError(f"metric noun must be lowercase snake_case, got {noun!r}")
    if unit in _NON_BASE_UNITS:
        raise ValueError(f"metric unit {unit!r} is not a base unit, use {_NON_BASE_UNITS[unit]!r}")
    if unit not in UNITS:
        raise ValueError(f"metric unit must be one of {sorted(UNITS)}, got {unit!r}")
    if noun.endswith("_total") or noun == "total":
        raise ValueError("metric noun must not end in 'total' (counters get '_total' added)")
    return f"pdserve_{area}_{noun}_{unit}"


M = TypeVar("M", Counter, Gauge, Histogram)
_created: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, tuple[Any, tuple[str, ...]]]] = (
    weakref.WeakKeyDictionary()
)
_created_lock = threading.Lock()


def _get_or_create(
    kind: type[M], name: str, documentation: str, labelnames: Sequence[str],
    registry: CollectorRegistry, **kwargs: Any,
) -> M:
    labels = tuple(labelnames)
    with _created_lock:
        by_name = _created.setdefault(registry, {})
        if name in by_name:
            metric, existing_labels = by_name[name]
            if type(metric) is not kind or existing_labels != labels:
                raise ValueError(
                    f"metric {name} exists as {type(metric).__name__}{list(existing_labels)}, "
                    f"not {kind.__name__}{list(labels)}"
                )
            return metric
        metric = kind(name, documentation, labelnames=labels, registry=registry, **kwargs)
        by_name[name] = (metric, labels)
        return metric


def counter(
    area: str, noun: str, unit: str, documentation: str, labelnames: Sequence[str] = (),
    *, registry: CollectorRegistry = REGISTRY,
) -> Counter:
    """A monotonically increasing count; exposed as ``<name>_total``."""
    return _get_or_create(
        Counter, metric_name(area, noun, unit), documentation, labelnames, registry
    )


def gauge(
    area: str, noun: str, unit: str, documentation: str, labelnames: Sequence[str] = (),
    *, registry: CollectorRegistry = REGISTRY,
) -> Gauge:
    """A value that goes up and down (queue depth, free blocks, pool size)."""
    return _get_or_create(Gauge, metric_name(area, noun, unit), documentation, labelnames, registry)


def histogram(
    area: str, noun: str, unit: str, documentation: str, labelnames: Sequence[str] = (),
    *, buckets: Sequence[float] = LATENCY_BUCKETS_S, registry: CollectorRegistry = REGISTRY,
) -> Histogram:
    """A distribution over fixed ``buckets`` (upper bounds in ``unit``; +Inf is added)."""
    return _get_or_create(
        Histogram, metric_name(area, noun, unit), documentation, labelnames, registry,
        buckets=tuple(buckets),
    )


@dataclass(slots=True)
class MetricsServer:
    """A running /metrics endpoint (a daemon thread). ``close()`` stops it and frees the port."""

    port: int
    _httpd: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


def start_metrics_server(
    port: int, host: str = "127.0.0.1", *, registry: CollectorRegistry = REGISTRY
) -> MetricsServer | None:
    """Serve ``registry`` in the Prometheus text format over HTTP on ``host:port``.

    ``port`` 0 binds any free port, -1 starts nothing and returns None. The bound port is
    ``result.port``; the process prints it. Returns a handle rather than only the port so a test,
    or ``pdserve up`` shutting down, can stop the server. Every path answers with the metrics
    (``/metrics`` by convention).
    """
    if port == -1:
        return None
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be -1 (off) or 0-65535, got {port}")
    httpd, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return MetricsServer(port=httpd.server_port, _httpd=httpd, _thread=thread)
