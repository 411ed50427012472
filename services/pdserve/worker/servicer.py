"""gRPC adapter of the worker agent: protos in, agent calls, protos out. No policy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2, worker_pb2_grpc
from pdserve.common.convert import token_from_pb, token_to_pb
from pdserve.common.errors import InvalidArgumentError
from pdserve.worker.agent import TransferTiming, WorkerAgent
from pdserve.worker.transports.values import KvDestinationSpec

SERVICE_NAME = "pdserve.api.v1.WorkerAgentService"


def stats_to_pb(timing: TransferTiming) -> pb.TransferStats:
    return pb.TransferStats(
        num_bytes=timing.num_bytes, num_blocks=timing.num_blocks, num_layers=timing.num_layers,
        prefill_compute_ms=timing.prefill_compute_s * 1000, transfer_ms=timing.transfer_s * 1000,
        exposed_ms=timing.exposed_s * 1000,
    )


class WorkerAgentServicer(worker_pb2_grpc.WorkerAgentServiceServicer):
    def __init__(self, agent: WorkerAgent, describe: callable) -> None:  # type: ignore[valid-type]
        self._agent = agent
        self._describe = describe

    async def AdmitTicket(self, request: worker_pb2.AdmitTicketRequest, context: grpc.aio.ServicerContext) -> worker_pb2.AdmitTicketResponse:
        token = token_from_pb(request.token)
        if request.transport and request.transport != self._agent.transport.name:
            raise InvalidArgumentError(
                f"transport: this worker receives over {self._agent.transport.name!r}",
                field="transport")
        destination = self._agent.admit(token, request.num_prompt_tokens, int(request.num_blocks))
        return worker_pb2.AdmitTicketResponse(destination=destination.to_proto())

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        token = token_from_pb(request.token)
        if not request.HasField("destination"):
            raise InvalidArgumentError("destination: required (rendezvous not used)",
                                       field="destination")
        destination = KvDestinationSpec.from_proto(request.destination)
        lease_s = request.lease_ms / 1000 if request.lease_ms else 10.0
        first_token, timing, num_cached = await self._agent.prefill(
            token, list(request.prompt_token_ids), destination, lease_s, request.request_id)
        return worker_pb2.PrefillResponse(first_token_id=first_token, stats=stats_to_pb(timing),
                                          num_cached_prompt_tokens=num_cached)

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeResponse]:
        token = token_from_pb(request.token)
        max_tokens = request.sampling.max_tokens
        num_sent = 0
        stream = self._agent.decode(
            token, list(request.prompt_token_ids), max_tokens,
            is_local_prefill=request.is_local_prefill, num_blocks=int(request.num_blocks),
            kv_wait_timeout_s=request.kv_wait_timeout_ms / 1000 if request.kv_wait_timeout_ms else None,
            request_id=request.request_id,
        )
        async for token_ids, timing in stream:
            num_sent += len(token_ids)
            message = worker_pb2.DecodeResponse(token_ids=token_ids)
            if timing is not None:
                message.stats.CopyFrom(stats_to_pb(timing))
            if num_sent >= max_tokens:
                message.finish_reason = pb.FINISH_REASON_LENGTH
            yield message

    async def DropTicket(self, request: worker_pb2.DropTicketRequest, context: grpc.aio.ServicerContext) -> worker_pb2.DropTicketResponse:
        token = token_from_pb(request.token)
        num_freed = self._agent.drop(token, request.reason)
        return worker_pb2.DropTicketResponse(is_found=num_freed > 0, num_blocks_freed=num_freed)

    async def ApplyExpertPlacement(self, request: worker_pb2.ApplyExpertPlacementRequest, context: grpc.aio.ServicerContext) -> worker_pb2.ApplyExpertPlacementResponse:
        if request.num_layers * request.num_slots != len(request.slot_to_expert):
            raise InvalidArgumentError(
                "slot_to_expert: length must be num_layers x num_slots", field="slot_to_expert")
        moved = self._agent.apply_expert_placement(
            request.version, request.num_layers, request.num_slots, list(request.slot_to_expert))
        return worker_pb2.ApplyExpertPlacementResponse(version=request.version, num_experts_moved=moved)

    async def GetPerformanceProfile(self, request: worker_pb2.GetPerformanceProfileRequest, context: grpc.aio.ServicerContext) -> worker_pb2.GetPerformanceProfileResponse:
        info = self._describe()
        return worker_pb2.GetPerformanceProfileResponse(
            points=[worker_pb2.ProfilePoint(num_tokens=n, batch_size=b, seconds=s, is_prefill=p)
                    for n, b, s, p in self._agent.profile],
            model=info.model, gpu=info.gpu, tp_size=info.tp_size,
        )

    async def BeginDrain(self, request: worker_pb2.BeginDrainRequest, context: grpc.aio.ServicerContext) -> worker_pb2.BeginDrainResponse:
        self._agent.begin_drain(request.reason)
        return worker_pb2.BeginDrainResponse(num_in_flight=self._agent.num_in_flight)

    async def GetStatus(self, request: worker_pb2.GetStatusRequest, context: grpc.aio.ServicerContext) -> worker_pb2.GetStatusResponse:
        agent = self._agent
        receiver = agent.receiver
        return worker_pb2.GetStatusResponse(
            worker=self._describe(),
            tickets=[worker_pb2.WorkerTicket(token=token_to_pb(t), num_blocks=n, phase=phase)
                     for t, n, phase in agent.tickets()],
            expert_placement_version=agent.expert_placement_version,
            num_used_blocks=agent.allocator.num_blocks - agent.allocator.num_free_blocks,
            num_total_blocks=agent.allocator.num_blocks,
            kv_checksums=[worker_pb2.KvChecksum(token=token_to_pb(c.token), crc32=c.crc32,
                                                num_blocks=c.num_blocks, num_layers=c.num_layers)
                          for c in agent.kv_checksums],
            num_refused_frames=receiver.num_rejections if receiver is not None else 0,
            num_late_writes_accepted=(receiver.tickets.num_late_writes_accepted
                                      if receiver is not None else 0),
        )
