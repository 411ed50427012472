"""The parts of pdserve's vLLM connector that need no vLLM: the ticket as vLLM carries it,
settings, the scheduler side's decisions (pure), the rendezvous step (folder and real gRPC) and
the event channel."""

from __future__ import annotations

import asyncio
import enum
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.common.errors import InvalidArgumentError, NotFoundError
from pdserve.common.types import FencingToken
from pdserve.kv_transfer.rendezvous import MemoryRendezvous
from pdserve.worker.engine import KvLayout
from pdserve.worker.engines.vllm.events import (
    ConnectorEvent,
    EventKind,
    EventListener,
    EventSink,
)
from pdserve.worker.engines.vllm.exchange import (
    DirectoryDestinationExchange,
    GrpcDestinationExchange,
)
from pdserve.worker.engines.vllm.protocol import (
    ConnectorSettings,
    DestinationPlacement,
    RendezvousKind,
    TicketParams,
    TicketRole,
)
from pdserve.worker.engines.vllm.scheduler_side import SchedulerSide
from pdserve.worker.transports.values import KvDestinationSpec

BLOCK = 32
LAYOUT = KvLayout(num_layers=4, num_blocks=64, block_size_tokens=BLOCK, block_nbytes=16384)
SETTINGS = ConnectorSettings(rendezvous=RendezvousKind.DIRECTORY, rendezvous_dir="/unused")


def _destination(block_ids: tuple[int, ...] = (7, 3, 9)) -> KvDestinationSpec:
    return KvDestinationSpec(kv_address="127.0.0.1:5555", block_ids=block_ids, transport="tcp",
                             layout=LAYOUT, metadata=DestinationPlacement(1, 100).encode(),
                             decode_worker_id="d-1")


class _Status(enum.Enum):
    RUNNING = 1
    FINISHED_ABORTED = 2
    FINISHED_LENGTH_CAPPED = 3


def _request(req_id: str, num_prompt_tokens: int, ticket: TicketParams | None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, num_prompt_tokens=num_prompt_tokens, num_computed_tokens=0,
        kv_transfer_params=ticket.to_kv_transfer_params() if ticket else None,
        status=_Status.RUNNING)


# ---- the ticket, settings, placement ---------------------------------------------------------


def test_ticket_params_round_trip_through_kv_transfer_params() -> None:
    ticket = TicketParams(TicketRole.PREFILL, FencingToken("t-1", 3), 12.5, _destination())
    assert TicketParams.from_kv_transfer_params(ticket.to_kv_transfer_params()) == ticket
    assert TicketParams.from_kv_transfer_params(None) is None
    assert TicketParams.from_kv_transfer_params({"other_connector": {}}) is None


@pytest.mark.parametrize("entry", [{"role": "decode"}, {"role": "both", "ticket_id": "t",
                                    "attempt": 1, "timeout_s": 1}, "not an object"])
def test_malformed_ticket_params_are_invalid_argument(entry: object) -> None:
    with pytest.raises(InvalidArgumentError):
        TicketParams.from_kv_transfer_params({"pdserve": entry})


def test_ticket_params_refuse_bad_values() -> None:
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        TicketParams(TicketRole.DECODE, FencingToken("t"), 0.0)
    with pytest.raises(InvalidArgumentError, match="destination"):
        TicketParams(TicketRole.DECODE, FencingToken("t"), 1.0, _destination())


def test_connector_settings_round_trip_and_name_bad_keys() -> None:
    settings = ConnectorSettings(coordinator_address="127.0.0.1:50052", kv_port=7000)
    assert ConnectorSettings.from_extra_config(settings.to_extra_config()) == settings
    with pytest.raises(InvalidArgumentError, match="unknown keys \\['kv_prot'\\]"):
        ConnectorSettings.from_extra_config({"kv_prot": 1, "coordinator_address": "x:1"})
    with pytest.raises(InvalidArgumentError, match="coordinator_address"):
        ConnectorSettings.from_extra_config({})


def test_destination_placement_round_trip_and_refusal() -> None:
    placement = DestinationPlacement(first_block=2, num_prompt_tokens=77)
    assert DestinationPlacement.decode(placement.encode()) == placement
    with pytest.raises(InvalidArgumentError):
        DestinationPlacement.decode(b"")
    with pytest.raises(InvalidArgumentError):
        DestinationPlacement.decode(b'{"kind": "someone-else", "first_block": 0}')


# ---- scheduler side -----------------------------------------------------------------------


