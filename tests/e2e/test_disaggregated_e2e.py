"""The disaggregated serving path end to end: every service its own process, real gRPC between
them, hot state in Redis, durable records in Postgres, traces exported over OTLP.

Cluster: one KV-transfer coordinator, a prefill and a decode pool manager, two router replicas,
two prefill and two decode ``sim`` workers (started here, not provisioned, so the test controls
them). Tests run in file order on one cluster; the last one stops the routers.
"""

from __future__ import annotations

import asyncio
import collections
import random
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import (
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    pool_pb2,
    pool_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pdserve.common.grpc_client import error_from_rpc_error
from pdserve.common.types import TicketState, WorkerRole, WorkerState
from pdserve.db.repository import Repository

from .conftest import ServiceProcess, TraceCollector

pytestmark = pytest.mark.timeout(180)

MODEL = "llama-3.1-8b"
NUM_REQUESTS = 200
MAX_TOKENS = 16
LOCAL_PREFILL_THRESHOLD_TOKENS = 64
"""The router's default; prompts at or below it (uncached) prefill on the decode worker."""
PREFILL_SATURATION_TOKENS = 10**9
"""So high that a busy prefill pool never sends a long prompt to local prefill: the prompt
length alone decides, and the test can check each request's choice."""
MAX_NUM_BLOCKS = 8192
"""KV blocks per sim worker (16 tokens each). The 200-prompt mix below reserves about 7,000
blocks if every request were in flight at once, so even all of them on one decode worker fit and
no request can be refused for capacity."""
WORKER_ARGS = ["--speedup", "200", "--num-kv-layers", "4", "--max-num-blocks", str(MAX_NUM_BLOCKS)]
SETTLE_TIMEOUT_S = 20.0
"""Longest wait for best-effort background reports (ticket progress, releases, heartbeats)."""

T = TypeVar("T")


@dataclass(slots=True)
class Cluster:
    coordinator: ServiceProcess
    prefill_pool: ServiceProcess
    decode_pool: ServiceProcess
    routers: list[ServiceProcess]
    prefill_workers: list[ServiceProcess]
    decode_workers: list[ServiceProcess]
    collector: TraceCollector
    database_url: str
    env: dict[str, str]
    join_token: str
    served: list[Result] = field(default_factory=list)
    """Every request the routers finished, over all tests (the durable windows must count them)."""

    def worker_command(
        self, role: str, index: int, join_token: str, worker_id: str = ""
    ) -> list[str]:
        args = ["serve", "worker", "--role", role, "--pool-address",
                (self.prefill_pool if role == "prefill" else self.decode_pool).grpc_address,
                "--coordinator-address", self.coordinator.grpc_address,
                "--service-name", f"{role}-worker", *WORKER_ARGS]
        if worker_id:
            args += ["--worker-id", worker_id]
        return args


def _control_plane_env(redis_url: str, database_url: str, otel_endpoint: str) -> dict[str, str]:
    return {
        "PDSERVE_REDIS_URL": redis_url,
        "PDSERVE_DATABASE_URL": database_url,
        "PDSERVE_OTEL_ENDPOINT": otel_endpoint,
        "PDSERVE_OTEL_SAMPLING_RATIO": "1.0",
        "PDSERVE_LOG_FORMAT": "text",
        "PDSERVE_METRICS_PORT": "-1",
        # Export finished spans within 100 ms (the SDK's default batch delay is 5 s).
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


def _wait_until(probe: Callable[[], T], is_done: Callable[[T], bool], timeout_s: float) -> T:
    """Call ``probe`` until ``is_done`` holds or ``timeout_s`` passes; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if is_done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(0.2)


def _ready_counts(router: ServiceProcess) -> tuple[int, int]:
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        models = stub.ListModels(router_pb2.ListModelsRequest(), timeout=5).models
    card = next((m for m in models if m.name == MODEL), None)
    return (card.num_prefill_workers, card.num_decode_workers) if card else (0, 0)


@pytest.fixture(scope="module")
def cluster(e2e_redis_url: str, e2e_database_url: str, trace_collector: TraceCollector,
            processes: list[ServiceProcess]) -> Iterator[Cluster]:
    # ``processes`` comes last so that it is torn down first: the services stop while Redis,
    # Postgres and the trace collector they talk to are still there.
    join_token = secrets.token_hex(16)
    env = _control_plane_env(e2e_redis_url, e2e_database_url, trace_collector.endpoint)
    pool_env = {**env, "PDSERVE_JOIN_TOKEN": join_token}
    coordinator = ServiceProcess("kv-transfer", ["serve", "kv-transfer"], env)
    prefill_pool = ServiceProcess("prefill-pool", ["serve", "prefill-pool", "--deployments", MODEL],
                                  pool_env)
    decode_pool = ServiceProcess("decode-pool", ["serve", "decode-pool", "--deployments", MODEL],
                                 pool_env)
    for process in (coordinator, prefill_pool, decode_pool):
        processes.append(process.start())
    for process in (coordinator, prefill_pool, decode_pool):
        process.wait_ready()

    routers = [
        ServiceProcess(f"router-{i}", [
            "serve", "router", "--coordinator-address", coordinator.grpc_address,
            "--http-port", "-1", "--outcome-window-s", "1",
            "--local-prefill-threshold-tokens", str(LOCAL_PREFILL_THRESHOLD_TOKENS),
            "--prefill-saturation-tokens", str(PREFILL_SATURATION_TOKENS),
            # This test is about the disaggregated path: every one of its 200 requests must
            # complete. Shedding (tests/e2e/test_overload.py) would refuse some of the burst on
            # a loaded machine, where the routers learn slow prefill rates from their own timing.
            "--is-shedding-enabled", "false"], env)
        for i in range(2)
    ]
    built = Cluster(coordinator, prefill_pool, decode_pool, routers, [], [], trace_collector,
                    e2e_database_url, env, join_token)
    worker_env = {**env, "PDSERVE_JOIN_TOKEN": join_token}
    for role, workers in (("prefill", built.prefill_workers), ("decode", built.decode_workers)):
        for i in range(2):
            workers.append(ServiceProcess(f"{role}-worker-{i}",
                                          built.worker_command(role, i, join_token), worker_env))
    for process in (*routers, *built.prefill_workers, *built.decode_workers):
        processes.append(process.start())
    for process in (*routers, *built.prefill_workers, *built.decode_workers):
        process.wait_ready()
    for router in routers:
        counts = _wait_until(lambda r=router: _ready_counts(r), lambda c: c == (2, 2), 30.0)
        assert counts == (2, 2), (f"{router.name} sees {counts} ready prefill/decode workers, "
                                  f"expected (2, 2)\n{router.describe()}")
    yield built


# -- helpers ----------------------------------------------------------------------------------


def _prompt(rng: random.Random, num_tokens: int) -> str:
    """A prompt of exactly ``num_tokens`` byte-tokens (ASCII), unique enough not to share
    prefix blocks with other prompts."""
    alphabet = "abcdefghijklmnopqrstuvwxyz      "
    return "".join(rng.choice(alphabet) for _ in range(num_tokens))


def _prompt_lengths(rng: random.Random) -> list[int]:
    """40 short prompts (local prefill), 130 of 100-800 tokens and 30 of 1,000-3,000."""
    lengths = [rng.randint(8, LOCAL_PREFILL_THRESHOLD_TOKENS - 8) for _ in range(40)]
    lengths += [rng.randint(100, 800) for _ in range(130)]
    lengths += [rng.randint(1000, 3000) for _ in range(30)]
    rng.shuffle(lengths)
    return lengths


@dataclass(frozen=True, slots=True)
class Result:
    request_id: str
    router: str
    num_prompt_tokens: int
    num_tokens: int
    usage_completion_tokens: int
    finish_reason: int
    is_local_prefill: bool
    prefill_worker_id: str
    decode_worker_id: str


async def _generate(stub: router_pb2_grpc.RouterServiceStub, router: str, request_id: str,
                    prompt: str, *, prefill_mode: int = pb.PREFILL_MODE_UNSPECIFIED) -> Result:
    call = stub.Generate(router_pb2.GenerateRequest(
        request_id=request_id, model=MODEL, prompt=prompt, prefill_mode=prefill_mode,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS)), timeout=90)
    num_tokens = 0
    last = None
    async for chunk in call:
        num_tokens += len(chunk.token_ids)
        last = chunk
    assert last is not None, f"{request_id}: empty stream"
    return Result(request_id, router, len(prompt), num_tokens, last.usage.completion_tokens,
                  last.finish_reason, last.timing.is_local_prefill, last.prefill_worker_id,
                  last.decode_worker_id)


@dataclass(frozen=True, slots=True)
class Settled:
    """What the control plane and the workers report once the load is over."""

    tickets: list[kv_transfer_pb2.Ticket]
    ledger: list[kv_transfer_pb2.LedgerEntry]
    worker_tickets: dict[str, int]
    """Worker id -> tickets it still has work for (GetStatus)."""
    workers: list[pb.WorkerInfo]
    """From the pool managers (load as of the last heartbeat)."""

    def problems(self) -> list[str]:
        found = []
        unfinished = [t for t in self.tickets if t.state != pb.TICKET_STATE_DONE]
        if unfinished:
            found.append(f"{len(unfinished)} tickets not DONE, e.g. "
                         + "; ".join(f"{t.request_id} {pb.TicketState.Name(t.state)} {t.reason!r}"
                                     for t in unfinished[:5]))
        for entry in self.ledger:
            if (entry.num_reserved_blocks, entry.num_held_blocks) != (0, 0) or \
                    entry.num_free_blocks != entry.num_total_blocks:
                found.append(f"ledger of {entry.decode_worker_id}: {entry}")
        for worker_id, num in self.worker_tickets.items():
            if num:
                found.append(f"worker {worker_id} still has {num} tickets")
        for worker in self.workers:
            if worker.load.num_free_blocks != worker.load.num_total_blocks:
                found.append(f"worker {worker.worker_id} reports {worker.load.num_free_blocks}/"
                             f"{worker.load.num_total_blocks} blocks free")
        return found


async def _settled(cluster: Cluster) -> Settled:
    async with grpc.aio.insecure_channel(cluster.coordinator.grpc_address) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        tickets = (await stub.ListTickets(kv_transfer_pb2.ListTicketsRequest(limit=100_000),
                                          timeout=10)).tickets
        ledger = (await stub.GetLedger(kv_transfer_pb2.GetLedgerRequest(deployment=MODEL),
                                       timeout=10)).entries
    worker_tickets = {}
    for worker in (*cluster.prefill_workers, *cluster.decode_workers):
        async with grpc.aio.insecure_channel(worker.grpc_address) as channel:
            status = await worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=10)
        worker_tickets[worker.worker_id] = len(status.tickets)
    workers = [*await _list_workers(cluster.prefill_pool, pb.WORKER_ROLE_PREFILL),
               *await _list_workers(cluster.decode_pool, pb.WORKER_ROLE_DECODE)]
    return Settled(list(tickets), list(ledger), worker_tickets, workers)


async def _done_tickets(cluster: Cluster) -> list[kv_transfer_pb2.Ticket]:
    async with grpc.aio.insecure_channel(cluster.coordinator.grpc_address) as channel:
        return list((await kv_transfer_pb2_grpc.KvTransferServiceStub(channel).ListTickets(
            kv_transfer_pb2.ListTicketsRequest(state=pb.TICKET_STATE_DONE, limit=100_000),
            timeout=10)).tickets)


async def _list_workers(
    pool: ServiceProcess, role: int = pb.WORKER_ROLE_UNSPECIFIED
) -> list[pb.WorkerInfo]:
    """Workers of ``MODEL`` in the shared store, as ``pool`` lists them (unspecified role:
    both roles)."""
    async with grpc.aio.insecure_channel(pool.grpc_address) as channel:
        response = await pool_pb2_grpc.PoolServiceStub(channel).ListWorkers(
            pool_pb2.ListWorkersRequest(deployment=MODEL, role=role), timeout=10)
    return list(response.workers)


async def _wait_settled(cluster: Cluster) -> Settled:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        settled = await _settled(cluster)
        if not settled.problems() or time.monotonic() >= deadline:
            return settled
        await asyncio.sleep(0.25)


# -- tests ------------------------------------------------------------------------------------


async def test_concurrent_requests_over_both_routers_finish_and_free_every_block(
    cluster: Cluster,
) -> None:
    rng = random.Random(20240611)
    lengths = _prompt_lengths(rng)
    prompts = [_prompt(rng, n) for n in lengths]
    channels = [grpc.aio.insecure_channel(r.grpc_address) for r in cluster.routers]
    try:
        stubs = [router_pb2_grpc.RouterServiceStub(c) for c in channels]
        outcomes = await asyncio.gather(*(
            _generate(stubs[i % 2], cluster.routers[i % 2].name, f"load-{i}-{uuid.uuid4().hex[:8]}",
                      prompt)
            for i, prompt in enumerate(prompts)
        ), return_exceptions=True)
    finally:
        for channel in channels:
            await channel.close()

    failures = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
    assert not failures, (f"{len(failures)} of {NUM_REQUESTS} requests failed, e.g. "
                          f"{[(lengths[i], repr(e)) for i, e in failures[:5]]}\n"
                          + "\n".join(r.describe() for r in cluster.routers))
    results: list[Result] = [o for o in outcomes if isinstance(o, Result)]
    cluster.served.extend(results)
    assert len(results) == NUM_REQUESTS
    wrong = [r for r in results if (r.num_tokens, r.usage_completion_tokens, r.finish_reason)
             != (MAX_TOKENS, MAX_TOKENS, pb.FINISH_REASON_LENGTH)]
    assert not wrong, f"{len(wrong)} requests ended wrongly, e.g. {wrong[:3]}"
    local = [r for r in results if r.is_local_prefill]
    remote = [r for r in results if not r.is_local_prefill]
    assert local and remote, f"{len(local)} local and {len(remote)} remote prefills"
    misrouted = [r for r in results
                 if r.is_local_prefill != (r.num_prompt_tokens <= LOCAL_PREFILL_THRESHOLD_TOKENS)]
    assert not misrouted, f"local/remote prefill against the threshold: {misrouted[:3]}"
    assert all(r.prefill_worker_id == "" for r in local)
    prefill_ids = {w.worker_id for w in cluster.prefill_workers}
    decode_ids = {w.worker_id for w in cluster.decode_workers}
    assert {r.prefill_worker_id for r in remote} <= prefill_ids
    assert {r.decode_worker_id for r in results} <= decode_ids
    served_by = collections.Counter(r.router for r in results)
    assert served_by == {r.name: NUM_REQUESTS // 2 for r in cluster.routers}, served_by

    settled = await _wait_settled(cluster)
    assert not settled.problems(), "\n".join(
        [*settled.problems(), *(line for r in cluster.routers for line in r.lines
                                if "failed before the first token" in line)])
    request_ids_done = {t.request_id for t in settled.tickets if t.state == pb.TICKET_STATE_DONE}
    missing = {r.request_id for r in results} - request_ids_done
    assert not missing, f"{len(missing)} requests have no DONE ticket, e.g. {sorted(missing)[:3]}"
    assert {e.decode_worker_id for e in settled.ledger} == decode_ids
    assert {w.worker_id for w in settled.workers} == prefill_ids | decode_ids


async def test_one_request_is_traced_through_router_coordinator_prefill_and_decode(
    cluster: Cluster,
) -> None:
    request_id = f"traced-{uuid.uuid4().hex}"
    async with grpc.aio.insecure_channel(cluster.routers[0].grpc_address) as channel:
        result = await _generate(router_pb2_grpc.RouterServiceStub(channel), "router-0",
                                 request_id, _prompt(random.Random(7), 600),
                                 prefill_mode=pb.PREFILL_MODE_REMOTE)
    cluster.served.append(result)
    assert not result.is_local_prefill and result.prefill_worker_id

    expected_services = {"router", "kv-transfer", "prefill-worker", "decode-worker"}

    def trace_of_request() -> list:
        spans = cluster.collector.spans()
        roots = [s for s in spans if s.attributes.get("pdserve.request_id") == request_id
                 and s.name == "router.generate"]
        if not roots:
            return []
        return [s for s in spans if s.trace_id == roots[0].trace_id]

    spans = await asyncio.to_thread(
        _wait_until, trace_of_request,
        lambda found: expected_services <= {s.service_name for s in found}
        and {"prefill.compute_and_send", "kv.transfer", "decode.await_kv"}
        <= {s.name for s in found}, 15.0)
    by_service: dict[str, set[str]] = {}
    for span in spans:
        by_service.setdefault(span.service_name, set()).add(span.name)
    assert spans, (f"no router.generate span for {request_id} among "
                   f"{len(cluster.collector.spans())} collected spans")
    assert expected_services <= by_service.keys(), f"spans of the trace by service: {by_service}"
    assert "prefill.compute_and_send" in by_service["prefill-worker"], by_service
    # The KV hop has its own span, with what it moved.
    transfer = next(s for s in spans if s.name == "kv.transfer")
    assert transfer.attributes["pdserve.num_bytes"] > 0, transfer.attributes
    assert transfer.attributes["pdserve.num_layers"] > 0, transfer.attributes
    assert "decode.await_kv" in by_service["decode-worker"], by_service
    # The router reached the coordinator over gRPC: the coordinator's server span is in the trace.
    assert any("OpenTicket" in name for name in by_service["kv-transfer"]), by_service
    assert len({s.trace_id for s in spans}) == 1


@pytest.mark.parametrize(("change", "code", "field"), [
    ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ({"max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"model": "no-such-model"}, grpc.StatusCode.NOT_FOUND, "model"),
])
async def test_bad_requests_are_refused_with_a_status_naming_the_field(
        cluster: Cluster, change: dict[str, object], code: grpc.StatusCode, field: str) -> None:
    values: dict[str, object] = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, **change}
    request = router_pb2.GenerateRequest(
        model=values["model"], prompt=values["prompt"],
        sampling=pb.SamplingParams(max_tokens=values["max_tokens"]))
    for router in cluster.routers:
        async with grpc.aio.insecure_channel(router.grpc_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in router_pb2_grpc.RouterServiceStub(channel).Generate(
                    request, timeout=10
                ):
                    pass
        assert caught.value.code() == code, caught.value
        assert field in caught.value.details(), caught.value.details()
        assert error_from_rpc_error(caught.value).field == field


async def test_worker_with_a_wrong_join_token_is_refused(cluster: Cluster,
                                                         processes: list[ServiceProcess]) -> None:
    intruder_id = f"p-intruder-{uuid.uuid4().hex[:6]}"
    intruder = ServiceProcess(
        "intruder",
        cluster.worker_command("prefill", 9, "wrong", worker_id=intruder_id),
        {**cluster.env, "PDSERVE_JOIN_TOKEN": "wrong"},
    )
    processes.append(intruder.start())
    code = await asyncio.to_thread(intruder.wait_exit, 60.0)
    assert code != 0, intruder.describe()
    assert "join_token" in intruder.output, intruder.describe()
    assert not any(line.startswith("ready") for line in intruder.lines), intruder.describe()
    for pool in (cluster.prefill_pool, cluster.decode_pool):
        listed = {w.worker_id for w in await _list_workers(pool)}
        assert intruder_id not in listed
        assert listed == {w.worker_id for w in (*cluster.prefill_workers, *cluster.decode_workers)}


async def test_durable_records_of_the_run_are_in_postgres(cluster: Cluster) -> None:
    """Runs last: it stops the routers (gracefully) so that they flush their request windows."""
    rng = random.Random(99)
    modes = [pb.PREFILL_MODE_LOCAL, pb.PREFILL_MODE_REMOTE] * 2
    channels = [grpc.aio.insecure_channel(r.grpc_address) for r in cluster.routers]
    try:
        results = await asyncio.gather(*(
            _generate(router_pb2_grpc.RouterServiceStub(channels[i % 2]), f"router-{i % 2}",
                      f"durable-{i}-{uuid.uuid4().hex[:8]}", _prompt(rng, 300), prefill_mode=mode)
            for i, mode in enumerate(modes)))
    finally:
        for channel in channels:
            await channel.close()
    cluster.served.extend(results)
    remote = [r for r in cluster.served if not r.is_local_prefill]
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:  # the decode workers report DONE off the token path
        ticket_id_of = {t.request_id: t.token.ticket_id for t in await _done_tickets(cluster)}
        if all(r.request_id in ticket_id_of for r in remote) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert remote and all(r.request_id in ticket_id_of for r in remote)

    repository = Repository.from_url(cluster.database_url)
    try:
        workers = {
            w.worker_id: role
            for role, group in (
                (WorkerRole.PREFILL, cluster.prefill_workers),
                (WorkerRole.DECODE, cluster.decode_workers),
            )
            for w in group
        }
        events = await asyncio.to_thread(
            _wait_until, lambda: repository.list_worker_events(deployment=MODEL, limit=1000),
            lambda rows: workers.keys() <= {r.worker_id for r in rows
                                            if r.to_state is WorkerState.READY},
            SETTLE_TIMEOUT_S)
        ready = {e.worker_id: e.role for e in events if e.to_state is WorkerState.READY}
        assert workers.keys() <= ready.keys(), f"READY events only for {sorted(ready)}"
        assert all(ready[w] == role for w, role in workers.items()), ready

        # Every remote prefill of the whole module has its transfer statistics, written by the
        # coordinator when the decode worker reported DONE.
        def stats_by_ticket() -> dict[str, object]:
            return {t.ticket_id: t for t in repository.list_transfer_stats(MODEL, limit=10_000)}

        stats = await asyncio.to_thread(
            _wait_until, stats_by_ticket,
            lambda rows: all(ticket_id_of[r.request_id] in rows for r in remote), SETTLE_TIMEOUT_S)
        missing = [r.request_id for r in remote if ticket_id_of[r.request_id] not in stats]
        assert not missing, f"{len(missing)} of {len(remote)} remote prefills lack transfer stats"
        for result in remote:
            row = stats[ticket_id_of[result.request_id]]
            assert (row.prefill_worker_id, row.decode_worker_id, row.outcome) == (
                result.prefill_worker_id, result.decode_worker_id, TicketState.DONE), row
            assert row.num_bytes > 0 and row.num_blocks > 0 and row.transfer_s > 0, row

        for router in cluster.routers:
            code = await asyncio.to_thread(router.stop, 30.0)
            assert code == 0, router.describe()
        windows = await asyncio.to_thread(
            _wait_until, lambda: repository.list_request_windows(MODEL, limit=10_000),
            bool, SETTLE_TIMEOUT_S)
    finally:
        repository.close()
    assert windows, "no request_windows rows after the routers stopped"
    assert sum(w.num_errors for w in windows) == 0
    assert all(w.num_requests == w.num_ok > 0 for w in windows), windows
    counted = sum(w.num_ok for w in windows)
    # Each router replica records its own windows (keyed by replica): they add up to every
    # request the routers finished.
    assert counted == len(cluster.served)
