"""The checks of scripts/compose_smoke.sh against a running compose stack (run by that script in
the pdserve image, on the host's network, with the Docker socket): exit 0 only if all hold.

1. Both pools have a READY worker; 50 OpenAI completions through the router's published port all
   complete.
2. Prometheus reports every target up: each control-plane service and each worker container.
3. The OTLP receiver holds one trace with spans of the router, the coordinator, a prefill worker
   and a decode worker.
4. The decode pool's target raised through the governor (SetAutoscalerControls override): a new
   worker container appears and its worker becomes READY.
5. The target lowered again, under load: one decode worker drains, exactly its container is
   removed, the other stays, and no request fails.

Every wait has a deadline; a failure prints what was seen.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import random
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from pdserve.api.v1 import common_pb2, governor_pb2, governor_pb2_grpc, pool_pb2, pool_pb2_grpc

T = TypeVar("T")
DEPLOYMENT = "llama-3.1-8b"
CONTROL_PLANE_JOBS = {"router", "kv-transfer", "prefill-pool", "decode-pool", "governor"}
SPAN_SERVICES = {"router", "kv-transfer", "prefill-worker", "decode-worker"}
_WORDS = ("prefill", "decode", "cache", "block", "layer", "token", "tensor", "ticket", "lease",
          "worker", "router", "pool", "memory", "bandwidth", "latency", "batch", "expert")


def log(message: str) -> None:
    print(f"[smoke {time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float,
             interval_s: float = 1.0) -> T:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            result = probe()
        except Exception as exc:  # noqa: BLE001 - keep waiting, report the last error
            result, last = None, exc
        if result:
            return result
        time.sleep(interval_s)
    raise SystemExit(f"FAILED: {what} within {timeout_s:.0f} s (last error: {last!r})")


# -- Docker engine (its HTTP API over the socket) -----------------------------------------------

class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self._path)


def worker_containers(scope: str, role: str) -> dict[str, str]:
    """Worker id -> container state of this stack's worker containers of ``role``."""
    filters = json.dumps({"label": [f"io.pdserve.scope={scope}", f"io.pdserve.role={role}"]})
    connection = _UnixConnection("/var/run/docker.sock")
    connection.request("GET", "/containers/json?all=1&filters=" + urllib.request.quote(filters))
    containers = json.loads(connection.getresponse().read())
    connection.close()
    return {c["Labels"]["io.pdserve.worker-id"]: c["State"] for c in containers}


# -- the stack's APIs ---------------------------------------------------------------------------

class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.http = f"http://127.0.0.1:{args.http_port}"
        self.pools = {
            "prefill": pool_pb2_grpc.PoolServiceStub(
                grpc.insecure_channel(f"127.0.0.1:{args.prefill_pool_port}")),
            "decode": pool_pb2_grpc.PoolServiceStub(
                grpc.insecure_channel(f"127.0.0.1:{args.decode_pool_port}")),
        }
        self.governor = governor_pb2_grpc.CapacityGovernorServiceStub(
            grpc.insecure_channel(f"127.0.0.1:{args.governor_port}"))
        self.admin = (("authorization", f"Bearer {args.admin_key}"),)

    def workers(self, role: str) -> dict[str, str]:
        """Worker id -> state name."""
        role_pb = common_pb2.WorkerRole.Value(f"WORKER_ROLE_{role.upper()}")
        response = self.pools[role].ListWorkers(
            pool_pb2.ListWorkersRequest(deployment=DEPLOYMENT, role=role_pb), timeout=5,
            metadata=self.admin)
        return {w.worker_id: common_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_")
                for w in response.workers}

    def ready(self, role: str) -> list[str]:
        return sorted(w for w, s in self.workers(role).items() if s == "READY")

    def complete(self, index: int) -> str:
        """One completion of a prompt long enough (and unlike any other, so never cached) to be
        prefilled on a prefill worker, its KV cache moved to a decode worker."""
        words = random.Random(index).choices(_WORDS, k=80)
        body = json.dumps({"model": DEPLOYMENT, "prompt": f"{index}: {' '.join(words)}",
                           "max_tokens": 12}).encode()
        request = urllib.request.Request(
            f"{self.http}/v1/completions", data=body, method="POST",
            headers={"content-type": "application/json",
                     "authorization": f"Bearer {self.args.api_key}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            payload = json.loads(response.read())
        text = payload["choices"][0]["text"]
        assert payload["usage"]["completion_tokens"] > 0, payload
        return str(text)

    def override(self, num_prefill: int, num_decode: int) -> None:
        self.governor.SetAutoscalerControls(governor_pb2.SetAutoscalerControlsRequest(
            deployment=DEPLOYMENT, override_prefill_instances=num_prefill,
            override_decode_instances=num_decode, override_expires_in_s=1800),
            timeout=10, metadata=self.admin)

    def get_json(self, url: str) -> Any:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())


# -- the checks ---------------------------------------------------------------------------------

def check_requests(stack: Stack) -> None:
    for role in ("prefill", "decode"):
        wait_for(f"a READY {role} worker", lambda r=role: stack.ready(r), 180)
    wait_for("the router serving", lambda: stack.complete(-1), 120, 2.0)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(stack.complete, i) for i in range(50)]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise SystemExit(f"FAILED: {len(errors)} of 50 requests failed, e.g. {errors[0]!r}")
    log(f"50 OpenAI completions through the published port: all complete "
        f"({time.monotonic() - started:.1f} s)")