def test_decode_request_loads_every_token_past_the_local_hit_once() -> None:
    side = SchedulerSide(SETTINGS, BLOCK)
    token = FencingToken("t-d")
    request = _request("r1", 100, TicketParams(TicketRole.DECODE, token, 5.0))
    assert side.get_num_new_matched_tokens(request, 64) == (36, True)
    side.update_state_after_alloc(request, [10, 11, 12, 13], 36)
    meta = side.build_connector_meta({})
    (load,) = meta.loads
    assert (load.req_id, load.token, load.first_block) == ("r1", token, 2)
    assert load.dst_block_ids == (12, 13)  # blocks 0-1 are the shared local hit
    assert load.timeout_s == 5.0 and load.num_prompt_tokens == 100
    side.update_state_after_alloc(request, [10, 11, 12, 13], 0)  # after the load: no second
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)  # preempted: no reload
    assert not side.build_connector_meta({}).loads
    assert side.request_finished(request) == (False, None)  # vLLM holds a loading request


def test_load_of_a_request_aborted_before_the_worker_heard_still_reaches_it() -> None:
    side = SchedulerSide(SETTINGS, BLOCK)
    request = _request("r2", 40, TicketParams(TicketRole.DECODE, FencingToken("t"), 5.0))
    side.update_state_after_alloc(request, [5, 6], 40)
    request.status = _Status.FINISHED_ABORTED
    side.request_finished(request)
    assert [spec.req_id for spec in side.build_connector_meta({}).loads] == ["r2"]


def test_requests_without_a_ticket_or_below_the_minimum_are_left_alone() -> None:
    side = SchedulerSide(ConnectorSettings(rendezvous=RendezvousKind.DIRECTORY,
                                           rendezvous_dir="/x", min_load_tokens=8), BLOCK)
    assert side.get_num_new_matched_tokens(_request("plain", 50, None), 0) == (0, False)
    short = _request("short", 70, TicketParams(TicketRole.DECODE, FencingToken("t"), 1.0))
    assert side.get_num_new_matched_tokens(short, 64) == (0, False)
    bad = SimpleNamespace(request_id="bad", num_prompt_tokens=5, num_computed_tokens=0,
                          kv_transfer_params={"pdserve": {"role": "decode"}}, status=None)
    assert side.get_num_new_matched_tokens(bad, 0) == (0, False)


def test_prefill_request_sends_blocks_as_chunks_make_them_final() -> None:
    side = SchedulerSide(SETTINGS, BLOCK)
    token = FencingToken("t-p")
    request = _request("p1", 100, TicketParams(TicketRole.PREFILL, token, 5.0))
    blocks = [20, 21, 22, 23]
    side.block_ids_of = lambda req_id: blocks
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, blocks, 0)
    (first,) = side.build_connector_meta({"p1": 40}).sends  # tokens 0..39: one full block
    assert (first.num_ready_blocks, first.is_last, first.block_ids) == (1, False, (20,))
    request.num_computed_tokens = 40
    (second,) = side.build_connector_meta({"p1": 60}).sends  # the rest, partial block too
    assert (second.num_ready_blocks, second.is_last) == (4, True)
    assert second.block_ids == tuple(blocks) and second.token == token
    request.num_computed_tokens = 100
    assert not side.build_connector_meta({"p1": 1}).sends  # decode steps send nothing
    request.status = _Status.FINISHED_LENGTH_CAPPED
    assert side.request_finished(request) == (True, None)  # held until the send is reported
    assert not side.build_connector_meta({}).aborted_send_req_ids


def test_aborted_prefill_request_is_told_to_the_worker_side() -> None:
    side = SchedulerSide(SETTINGS, BLOCK)
    request = _request("p2", 10, TicketParams(TicketRole.PREFILL, FencingToken("t"), 5.0))
    side.block_ids_of = lambda req_id: [1]
    unannounced = _request("p3", 10, TicketParams(TicketRole.PREFILL, FencingToken("u"), 5.0))
    side.update_state_after_alloc(request, [1], 0)
    side.update_state_after_alloc(unannounced, [2], 0)
    side.build_connector_meta({"p2": 10})
    request.status = unannounced.status = _Status.FINISHED_ABORTED
    assert side.request_finished(request) == (True, None)
    assert side.request_finished(unannounced) == (False, None)  # the worker never saw it
    assert side.build_connector_meta({}).aborted_send_req_ids == ["p2"]


# ---- rendezvous ---------------------------------------------------------------------------


