"""Process-wide logging set-up: one JSON object per line, carrying the current trace id.

Code everywhere logs with ``logging.getLogger(__name__)`` and lazy ``%s`` arguments; only the
service's ``__main__`` calls ``configure_logging`` once. Each JSON line has ``time`` (UTC, ISO 8601
with milliseconds), ``level``, ``logger``, ``message``, ``service``, and ``trace_id``/``span_id``
(lowercase hex, 32 and 16 digits) when an OpenTelemetry span is current, so a log line can be found
from a trace and back. Fields passed with ``extra={...}`` are added as they are; an exception adds
``exception`` (the formatted traceback).

Never log prompt text or generated tokens: they are user data, and logs are kept longer and read by
more people than the requests were. Log counts, ids and lengths instead. Nothing here enforces it.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from opentelemetry import trace

from pdserve.common.settings import LogFormat, LogLevel

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)
_LEVEL_NAMES = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warning",
    logging.ERROR: "error",
    logging.CRITICAL: "critical",
}


def current_trace_ids() -> tuple[str, str] | None:
    """``(trace_id, span_id)`` of the current span as lowercase hex, or None outside a span.

    Unsampled spans that carry a valid context (a caller's trace id) still count: the ids then
    tie log lines of one request together even though the trace itself is not exported.
    """
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line (newlines inside values are escaped)."""

    def __init__(self, service_name: str) -> None:
        super().__init__()
        self._service_name = service_name

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": _LEVEL_NAMES.get(record.levelno, record.levelname.lower()),
            "logger": record.name,
            "message": record.getMessage(),
            "service": self._service_name,
        }
        ids = current_trace_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and key not in out:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Human-readable lines for a terminal; the trace id, when any, goes in brackets."""

    def __init__(self, service_name: str) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s%(trace)s: %(message)s")
        self._service_name = service_name

    def format(self, record: logging.LogRecord) -> str:
        ids = current_trace_ids()
        # A record attribute for ``%(trace)s``, set the way logging sets ``extra`` fields.
        record.__dict__["trace"] = f" [{ids[0]}]" if ids else ""
        try:
            return super().format(record)
        finally:
            del record.__dict__["trace"]


class _PdserveHandler(logging.StreamHandler[TextIO]):
    """Marks the handler ``configure_logging`` installed, so a second call replaces only it."""


def configure_logging(
    level: LogLevel | str,
    fmt: LogFormat | str,
    service_name: str,
    *,
    stream: TextIO | None = None,
) -> logging.Handler:
    """Send every log record of the process to ``stream`` (default stderr) in ``fmt``.

    Idempotent: a second call replaces the handler the first one installed and leaves other
    handlers (pytest's capture, for one) alone. Returns the installed handler.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _PdserveHandler):
            root.removeHandler(handler)
            handler.close()
    handler = _PdserveHandler(stream if stream is not None else sys.stderr)
    if LogFormat(fmt) is LogFormat.JSON:
        handler.setFormatter(JsonFormatter(service_name))
    else:
        handler.setFormatter(TextFormatter(service_name))
    root.addHandler(handler)
    root.setLevel(LogLevel(level).value.upper())
    return handler
