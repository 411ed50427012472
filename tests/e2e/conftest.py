"""End-to-end test plumbing: service processes, a private Redis database and Postgres database per
module, and an in-test OTLP trace collector.

``ServiceProcess`` runs ``python -m pdserve ...`` with a clean environment (none of the caller's
``PDSERVE_*``/``OTEL_*`` variables leak in) plus the variables a test gives, captures its merged
stdout/stderr line by line, and reads the addresses the process announces (``<service> grpc
host:port``, ``<service> http URL``, ``worker <id> grpc host:port kv host:port``). Every wait has a
deadline, and a failed wait puts the captured output in the assertion message.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
import sqlalchemy as sa
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

READY_TIMEOUT_S = 60.0
"""Generous: on a loaded 2-core machine nine Python processes importing grpc, OpenTelemetry and
SQLAlchemy at once take a while."""
STOP_TIMEOUT_S = 10.0
E2E_REDIS_DB = 13
"""Logical Redis database the e2e tests own (flushed before and after); other tests use db 0
with key prefixes. The services have no key-prefix setting, so a database is the isolation."""

_GRPC_LINE = re.compile(r"(?:(?P<service>[\w-]+) )?grpc (?P<address>\S+:\d+)")
_HTTP_LINE = re.compile(r"(?:(?P<service>[\w-]+) )?http (?P<url>https?://\S+)")
_WORKER_LINE = re.compile(r"worker (?P<worker_id>\S+) grpc (?P<address>\S+:\d+) kv (?P<kv>\S*)")
_LEAKED_ENV_PREFIXES = ("PDSERVE_", "OTEL_")
_NOTEWORTHY = re.compile(r"WARNING|ERROR|CRITICAL|Traceback")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without pdserve/OpenTelemetry settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LEAKED_ENV_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class ServiceProcess:
    """One ``python -m pdserve <args>`` child process and what it printed."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = list(args)
        self.env = clean_env(env)
        self.lines: list[str] = []
        self.grpc_address = ""
        self.http_url = ""
        self.worker_id = ""
        self.kv_address = ""
        self._process: subprocess.Popen[str] | None = None
        self._cond = threading.Condition()
        self.orphans: set[int] = set()
        self._reader: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> ServiceProcess:
        assert self._process is None, f"{self.name} already started"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *self.args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self.env, text=True, bufsize=1, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"out-{self.name}", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.rstrip("\n")
            with self._cond:
                self.lines.append(line)
                self._parse(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _parse(self, line: str) -> None:
        if match := _WORKER_LINE.fullmatch(line):
            self.worker_id = match["worker_id"]
            self.grpc_address = match["address"]
            self.kv_address = match["kv"]
        elif match := _GRPC_LINE.fullmatch(line):
            self.grpc_address = match["address"]
        elif match := _HTTP_LINE.fullmatch(line):
            self.http_url = match["url"]

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def describe(self) -> str:
        """The command and everything it printed (for assertion messages)."""
        tail = self.lines[-200:]
        return (f"--- {self.name} (pid {self._process.pid if self._process else '-'}, "
                f"exit {self.returncode}): pdserve {' '.join(self.args)}\n" + "\n".join(tail))

    # -- waiting ------------------------------------------------------------------------------

    def wait_for_line(self, predicate: Callable[[str], bool], timeout_s: float, what: str) -> str:
        """The first printed line (old or new) for which ``predicate`` holds. Fails with the
        captured output if the deadline passes or the process exits first."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(self.lines)
                if self.returncode is not None and not (self._reader and self._reader.is_alive()):
                    pytest.fail(f"{self.name} exited ({self.returncode}) before {what}\n"
                                f"{self.describe()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pytest.fail(
                        f"{self.name}: no {what} within {timeout_s:.0f}s\n{self.describe()}"
                    )
                self._cond.wait(min(remaining, 0.2))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> ServiceProcess:
        self.wait_for_line(lambda line: line.startswith("ready"), timeout_s, "'ready' line")
        return self

    def wait_exit(self, timeout_s: float) -> int:
        assert self._process is not None
        try:
            code = self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {timeout_s:.0f}s\n{self.describe()}")
        if self._reader is not None:
            self._reader.join(5.0)
        return code

    def descendants(self) -> set[int]:
        """Pids of the processes this one started (and theirs), e.g. the workers ``pdserve up``
        provisions in sessions of their own. Linux (/proc)."""
        return _descendants(self._process.pid) if self._process is not None else set()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL (of its process group and every process it started) after
        ``timeout_s``. Returns the exit code, or None if it had to be killed. Children that
        outlive a graceful exit are killed too and left in ``orphans`` (a test may assert on it).
        """
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            children = self.descendants()
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._kill(children)
                process.wait(5.0)
                return None
            self.orphans = {pid for pid in children if _is_alive(pid)}
            self._kill(self.orphans)
        if self._reader is not None:
            self._reader.join(5.0)
        return process.returncode

    def _kill(self, pids: set[int]) -> None:
        assert self._process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _is_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def run_cli(args: list[str], env: dict[str, str] | None = None,
            timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``python -m pdserve <args>`` to completion, output captured."""
    return subprocess.run([sys.executable, "-m", "pdserve", *args], env=clean_env(env),
                          capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def processes() -> Iterator[list[ServiceProcess]]:
    """Register processes here (``processes.append(p.start())``); all are stopped at teardown,
    newest first, so workers leave before their pools and coordinator."""
    started: list[ServiceProcess] = []
    yield started
    for process in reversed(started):
        process.stop()
    log_dir = os.environ.get("PDSERVE_TEST_LOG_DIR")
    if log_dir:  # every line of every process, for a failure the summary below cannot explain
        folder = Path(log_dir) / uuid.uuid4().hex[:8]
        folder.mkdir(parents=True, exist_ok=True)
        seen: dict[str, int] = {}
        for process in started:  # a restarted process has its predecessor's name: .2, .3, ...
            seen[process.name] = seen.get(process.name, 0) + 1
            suffix = f".{seen[process.name]}" if seen[process.name] > 1 else ""
            (folder / f"{process.name}{suffix}.log").write_text("\n".join(process.lines) + "\n")
    for process in started:  # shown by pytest with a failure, or with -s
        noteworthy = [line for line in process.lines if _NOTEWORTHY.search(line)]
        if noteworthy:
            print(f"--- {process.name}: {len(noteworthy)} warnings/errors", *noteworthy[:20],
                  sep="\n")


# -- trace collector --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CollectedSpan:
    service_name: str
    trace_id: str
    """Hex, 32 characters."""
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict[str, object] = field(hash=False)


def _any_value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: TraceCollector) -> None:
        self._collector = collector

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _any_value(a.value) for a in resource_spans.resource.attributes}
            service_name = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(CollectedSpan(
                        service_name=service_name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                        name=span.name, kind=span.kind,
                        attributes={a.key: _any_value(a.value) for a in span.attributes},
                    ))
        self._collector.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class TraceCollector:
    """An OTLP/gRPC trace endpoint (``TraceService.Export``) on a grpc.aio server that runs on its
    own event loop in a thread, so it lives independently of the tests' loops."""

    def __init__(self) -> None:
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="otlp-collector",
                                        daemon=True)
        self._server: grpc.aio.Server | None = None
        self.endpoint = ""

    def add(self, spans: list[CollectedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def start(self) -> TraceCollector:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10.0)
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceServicer(self),
                                                                  self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0.5), self._loop).result(10.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()


@pytest.fixture(scope="module")
def trace_collector() -> Iterator[TraceCollector]:
    collector = TraceCollector().start()
    yield collector
    collector.stop()


# -- private Redis database and Postgres database ---------------------------------------------


@pytest.fixture(scope="module")
def e2e_redis_url(redis_url: str) -> Iterator[str]:
    """``redis_url`` switched to a logical database this module owns, flushed before and after
    (only that database). The database is leased through a lock key in ``redis_url``'s own
    database, so test runs that share one Redis (several developers, or CI beside a session)
    never share a database."""
    base = urllib.parse.urlsplit(redis_url)
    lock_client = redis.Redis.from_url(redis_url)
    owner = uuid.uuid4().hex
    chosen = None
    for db in range(E2E_REDIS_DB, E2E_REDIS_DB - 12, -1):  # 13, 12, ... 2
        if lock_client.set(f"pdserve-e2e:db-lease:{db}", owner, nx=True, ex=1800):
            chosen = db
            break
    if chosen is None:
        lock_client.close()
        pytest.fail("no free logical Redis database for e2e tests (all leased)")
    url = base._replace(path=f"/{chosen}").geturl()
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()
        if lock_client.get(f"pdserve-e2e:db-lease:{chosen}") == owner.encode():
            lock_client.delete(f"pdserve-e2e:db-lease:{chosen}")
        lock_client.close()


@pytest.fixture(scope="module")
def e2e_database_url(database_url: str) -> Iterator[str]:
    """A fresh Postgres database on ``database_url``'s server (dropped afterwards), with the
    schema applied by ``pdserve db upgrade``."""
    server_url = sa.make_url(database_url)
    name = f"pdserve_e2e_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = server_url.set(database=name).render_as_string(hide_password=False)
    try:
        result = run_cli(["db", "upgrade", "--database-url", url])
        assert result.returncode == 0, f"pdserve db upgrade failed:\n{result.stdout}{result.stderr}"
        yield url
    finally:
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