def check_prometheus(stack: Stack) -> None:
    url = f"http://127.0.0.1:{stack.args.prometheus_port}/api/v1/targets?state=active"

    def all_up() -> list[dict[str, Any]] | None:
        targets = stack.get_json(url)["data"]["activeTargets"]
        jobs = {t["labels"]["job"] for t in targets}
        workers = [t for t in targets if t["labels"]["job"] == "workers"]
        if CONTROL_PLANE_JOBS <= jobs and len(workers) >= 2 and all(
                t["health"] == "up" for t in targets):
            return targets
        log("prometheus targets: " + ", ".join(
            f"{t['labels']['job']}/{t['labels'].get('worker', t['labels']['instance'])}="
            f"{t['health']}" for t in targets))
        return None

    targets = wait_for("every Prometheus target up", all_up, 90, 3.0)
    log(f"Prometheus: {len(targets)} targets up "
        f"({', '.join(sorted({t['labels']['job'] for t in targets}))})")


def check_traces(stack: Stack) -> None:
    url = f"http://127.0.0.1:{stack.args.recorder_port}/spans"

    def full_trace() -> tuple[str, set[str]] | None:
        services_by_trace: dict[str, set[str]] = {}
        for span in stack.get_json(url)["spans"]:
            services_by_trace.setdefault(span["trace_id"], set()).add(span["service"])
        for trace_id, services in services_by_trace.items():
            if SPAN_SERVICES <= services:
                return trace_id, services
        seen = set().union(*services_by_trace.values()) if services_by_trace else set()
        log(f"traces: {len(services_by_trace)}, services seen {sorted(seen)}")
        return None

    trace_id, services = wait_for("a trace through router, coordinator, prefill and decode",
                                  full_trace, 60, 3.0)
    log(f"trace {trace_id}: spans of {sorted(services)}")


class Load:
    """Requests one after another on a few threads until stopped; counts failures."""

    def __init__(self, stack: Stack, num_threads: int = 3) -> None:
        self.stack, self.num_ok, self.errors = stack, 0, []  # type: list[BaseException]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(num_threads)]

    def _run(self, offset: int) -> None:
        index = 1000 + offset
        while not self._stop.is_set():
            try:
                self.stack.complete(index)
                with self._lock:
                    self.num_ok += 1
            except Exception as exc:  # noqa: BLE001 - counted, reported at the end
                with self._lock:
                    self.errors.append(exc)
            index += 100

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)


def check_scaling(stack: Stack) -> None:
    scope = stack.args.scope
    before = worker_containers(scope, "decode")
    ready_before = stack.ready("decode")
    log(f"decode workers READY {ready_before}, containers {before}")
    stack.override(1, len(ready_before) + 1)

    def new_ready() -> str | None:
        new = set(stack.ready("decode")) - set(ready_before)
        containers = worker_containers(scope, "decode")
        return next((w for w in new if containers.get(w) == "running"), None)

    added = wait_for("a new decode worker container READY", new_ready, 180, 2.0)
    log(f"scaled up: new decode worker container {added} READY")
    with Load(stack) as load:
        time.sleep(3)
        everyone = set(stack.ready("decode"))
        stack.override(1, len(everyone) - 1)
        drained: dict[str, str] = {}

        def one_drained_and_removed() -> bool:
            states = stack.workers("decode")
            for worker, state in states.items():
                if state in ("DRAINING", "DRAINED"):
                    drained.setdefault("id", worker)
            victim = drained.get("id")
            containers = worker_containers(scope, "decode")
            return bool(victim and victim not in containers and victim not in states
                        and everyone - {victim} <= set(containers))

        wait_for("the drained decode worker's container removed", one_drained_and_removed,
                 180, 1.0)
        time.sleep(2)
    victim = drained["id"]
    remaining = worker_containers(scope, "decode")
    if load.errors:
        raise SystemExit(f"FAILED: {len(load.errors)} requests failed during scale-down, e.g. "
                         f"{load.errors[0]!r}")
    if load.num_ok == 0:
        raise SystemExit("FAILED: no request completed during scale-down")
    log(f"scaled down: {victim} drained and its container removed; remaining "
        f"{sorted(remaining)}; {load.num_ok} requests during it, none failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("http-port", "prefill-pool-port", "decode-pool-port", "governor-port",
                 "prometheus-port", "recorder-port"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--admin-key", required=True)
    parser.add_argument("--scope", required=True, help="the stack's worker container scope")
    args = parser.parse_args()
    stack = Stack(args)
    check_requests(stack)
    check_prometheus(stack)
    check_traces(stack)
    check_scaling(stack)
    log("all checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as exc:
        sys.exit(f"FAILED: {exc}")
