"""gRPC adapter of a pool manager: protos in, core calls, protos out. No policy."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import pool_pb2, pool_pb2_grpc
from pdserve.common.auth import Role, check_worker_id, count_refusal, current_principal
from pdserve.common.convert import (
    load_from_pb,
    role_from_pb,
    token_to_pb,
    worker_state_from_pb,
    worker_state_to_pb,
    worker_to_pb,
)
from pdserve.common.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from pdserve.common.tokenizer_bundle import TokenizerBundle, bundle_from_pb
from pdserve.common.types import FencingToken, PoolEventKind, WorkerRecord, WorkerRole, WorkerState
from pdserve.pool.manager import Heartbeat, PoolManager, Registration
from pdserve.state.interfaces import PoolEventStream, WorkerStore

SERVICE_NAME = "pdserve.api.v1.PoolService"
_REGISTER = f"/{SERVICE_NAME}/Register"
_HEARTBEAT = f"/{SERVICE_NAME}/Heartbeat"
_DEREGISTER = f"/{SERVICE_NAME}/Deregister"

_KIND_TO_PB = {
    PoolEventKind.UPSERTED: pool_pb2.POOL_EVENT_KIND_UPSERTED,
    PoolEventKind.REMOVED: pool_pb2.POOL_EVENT_KIND_REMOVED,
    PoolEventKind.TARGET: pool_pb2.POOL_EVENT_KIND_TARGET,
}


def registration_from_pb(
    worker: pb.WorkerInfo, *, state: WorkerState = WorkerState.REGISTERING,
    tokenizer: TokenizerBundle | None = None,
) -> Registration:
    static = pb.WorkerInfo()
    static.CopyFrom(worker)
    static.ClearField("load")
    return Registration(
        worker_id=worker.worker_id,
        deployment=worker.deployment,
        address=worker.address,
        kv_address=worker.kv_address,
        num_total_blocks=worker.kv_layout.num_blocks,
        spec=static.SerializeToString(deterministic=True),
        state=state,
        tokenizer_sha256=worker.tokenizer_sha256,
        tokenizer=tokenizer,
    )


def tokenizer_from_pb(
    request: pool_pb2.RegisterRequest | pool_pb2.HeartbeatRequest,
) -> TokenizerBundle | None:
    """The bundle in a request's ``tokenizer`` field, checked (``InvalidArgumentError``)."""
    return bundle_from_pb(request.tokenizer) if request.HasField("tokenizer") else None


def record_to_pb(record: WorkerRecord) -> pb.WorkerInfo:
    extra = pb.WorkerInfo()
    if record.spec:
        extra.ParseFromString(record.spec)
    return worker_to_pb(record, extra)


