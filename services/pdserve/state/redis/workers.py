"""``WorkerStore`` on Redis, and the hash form of a worker record (the change stream embeds it)."""

from __future__ import annotations

import base64

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from pdserve.common.errors import NotFoundError
from pdserve.common.types import Clock, WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.state.redis.calls import LuaScripts, store_call, unwrap_reply
from pdserve.state.redis.codec import pairs, redis_time, text_map, text_or_none, texts, to_ms
from pdserve.state.redis.keys import RedisKeys
from pdserve.state.shared import check_required, check_ttl


def worker_fields(worker: WorkerRecord, expires_s: float) -> dict[FieldT, EncodableT]:
    """The record's hash (all values text); ``expires_s`` is its end on the injected clock."""
    return {
        "worker_id": worker.worker_id,
        "deployment": worker.deployment,
        "role": str(worker.role),
        "state": str(worker.state),
        "address": worker.address,
        "kv_address": worker.kv_address,
        "num_queued_prefill_tokens": str(worker.load.num_queued_prefill_tokens),
        "num_running_seqs": str(worker.load.num_running_seqs),
        "num_free_blocks": str(worker.load.num_free_blocks),
        "num_total_blocks": str(worker.load.num_total_blocks),
        "last_heartbeat_s": redis_time(worker.last_heartbeat_s),
        "registered_s": redis_time(worker.registered_s),
        "expires_s": redis_time(expires_s),
        # The client decodes replies as text: the opaque description travels as base64.
        "spec": base64.b64encode(worker.spec).decode("ascii"),
    }


def worker_from_fields(fields: dict[str, str]) -> WorkerRecord:
    return WorkerRecord(
        worker_id=fields["worker_id"],
        deployment=fields["deployment"],
        role=WorkerRole(fields["role"]),
        state=WorkerState(fields["state"]),
        address=fields["address"],
        kv_address=fields["kv_address"],
        load=WorkerLoad(
            num_queued_prefill_tokens=int(fields["num_queued_prefill_tokens"]),
            num_running_seqs=int(fields["num_running_seqs"]),
            num_free_blocks=int(fields["num_free_blocks"]),
            num_total_blocks=int(fields["num_total_blocks"]),
        ),
        last_heartbeat_s=float(fields["last_heartbeat_s"]),
        registered_s=float(fields["registered_s"]),
        spec=base64.b64decode(fields.get("spec", "")),
    )


def _is_live_worker(fields: dict[str, str], now: float) -> bool:
    return bool(fields) and float(fields["expires_s"]) > now


class RedisWorkerStore:
    """``WorkerStore`` on Redis: one hash per worker (expiry on the injected clock, with a Redis
    ``PEXPIRE`` backstop of the same TTL) and a member set per (deployment, role)."""

    def __init__(self, client: aioredis.Redis, scripts: LuaScripts, keys: RedisKeys,
                 clock: Clock) -> None:
        self._client = client
        self._scripts = scripts
        self._keys = keys
        self._clock = clock

    @store_call
    async def upsert(self, worker: WorkerRecord, ttl_s: float) -> None:
        check_required(worker.worker_id, "worker_id")
        check_ttl(ttl_s)
        key = self._keys.worker(worker.worker_id)
        old_deployment, old_role = (
            text_or_none(value) for value in await self._client.hmget(key, ["deployment", "role"])
        )
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=worker_fields(worker, self._clock() + ttl_s))
            pipe.pexpire(key, to_ms(ttl_s))
            pipe.sadd(self._keys.worker_members(worker.deployment, worker.role), worker.worker_id)
            pipe.sadd(self._keys.worker_deployments(), worker.deployment)
            if old_deployment is not None and old_role is not None and (
                old_deployment, old_role
            ) != (worker.deployment, str(worker.role)):
                pipe.srem(self._keys.worker_members(old_deployment, old_role), worker.worker_id)
            await pipe.execute()

    @store_call
    async def heartbeat(self, worker_id: str, load: WorkerLoad, ttl_s: float) -> WorkerRecord:
        check_ttl(ttl_s)
        now = self._clock()
        try:
            reply = unwrap_reply(
                await self._scripts(
                    "worker_heartbeat",
                    [self._keys.worker(worker_id)],
                    [redis_time(now), redis_time(now + ttl_s), to_ms(ttl_s),
                     load.num_queued_prefill_tokens, load.num_running_seqs,
                     load.num_free_blocks, load.num_total_blocks],
                )
            )
        except NotFoundError:
            raise NotFoundError(f"no worker {worker_id!r} (expired or never registered)") from None
        return worker_from_fields(pairs(reply))

    @store_call
    async def set_state(self, worker_id: str, state: WorkerState) -> WorkerRecord:
        state = WorkerState(state)
        try:
            reply = unwrap_reply(
                await self._scripts(
                    "worker_set_state", [self._keys.worker(worker_id)],
                    [redis_time(self._clock()), str(state)],
                )
            )
        except NotFoundError:
            raise NotFoundError(f"no worker {worker_id!r} (expired or never registered)") from None
        return worker_from_fields(pairs(reply))

    @store_call
    async def get(self, worker_id: str) -> WorkerRecord | None:
        fields = text_map(await self._client.hgetall(self._keys.worker(worker_id)))
        return worker_from_fields(fields) if _is_live_worker(fields, self._clock()) else None

    @store_call
    async def list(
        self, deployment: str | None = None, role: WorkerRole | None = None
    ) -> list[WorkerRecord]:
        now = self._clock()
        if deployment is None:
            deployments = sorted(
                texts(await self._client.smembers(self._keys.worker_deployments()))
            )
        else:
            deployments = [deployment]
        roles = [WorkerRole(role)] if role is not None else list(WorkerRole)
        set_keys = [self._keys.worker_members(d, r) for d in deployments for r in roles]
        async with self._client.pipeline(transaction=False) as pipe:
            for set_key in set_keys:
                pipe.smembers(set_key)
            member_sets = await pipe.execute()
        memberships = [
            (k, m) for k, members in zip(set_keys, member_sets, strict=True) for m in members
        ]
        async with self._client.pipeline(transaction=False) as pipe:
            for _, worker_id in memberships:
                pipe.hgetall(self._keys.worker(worker_id))
            all_fields = await pipe.execute()
        records, stale = [], []
        for (set_key, worker_id), fields in zip(memberships, all_fields, strict=True):
            record = worker_from_fields(fields) if _is_live_worker(fields, now) else None
            if record is not None and set_key == self._keys.worker_members(
                record.deployment, record.role
            ):
                records.append(record)
            else:
                stale.append((set_key, worker_id))
        if stale:
            async with self._client.pipeline(transaction=False) as pipe:
                for set_key, worker_id in stale:
                    pipe.srem(set_key, worker_id)
                await pipe.execute()
        return sorted(records, key=lambda r: r.worker_id)

    @store_call
    async def remove(self, worker_id: str) -> None:
        key = self._keys.worker(worker_id)
        deployment, role = (
            text_or_none(value) for value in await self._client.hmget(key, ["deployment", "role"])
        )
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.delete(key)
            if deployment is not None and role is not None:
                pipe.srem(self._keys.worker_members(deployment, role), worker_id)
            await pipe.execute()
