"""gRPC adapter of the worker agent: protos in, agent calls, protos out. No policy.

A worker serves one role: each RPC goes to the agent's method of that name, and the agent of the
other role answers it with ``INVALID_ARGUMENT`` (``WorkerAgent`` refuses the other role's calls).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2, worker_pb2_grpc
from pdserve.common.convert import token_from_pb, token_to_pb
from pdserve.common.errors import InvalidArgumentError
from pdserve.worker.agent import WorkerAgent
from pdserve.worker.runtime import Sampling
from pdserve.worker.transports.values import KvDestinationSpec

SERVICE_NAME = "pdserve.api.v1.WorkerAgentService"

Context = grpc.aio.ServicerContext


def sampling_from_pb(message: pb.SamplingParams) -> Sampling:
    return Sampling(temperature=message.temperature, top_p=message.top_p or 1.0,
                    seed=message.seed, stop=tuple(message.stop), ignore_eos=message.ignore_eos)


class WorkerAgentServicer(worker_pb2_grpc.WorkerAgentServiceServicer):
    def __init__(self, agent: WorkerAgent, describe: Callable[[], pb.WorkerInfo]) -> None:
        self._agent = agent
        self._describe = describe

    async def AdmitTicket(self, request: worker_pb2.AdmitTicketRequest,
                          context: Context) -> worker_pb2.AdmitTicketResponse:
        destination = self._admit(request.token, request.transport, request.num_prompt_tokens,
                                  request.num_blocks)
        if destination is None:  # the engine publishes it through the coordinator's rendezvous
            return worker_pb2.AdmitTicketResponse()
        return worker_pb2.AdmitTicketResponse(destination=destination)

    def _admit(self, token: pb.FencingToken, transport: str, num_prompt_tokens: int,
               num_blocks: int) -> pb.KvDestination | None:
        if transport and transport != self._agent.transport.name:
            raise InvalidArgumentError(
                f"transport: this worker receives over {self._agent.transport.name!r}",
                field="transport")
        destination = self._agent.admit(token_from_pb(token), num_prompt_tokens, int(num_blocks))
        return destination.to_proto() if destination is not None else None

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: Context) -> worker_pb2.PrefillResponse:
        token = token_from_pb(request.token)
        # No destination (or an empty one, as an AdmitTicket answer without one is relayed):
        # the decode engine publishes it at the coordinator's rendezvous.
        destination = (KvDestinationSpec.from_proto(request.destination)
                       if request.HasField("destination") and request.destination.kv_address
                       else None)
        lease_s = request.lease_ms / 1000 if request.lease_ms else 10.0
        result = await self._agent.prefill(
            token, list(request.prompt_token_ids), destination, lease_s, request.request_id)
        return worker_pb2.PrefillResponse(first_token_id=result.first_token_id,
                                          stats=result.timing.to_proto(),
                                          num_cached_prompt_tokens=result.num_cached_prompt_tokens)

    async def Decode(self, request: worker_pb2.DecodeRequest,
                     context: Context) -> AsyncIterator[worker_pb2.DecodeResponse]:
        if request.admit:
            if request.is_local_prefill:
                raise InvalidArgumentError(
                    "admit: a local prefill allocates its own blocks (no admission)",
                    field="admit")
            destination = self._admit(request.token, request.transport,
                                      len(request.prompt_token_ids), request.num_blocks)
            yield worker_pb2.DecodeResponse(is_admitted=True, destination=destination)
        token = token_from_pb(request.token)
        max_tokens = request.sampling.max_tokens
        num_sent = 0
        stream = self._agent.decode(
            token, list(request.prompt_token_ids), max_tokens,
            is_local_prefill=request.is_local_prefill, num_blocks=int(request.num_blocks),
            kv_wait_timeout_s=(request.kv_wait_timeout_ms / 1000 if request.kv_wait_timeout_ms
                               else None),
            request_id=request.request_id, sampling=sampling_from_pb(request.sampling),
        )
        async for token_ids, timing in stream:
            num_sent += len(token_ids)
            message = worker_pb2.DecodeResponse(token_ids=token_ids)
            if timing is not None:
                message.stats.CopyFrom(timing.to_proto())
            if num_sent >= max_tokens:
                message.finish_reason = pb.FINISH_REASON_LENGTH
            yield message
        if num_sent < max_tokens:  # the engine ended the sequence (end of sequence, a stop)
            yield worker_pb2.DecodeResponse(finish_reason=pb.FINISH_REASON_STOP)

    async def DropTicket(self, request: worker_pb2.DropTicketRequest,
                         context: Context) -> worker_pb2.DropTicketResponse:
        token = token_from_pb(request.token)
        num_freed = self._agent.drop(token, request.reason)
        return worker_pb2.DropTicketResponse(is_found=num_freed > 0, num_blocks_freed=num_freed)

    async def ApplyExpertPlacement(
            self, request: worker_pb2.ApplyExpertPlacementRequest,
            context: Context) -> worker_pb2.ApplyExpertPlacementResponse:
        if request.num_layers * request.num_slots != len(request.slot_to_expert):
            raise InvalidArgumentError(
                "slot_to_expert: length must be num_layers x num_slots", field="slot_to_expert")
        moved = self._agent.apply_expert_placement(
            request.version, request.num_layers, request.num_slots, list(request.slot_to_expert))
        return worker_pb2.ApplyExpertPlacementResponse(version=request.version,
                                                       num_experts_moved=moved)

    async def GetPerformanceProfile(
            self, request: worker_pb2.GetPerformanceProfileRequest,
            context: Context) -> worker_pb2.GetPerformanceProfileResponse:
        info = self._describe()
        return worker_pb2.GetPerformanceProfileResponse(
            points=[worker_pb2.ProfilePoint(num_tokens=point.num_tokens,
                                            batch_size=point.batch_size, seconds=point.seconds,
                                            is_prefill=point.is_prefill)
                    for point in self._agent.profile],
            model=info.model, gpu=info.gpu, tp_size=info.tp_size,
        )

    async def BeginDrain(self, request: worker_pb2.BeginDrainRequest,
                         context: Context) -> worker_pb2.BeginDrainResponse:
        self._agent.begin_drain(request.reason)
        return worker_pb2.BeginDrainResponse(num_in_flight=self._agent.num_in_flight)

    async def GetStatus(self, request: worker_pb2.GetStatusRequest,
                        context: Context) -> worker_pb2.GetStatusResponse:
        agent = self._agent
        load = agent.load()
        receiver = agent.receiver
        return worker_pb2.GetStatusResponse(
            worker=self._describe(),
            tickets=[worker_pb2.WorkerTicket(token=token_to_pb(t), num_blocks=n, phase=phase)
                     for t, n, phase in agent.tickets()],
            expert_placement_version=agent.expert_placement_version,
            num_used_blocks=load.num_total_blocks - load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            kv_checksums=[worker_pb2.KvChecksum(token=token_to_pb(c.token), crc32=c.crc32,
                                                num_blocks=c.num_blocks, num_layers=c.num_layers,
                                                block_crc32s=c.block_crc32s,
                                                kv_frame_version=c.frame_version)
                          for c in agent.kv_checksums],
            num_refused_frames=agent.num_refused_frames,
            prompt_tokens_by_source=agent.prompt_tokens_by_source(),
            num_late_writes_accepted=(receiver.tickets.num_late_writes_accepted
                                      if receiver is not None else 0),
        )