class PoolServicer(pool_pb2_grpc.PoolServiceServicer):
    """Serves one pool (a deployed pool manager) or both (the one-machine stack, where one gRPC
    server hosts every service): each call goes to the manager of the role it concerns."""

    def __init__(self, managers: dict[WorkerRole, PoolManager], workers: WorkerStore,
                 events: PoolEventStream,
                 mint_credential: Callable[[str], str] | None = None) -> None:
        """``mint_credential``: worker id -> the worker credential a registration returns
        (``credentials.ServiceTokens.mint_worker_credential``); None: registrations return none."""
        self._managers = managers
        self._workers = workers
        self._events = events
        self._mint_credential = mint_credential

    def _for_role(self, role: WorkerRole | None, field: str = "role") -> PoolManager:
        if role is None:
            if len(self._managers) == 1:
                return next(iter(self._managers.values()))
            raise InvalidArgumentError(f"{field}: required", field=field)
        manager = self._managers.get(role)
        if manager is None:
            served = ", ".join(str(r) for r in self._managers)
            raise InvalidArgumentError(f"{field}: this pool manager serves {served} workers",
                                       field=field)
        return manager

    async def _for_worker(self, worker_id: str) -> PoolManager:
        if not worker_id:
            raise InvalidArgumentError("worker_id: required", field="worker_id")
        record = await self._workers.get(worker_id)
        if record is None:
            raise NotFoundError(f"worker_id: no worker {worker_id!r}", field="worker_id")
        return self._for_role(record.role, "worker_id")

    async def Register(
        self, request: pool_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pool_pb2.RegisterResponse:
        if not request.HasField("worker"):
            raise InvalidArgumentError("worker: required", field="worker")
        check_worker_id(request.worker.worker_id, "worker.worker_id", method=_REGISTER)
        manager = self._for_role(role_from_pb(request.worker.role, field="worker.role"),
                                 "worker.role")
        manager.check_join_token(request.join_token)
        await self._check_not_taken_over(request.worker.worker_id)
        registration = registration_from_pb(request.worker, tokenizer=tokenizer_from_pb(request))
        record = await manager.register(registration, request.join_token)
        policy = manager.policy
        credential = self._mint_credential(record.worker_id) if self._mint_credential else ""
        return pool_pb2.RegisterResponse(
            worker_id=record.worker_id,
            heartbeat_interval_ms=int(policy.heartbeat_interval_s * 1000),
            heartbeat_ttl_ms=int(policy.heartbeat_timeout_s * 1000),
            worker_credential=credential,
        )

    async def _check_not_taken_over(self, worker_id: str) -> None:
        """A caller that joins by the join token alone (no worker credential, no service or
        worker identity) may not take over a live worker's id: it would be handed that
        worker's credential."""
        principal = current_principal()
        if principal is None or principal.roles & {Role.WORKER, Role.SERVICE} or not worker_id:
            return
        record = await self._workers.get(worker_id)
        if record is not None and record.state not in (WorkerState.FAILED, WorkerState.DRAINED):
            count_refusal(_REGISTER, grpc.StatusCode.PERMISSION_DENIED)
            raise PermissionDeniedError(
                f"worker.worker_id: {worker_id!r} is registered and live; re-register with its "
                "worker credential", field="worker.worker_id")

    async def Heartbeat(
        self, request: pool_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pool_pb2.HeartbeatResponse:
        if not request.worker_id:
            raise InvalidArgumentError("worker_id: required", field="worker_id")
        check_worker_id(request.worker_id, method=_HEARTBEAT)
        state = worker_state_from_pb(request.state)
        held = {
            str(FencingToken(entry.token.ticket_id, entry.token.attempt)): int(entry.num_blocks)
            for entry in request.held_blocks
        }
        registration = None
        if request.HasField("worker"):
            registration = registration_from_pb(request.worker, state=state)
        if request.HasField("worker") and request.worker.role:
            manager = self._for_role(role_from_pb(request.worker.role, field="worker.role"),
                                     "worker.role")
        else:
            manager = await self._for_worker(request.worker_id)
        directives = await manager.heartbeat(Heartbeat(
            worker_id=request.worker_id,
            state=state,
            load=load_from_pb(request.load),
            held_blocks=held,
            added_prefix_hashes=tuple(request.added_prefix_hashes),
            removed_prefix_hashes=tuple(request.removed_prefix_hashes),
            is_full_prefix_report=request.is_full_prefix_report,
            join_token=request.join_token,
            registration=registration,
            expert_token_counts=tuple(request.expert_token_counts),
            num_moe_layers=request.num_moe_layers,
            tokenizer=tokenizer_from_pb(request),
        ))
        principal = current_principal()
        is_bound = principal is not None and principal.worker_id == request.worker_id
        return pool_pb2.HeartbeatResponse(
            should_drain=directives.should_drain,
            was_readopted=directives.was_readopted,
            should_send_full_prefix_report=directives.should_send_full_prefix_report,
            should_send_tokenizer=directives.should_send_tokenizer,
            drop_tokens=[token_to_pb(FencingToken.parse(t)) for t in directives.drop_tokens],
            drop_reasons=list(directives.drop_reasons),
            # Re-signed on every beat, so a worker moves to a rotated service token long
            # before the old one's grace ends.
            worker_credential=(self._mint_credential(request.worker_id)
                               if is_bound and self._mint_credential else ""),
        )

    async def Deregister(
        self, request: pool_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> pool_pb2.DeregisterResponse:
        check_worker_id(request.worker_id, method=_DEREGISTER)
        record = await self._workers.get(request.worker_id)
        if record is not None:
            manager = self._for_role(record.role, "worker_id")
            manager.check_join_token(request.join_token)
            await manager.deregister(request.worker_id)
        return pool_pb2.DeregisterResponse()

    async def Drain(
        self, request: pool_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pool_pb2.DrainResponse:
        manager = await self._for_worker(request.worker_id)
        record = await manager.drain(request.worker_id, request.reason)
        return pool_pb2.DrainResponse(state=worker_state_to_pb(record.state))

    async def ListWorkers(
        self, request: pool_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pool_pb2.ListWorkersResponse:
        role = role_from_pb(request.role, allow_unspecified=True)
        if request.deployment:
            snapshot = await self._events.snapshot(request.deployment, self._workers)
            workers = [w for w in snapshot.workers if role is None or w.role is role]
            cursor = snapshot.cursor
            target = 0
            if role is not None and role in self._managers:
                target = await self._managers[role].get_target(request.deployment)
        else:
            workers = await self._workers.list(None, role)
            cursor, target = "", 0
        return pool_pb2.ListWorkersResponse(
            workers=[record_to_pb(w) for w in workers], cursor=cursor, target_size=target)

    async def WatchPool(
        self, request: pool_pb2.WatchPoolRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pool_pb2.WatchPoolResponse]:
        if not request.deployment:
            raise InvalidArgumentError("deployment: required", field="deployment")
        cursor = request.cursor
        if not cursor:
            snapshot = await self._events.snapshot(request.deployment, self._workers)
            cursor = snapshot.cursor
        while True:
            batch = await self._events.read(request.deployment, cursor, timeout_s=5.0)
            if batch.is_gap:
                yield pool_pb2.WatchPoolResponse(
                    kind=pool_pb2.POOL_EVENT_KIND_GAP, cursor=batch.cursor
                )
                return
            for event in batch.events:
                message = pool_pb2.WatchPoolResponse(
                    kind=_KIND_TO_PB[event.kind], cursor=event.cursor, worker_id=event.worker_id
                )
                if event.worker is not None:
                    message.worker.CopyFrom(record_to_pb(event.worker))
                yield message
            cursor = batch.cursor

    async def SetTargetSize(
        self, request: pool_pb2.SetTargetSizeRequest, context: grpc.aio.ServicerContext
    ) -> pool_pb2.SetTargetSizeResponse:
        manager = self._for_role(role_from_pb(request.role))
        previous = await manager.set_target(request.deployment, request.num_workers)
        return pool_pb2.SetTargetSizeResponse(previous_num_workers=previous)
