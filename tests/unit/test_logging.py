"""JSON logs: one object per line, the fields promised, the trace id only inside a span."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from pdserve.common.logging import configure_logging
from pdserve.common.settings import LogFormat, LogLevel
from pdserve.common.telemetry import configure_tracing


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    old_level = root.level
    handler = configure_logging(LogLevel.DEBUG, LogFormat.JSON, "unit-test", stream=stream)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_has_the_promised_fields(log_stream: io.StringIO) -> None:
    logging.getLogger("pdserve.test").info("admitted %d requests", 3, extra={"num_requests": 3})
    (line,) = _lines(log_stream)
    assert line["message"] == "admitted 3 requests"
    assert line["level"] == "info"
    assert line["logger"] == "pdserve.test"
    assert line["service"] == "unit-test"
    assert line["num_requests"] == 3
    assert str(line["time"]).endswith("+00:00")
    assert "trace_id" not in line and "span_id" not in line


def test_trace_id_inside_a_span_and_not_outside(log_stream: io.StringIO) -> None:
    provider = configure_tracing("unit-test", "", 1.0, set_global=False)
    tracer = provider.get_tracer(__name__)
    log = logging.getLogger("pdserve.test")
    with tracer.start_as_current_span("work") as span:
        log.warning("inside")
        context = span.get_span_context()
    log.warning("outside")
    inside, outside = _lines(log_stream)
    assert inside["trace_id"] == format(context.trace_id, "032x")
    assert inside["span_id"] == format(context.span_id, "016x")
    assert "trace_id" not in outside


def test_exception_with_traceback_stays_on_one_line(log_stream: io.StringIO) -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logging.getLogger("pdserve.test").exception("failed")
    text = log_stream.getvalue()
    assert text.count("\n") == 1  # the traceback's newlines are escaped inside the JSON string
    (line,) = _lines(log_stream)
    assert "Traceback" in str(line["exception"])
    assert "ValueError: boom" in str(line["exception"])


def test_reconfiguring_replaces_only_its_own_handler(log_stream: io.StringIO) -> None:
    other = io.StringIO()
    handler = configure_logging("warning", "text", "svc", stream=other)
    try:
        ours = [h for h in logging.getLogger().handlers if type(h).__name__ == "_PdserveHandler"]
        assert ours == [handler]
        logging.getLogger("pdserve.test").info("dropped below the level")
        logging.getLogger("pdserve.test").warning("kept")
        assert log_stream.getvalue() == ""
        assert "WARNING" in other.getvalue() and "kept" in other.getvalue()
        assert "dropped" not in other.getvalue()
    finally:
        logging.getLogger().removeHandler(handler)