async def test_directory_exchange_publishes_and_times_out(tmp_path: Path) -> None:
    exchange = DirectoryDestinationExchange(tmp_path / "rdv")
    token = FencingToken("t-dir", 2)
    assert await exchange.wait(token, 0.05) is None
    waiter = asyncio.create_task(exchange.wait(token, 5.0))
    await asyncio.sleep(0.02)
    await exchange.publish(token, _destination())
    assert await waiter == _destination()
    assert await exchange.wait(FencingToken("t-dir", 3), 0.01) is None  # another attempt


class _Rendezvous(kv_transfer_pb2_grpc.KvTransferServiceServicer):
    """The coordinator's two rendezvous RPCs over its in-memory rendezvous (open tickets only)."""

    def __init__(self, open_ticket_ids: set[str]) -> None:
        self.rendezvous = MemoryRendezvous()
        self.open_ticket_ids = open_ticket_ids

    async def PublishDestination(self, request, context):  # type: ignore[no-untyped-def]
        if request.token.ticket_id not in self.open_ticket_ids:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no open ticket")
        token = FencingToken(request.token.ticket_id, request.token.attempt)
        await self.rendezvous.publish(token, request.destination.SerializeToString(), 30.0)
        return kv_transfer_pb2.PublishDestinationResponse()

    async def AwaitDestination(self, request, context):  # type: ignore[no-untyped-def]
        token = FencingToken(request.token.ticket_id, request.token.attempt)
        payload = await self.rendezvous.wait(token, request.timeout_ms / 1000)
        response = kv_transfer_pb2.AwaitDestinationResponse(is_ready=payload is not None)
        if payload is not None:
            response.destination.ParseFromString(payload)
        return response


async def test_grpc_exchange_through_the_coordinators_rpcs() -> None:
    server = grpc.aio.server()
    kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server(_Rendezvous({"open"}), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    exchange = GrpcDestinationExchange(f"127.0.0.1:{port}", rpc_timeout_s=2.0)
    try:
        token = FencingToken("open", 1)
        waiter = asyncio.create_task(exchange.wait(token, 5.0))
        await asyncio.sleep(0.05)
        await exchange.publish(token, _destination())
        assert await waiter == _destination()
        assert await exchange.wait(FencingToken("open", 2), 0.1) is None
        with pytest.raises(NotFoundError):
            await exchange.publish(FencingToken("closed", 1), _destination())
    finally:
        await exchange.close()
        await server.stop(None)


# ---- events -------------------------------------------------------------------------------


async def test_events_cross_a_unix_datagram_socket(tmp_path: Path) -> None:
    received: list[ConnectorEvent] = []
    listener = EventListener(str(tmp_path / "events.sock"), received.append)
    await listener.start()
    sink = EventSink(str(tmp_path / "events.sock"))
    event = ConnectorEvent(EventKind.RECEIVED, req_id="r", token="t#1", crc32=7,
                           block_crc32s=(1, 2, 3), num_blocks=3, num_layers=4)
    sink.emit(event)
    for _ in range(100):
        if received:
            break
        await asyncio.sleep(0.01)
    assert received == [event]
    listener.close()
    sink.emit(event)  # nobody listens: dropped and counted, never raised
    assert sink.num_dropped == 1
    sink.close()


async def test_a_burst_larger_than_the_kernels_datagram_queue_loses_no_event(
        tmp_path: Path) -> None:
    # Linux queues net.unix.max_dgram_qlen datagrams (10 by default) per listener; a burst of
    # handoffs emits more while the agent's loop is busy. The sender waits for room instead of
    # dropping (a lost SENT fails its handoff).
    received: list[ConnectorEvent] = []
    listener = EventListener(str(tmp_path / "events.sock"), received.append)
    await listener.start()
    sink = EventSink(str(tmp_path / "events.sock"))
    events = [ConnectorEvent(EventKind.SENT, token=f"t#{i}", layer_computed_s=(0.1, 0.2),
                             layer_sent_s=(0.15, 0.25), done_s=0.3, exposed_s=0.1)
              for i in range(60)]

    def burst() -> None:
        for event in events:
            sink.emit(event)

    emitting = asyncio.get_running_loop().run_in_executor(None, burst)
    time.sleep(0.3)  # the listener's loop is busy: the kernel's queue fills meanwhile
    await emitting
    for _ in range(200):
        if len(received) == len(events):
            break
        await asyncio.sleep(0.01)
    assert received == events and sink.num_dropped == 0
    listener.close()
    sink.close()
