"""Hot state on Redis (``redis.asyncio``), shared by every replica of every control-plane service.

Block accounting and ticket rules are those of the memory backend (see
``pdserve.state.memory_backend``); here each ledger step is one Lua script (``lua/*.lua``), so it
is atomic across processes. Keys are ``<prefix>:<area>:<entity>:<id>``; every key one script
touches carries the decode worker's hash tag ``{w:<worker_id>}`` (or ``{d:<deployment>}`` for the
change stream), so the scripts run unchanged on Redis Cluster::

    <p>:ledger:{w:W}            hash  num_total_blocks, num_reserved_blocks, num_held_blocks
    <p>:leases:{w:W}            zset  ticket id -> lease deadline (tickets with reserved blocks)
    <p>:tickets:{w:W}           zset  ticket id -> purge time (+inf while it owns blocks)
    <p>:ticket:{w:W}:T          hash  one ticket
    <p>:ticketidx:T             str   T -> W, read before a script to build its keys
    <p>:ledger:workers          set   workers with a ledger (for reap_expired over all)
    <p>:tickets:workers         set   workers with tickets (for list_tickets over all)
    <p>:worker:record:W         hash  worker record, PEXPIRE'd by heartbeat
    <p>:worker:members:D:R      set   worker ids of deployment D, role R (stale ones dropped lazily)
    <p>:worker:deployments      set   deployments with workers
    <p>:events:meta:{d:D}       hash  epoch, seq of D's change stream
    <p>:events:stream:{d:D}     stream of D's pool events, ids "<seq>-0"
    <p>:target:D:R              str   target pool size

Times are the injected (coordinator) clock's, passed into scripts as arguments; Redis's own clock
only drives backstop expiries (``PEXPIRE``) that delete data the clock has already retired.
Connection failures raise ``UnavailableError``: the client does not retry by itself, because a
retried script may already have run (a write's outcome is then unknown; leases and
reconciliation clean up what a lost reply leaves behind).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib.resources
import json
import math
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdserve.common.errors import (
    AlreadyExistsError,
    CapacityError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    StaleTokenError,
    UnavailableError,
)
from pdserve.common.types import (
    TICKET_TRANSITIONS,
    BlockReport,
    Clock,
    FencingToken,
    LedgerSnapshot,
    PoolEvent,
    PoolEventKind,
    PoolEvents,
    PoolSnapshot,
    ReconcileResult,
    Ticket,
    TicketSpec,
    TicketState,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)
from pdserve.state.interfaces import WorkerStore
from pdserve.state.shared import (
    FREEING_STATES,
    MAX_EVENTS_PER_READ,
    REASON_ADOPTED,
    REASON_LEASE_EXPIRED,
    REASON_LEASE_EXPIRED_DONE,
    REASON_NOT_REPORTED,
    REASON_RELEASED,
    REASON_WORKER_DROPPED,
    BlockHolding,
    StateOptions,
    check_count,
    check_ttl,
    format_cursor,
    parse_cursor,
    parse_report,
)

SCRIPT_CHUNK_TICKETS = 500
"""Most tickets one reap script handles, so no single script blocks Redis for long."""

MAX_SCRIPT_RACES = 8
"""drop_worker/reconcile retry this often when a ticket is opened between listing and script."""

BACKSTOP_MARGIN_S = 60.0
"""Redis-clock expiry of a retired ticket, beyond its clock-based retention."""

_ERRORS_BY_CODE: dict[str, type[PdserveError]] = {
    "stale": StaleTokenError,
    "illegal": IllegalTransitionError,
    "invalid": InvalidArgumentError,
    "notfound": NotFoundError,
    "exists": AlreadyExistsError,
}

P = ParamSpec("P")
R = TypeVar("R")


def _store_call(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Turn Redis connection failures into ``UnavailableError``."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
            raise UnavailableError(f"state store unavailable ({type(exc).__name__})") from exc

    return wrapper


store_call = _store_call
"""For other Redis-backed stores (prefix index, rendezvous): connection failures become
``UnavailableError``, which callers retry and gRPC reports as UNAVAILABLE."""


def _lua(name: str) -> str:
    return importlib.resources.files("pdserve.state").joinpath("lua", name).read_text("utf-8")


def _time(seconds: float) -> str:
    """A float as the shortest decimal that reads back exactly (Lua and Redis parse it)."""
    return repr(float(seconds))


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _unwrap(reply: Sequence[Any]) -> list[Any]:
    """The payload of an ``{'ok', ...}`` script reply; raises the mapped error otherwise."""
    if reply[0] == "ok":
        return list(reply[1:])
    _, code, message, extra = reply
    if code == "capacity":
        raise CapacityError(message, retry_after_s=float(extra))
    error = _ERRORS_BY_CODE.get(code, PdserveError)
    raise error(message, field=extra or None)


def _pairs(flat: Sequence[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _ticket(fields: dict[str, str]) -> Ticket:
    return Ticket(
        token=FencingToken(fields["ticket_id"], int(fields["attempt"])),
        deployment=fields["deployment"],
        decode_worker_id=fields["decode_worker_id"],
        prefill_worker_id=fields["prefill_worker_id"],
        num_blocks=int(fields["num_blocks"]),
        state=TicketState(fields["state"]),
        is_held=fields["holding"] == BlockHolding.HELD,
        lease_deadline_s=float(fields["lease_deadline_s"]),
        created_s=float(fields["created_s"]),
        updated_s=float(fields["updated_s"]),
        request_id=fields["request_id"],
        num_prompt_tokens=int(fields["num_prompt_tokens"]),
        reason=fields["reason"],
    )


def _is_purged(fields: dict[str, str], now: float) -> bool:
    purge_s = fields.get("purge_s", "")
    return bool(purge_s) and float(purge_s) <= now


def _ordered(tickets: Iterable[Ticket]) -> list[Ticket]:
    return sorted(tickets, key=lambda t: (t.created_s, t.token.ticket_id))


def _worker_fields(worker: WorkerRecord, expires_s: float) -> dict[str, str]:
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
        "last_heartbeat_s": _time(worker.last_heartbeat_s),
        "registered_s": _time(worker.registered_s),
        "expires_s": _time(expires_s),
        # The client decodes replies as text: the opaque description travels as base64.
        "spec": base64.b64encode(worker.spec).decode("ascii"),
    }


def _worker(fields: dict[str, str]) -> WorkerRecord:
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


def _event_json(event: PoolEvent) -> str:
    worker = None
    if event.worker is not None:
        worker = _worker_fields(event.worker, 0.0)
        del worker["expires_s"]
    return json.dumps(
        {"kind": str(event.kind), "deployment": event.deployment, "worker": worker,
         "worker_id": event.worker_id},
        separators=(",", ":"),
    )


def _event(payload: str, cursor: str) -> PoolEvent:
    data = json.loads(payload)
    worker = None
    if data["worker"] is not None:
        worker = _worker({**data["worker"], "expires_s": "0"})
    return PoolEvent(
        cursor=cursor,
        kind=PoolEventKind(data["kind"]),
        deployment=data["deployment"],
        worker=worker,
        worker_id=data["worker_id"],
    )


class RedisKeys:
    """Key names under one prefix (see the module docstring for the layout)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def ledger(self, worker_id: str) -> str:
        return f"{self.prefix}:ledger:{{w:{worker_id}}}"

    def leases(self, worker_id: str) -> str:
        return f"{self.prefix}:leases:{{w:{worker_id}}}"

    def ticket_index(self, worker_id: str) -> str:
        return f"{self.prefix}:tickets:{{w:{worker_id}}}"

    def ticket(self, worker_id: str, ticket_id: str) -> str:
        return f"{self.prefix}:ticket:{{w:{worker_id}}}:{ticket_id}"

    def ticket_owner(self, ticket_id: str) -> str:
        return f"{self.prefix}:ticketidx:{ticket_id}"

    def ledger_workers(self) -> str:
        return f"{self.prefix}:ledger:workers"

    def ticket_workers(self) -> str:
        return f"{self.prefix}:tickets:workers"

    def ledger_keys(self, worker_id: str) -> list[str]:
        """The first three keys of every ticket script."""
        return [self.ledger(worker_id), self.leases(worker_id), self.ticket_index(worker_id)]

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:record:{worker_id}"

    def worker_members(self, deployment: str, role: WorkerRole | str) -> str:
        return f"{self.prefix}:worker:members:{deployment}:{role}"

    def worker_deployments(self) -> str:
        return f"{self.prefix}:worker:deployments"

    def events_meta(self, deployment: str) -> str:
        return f"{self.prefix}:events:meta:{{d:{deployment}}}"

    def events_stream(self, deployment: str) -> str:
        return f"{self.prefix}:events:stream:{{d:{deployment}}}"

    def target(self, deployment: str, role: WorkerRole | str) -> str:
        return f"{self.prefix}:target:{deployment}:{role}"


class _Scripts:
    """The Lua scripts, registered once; redis-py loads them again after a server restart."""

    _LEDGER = (
        "set_capacity", "open", "transition", "extend", "mark_held", "release", "reap",
        "drop_worker", "reconcile",
    )
    _PLAIN = ("worker_heartbeat", "worker_set_state", "events_head", "events_publish")

    def __init__(self, client: aioredis.Redis) -> None:
        lib = _lua("_lib.lua")
        ledger_lib = lib + "\n" + _lua("_ledger.lua")
        self._scripts = {name: client.register_script(ledger_lib + "\n" + _lua(f"{name}.lua"))
                         for name in self._LEDGER}
        self._scripts.update(
            {name: client.register_script(lib + "\n" + _lua(f"{name}.lua")) for name in self._PLAIN}
        )

    async def __call__(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        return await self._scripts[name](keys=list(keys), args=list(args))


class RedisTicketLedger:
    """``TicketLedger`` on Redis. Each mutation: read the ticket's worker from its index key, then
    run one script over that worker's hash-tagged keys."""

    def __init__(
        self,
        client: aioredis.Redis,
        scripts: _Scripts,
        keys: RedisKeys,
        clock: Clock,
        options: StateOptions,
    ) -> None:
        self._client = client
        self._scripts = scripts
        self._keys = keys
        self._clock = clock
        self._options = options

    @property
    def _backstop_ms(self) -> int:
        return _ms(self._options.ticket_retention_s + BACKSTOP_MARGIN_S)

    def _purge_time(self, now: float) -> str:
        return _time(now + self._options.ticket_retention_s)

    @_store_call
    async def set_capacity(self, worker_id: str, num_total_blocks: int) -> LedgerSnapshot:
        if not worker_id:
            raise InvalidArgumentError("worker_id: required", field="worker_id")
        check_count(num_total_blocks, "num_total_blocks", 0)
        reply = _unwrap(
            await self._scripts(
                "set_capacity", self._keys.ledger_keys(worker_id), [num_total_blocks]
            )
        )
        await self._client.sadd(self._keys.ledger_workers(), worker_id)
        return _snapshot(worker_id, reply)

    @_store_call
    async def drop_worker(self, worker_id: str) -> list[Ticket]:
        now = self._clock()
        for _ in range(MAX_SCRIPT_RACES):
            ticket_ids = await self._live_ticket_ids(worker_id)
            reply = await self._scripts(
                "drop_worker",
                self._ticket_keys(worker_id, ticket_ids),
                [_time(now), self._purge_time(now), self._backstop_ms, REASON_WORKER_DROPPED,
                 *ticket_ids],
            )
            if reply[0] != "retry":
                break
        else:
            raise UnavailableError(f"drop_worker {worker_id!r} kept racing with new tickets")
        await self._client.srem(self._keys.ledger_workers(), worker_id)
        await self._shorten_owner_ttl(ticket_ids)
        return _ordered(_ticket(_pairs(flat)) for flat in _unwrap(reply))

    @_store_call
    async def open(self, spec: TicketSpec) -> Ticket:
        check_count(spec.num_prompt_tokens, "num_prompt_tokens", 0)
        now = self._clock()
        worker_id = spec.decode_worker_id
        lease_s = spec.lease_s
        if not isinstance(lease_s, int | float) or isinstance(lease_s, bool):
            raise InvalidArgumentError(f"lease_s: a number, got {lease_s!r}", field="lease_s")
        deadline = _time(now + lease_s) if math.isfinite(lease_s) else "0"
        token = FencingToken.new()
        owner_key = self._keys.ticket_owner(token.ticket_id)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.set(owner_key, worker_id, px=_ms(self._options.ticket_index_ttl_s), nx=True)
            pipe.sadd(self._keys.ticket_workers(), worker_id)
            is_new, _ = await pipe.execute()
        if not is_new:  # a UUID4 collision; never reuse an id
            raise AlreadyExistsError(f"ticket {token.ticket_id} exists", field="ticket_id")
        try:
            reply = _unwrap(
                await self._scripts(
                    "open",
                    self._ticket_keys(worker_id, [token.ticket_id]),
                    [token.ticket_id, token.attempt, _time(now), deadline, _arg(spec.num_blocks),
                     _arg(lease_s), spec.deployment, worker_id, spec.prefill_worker_id,
                     spec.request_id, _arg(spec.num_prompt_tokens)],
                )
            )
        except BaseException:
            with contextlib.suppress(redis_errors.RedisError):
                await self._client.delete(owner_key)
            raise
        return _ticket(_pairs(reply))

    @_store_call
    async def get(self, token: FencingToken) -> Ticket:
        ticket = await self.find(token.ticket_id)
        if ticket is None:
            raise StaleTokenError(f"unknown ticket {token.ticket_id}")
        if ticket.token.attempt != token.attempt:
            raise StaleTokenError(
                f"ticket {token.ticket_id} is at attempt {ticket.token.attempt}, "
                f"not {token.attempt}"
            )
        return ticket

    @_store_call
    async def find(self, ticket_id: str) -> Ticket | None:
        worker_id = await self._client.get(self._keys.ticket_owner(ticket_id))
        if worker_id is None:
            return None
        fields = await self._client.hgetall(self._keys.ticket(worker_id, ticket_id))
        if not fields or _is_purged(fields, self._clock()):
            return None
        return _ticket(fields)

    @_store_call
    async def transition(
        self, token: FencingToken, state: TicketState, reason: str = ""
    ) -> Ticket:
        state = TicketState(state)
        now = self._clock()
        allowed_from = " ".join(s for s, targets in TICKET_TRANSITIONS.items() if state in targets)
        is_freeing = "1" if state in FREEING_STATES else "0"
        ticket = await self._token_script(
            "transition",
            token,
            [_time(now), str(state), reason, allowed_from, is_freeing, self._purge_time(now),
             self._backstop_ms],
        )
        if is_freeing == "1":
            await self._shorten_owner_ttl([token.ticket_id])
        return ticket

    @_store_call
    async def extend(self, token: FencingToken, lease_s: float) -> Ticket:
        check_ttl(lease_s, "lease_s")
        now = self._clock()
        return await self._token_script("extend", token, [_time(now), _time(now + lease_s)])

    @_store_call
    async def mark_held(self, token: FencingToken) -> Ticket:
        return await self._token_script("mark_held", token, [_time(self._clock())])

    @_store_call
    async def release(self, token: FencingToken) -> Ticket:
        now = self._clock()
        ticket = await self._token_script(
            "release",
            token,
            [_time(now), self._purge_time(now), self._backstop_ms, REASON_RELEASED],
        )
        await self._shorten_owner_ttl([token.ticket_id])
        return ticket

    @_store_call
    async def reap_expired(self, worker_id: str | None = None) -> list[Ticket]:
        now = self._clock()
        if worker_id is None:
            worker_ids = sorted(await self._client.smembers(self._keys.ledger_workers()))
        else:
            worker_ids = [worker_id]
        expired: list[Ticket] = []
        for one_worker_id in worker_ids:
            lapsed_ids = await self._client.zrangebyscore(
                self._keys.leases(one_worker_id), "-inf", f"({_time(now)}"
            )
            for start in range(0, len(lapsed_ids), SCRIPT_CHUNK_TICKETS):
                chunk = lapsed_ids[start : start + SCRIPT_CHUNK_TICKETS]
                reply = _unwrap(
                    await self._scripts(
                        "reap",
                        self._ticket_keys(one_worker_id, chunk),
                        [_time(now), self._purge_time(now), self._backstop_ms,
                         REASON_LEASE_EXPIRED, REASON_LEASE_EXPIRED_DONE, *chunk],
                    )
                )
                expired.extend(_ticket(_pairs(flat)) for flat in reply)
        await self._shorten_owner_ttl([t.token.ticket_id for t in expired])
        return _ordered(expired)

    @_store_call
    async def snapshot(self, worker_id: str) -> LedgerSnapshot:
        reply = await self._client.hmget(
            self._keys.ledger(worker_id),
            ["num_total_blocks", "num_reserved_blocks", "num_held_blocks"],
        )
        if reply[0] is None:
            raise NotFoundError(f"no ledger for decode worker {worker_id!r}")
        return _snapshot(worker_id, reply)

    @_store_call
    async def list_tickets(
        self, worker_id: str | None = None, state: TicketState | None = None
    ) -> list[Ticket]:
        now = self._clock()
        if worker_id is None:
            worker_ids = sorted(await self._client.smembers(self._keys.ticket_workers()))
        else:
            worker_ids = [worker_id]
        tickets: list[Ticket] = []
        for one_worker_id in worker_ids:
            index_key = self._keys.ticket_index(one_worker_id)
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(index_key, "-inf", _time(now))
                pipe.zrange(index_key, 0, -1)
                _, ticket_ids = await pipe.execute()
            if not ticket_ids:
                if worker_id is None:
                    await self._client.srem(self._keys.ticket_workers(), one_worker_id)
                continue
            async with self._client.pipeline(transaction=False) as pipe:
                for ticket_id in ticket_ids:
                    pipe.hgetall(self._keys.ticket(one_worker_id, ticket_id))
                all_fields = await pipe.execute()
            for fields in all_fields:
                if fields and not _is_purged(fields, now):
                    ticket = _ticket(fields)
                    if state is None or ticket.state is state:
                        tickets.append(ticket)
        return _ordered(tickets)

    @_store_call
    async def reconcile(self, report: BlockReport) -> ReconcileResult:
        reported = parse_report(report)
        worker_id = report.worker_id
        now = self._clock()
        async with self._client.pipeline(transaction=False) as pipe:
            for ticket_id in reported:  # adoption needs the id -> worker index; harmless otherwise
                pipe.set(self._keys.ticket_owner(ticket_id), worker_id, nx=True,
                         px=_ms(self._options.ticket_index_ttl_s))
            pipe.sadd(self._keys.ledger_workers(), worker_id)
            pipe.sadd(self._keys.ticket_workers(), worker_id)
            await pipe.execute()
        for _ in range(MAX_SCRIPT_RACES):
            ticket_ids = sorted(set(await self._live_ticket_ids(worker_id)) | set(reported))
            args: list[Any] = [
                _time(now), self._purge_time(now), self._backstop_ms,
                _time(now - self._options.reconcile_grace_s), report.num_total_blocks,
                REASON_NOT_REPORTED, REASON_ADOPTED, worker_id,
            ]
            for ticket_id in ticket_ids:
                attempt, num_blocks = reported.get(ticket_id, ("", ""))
                args.extend([ticket_id, attempt, num_blocks])
            reply = await self._scripts("reconcile", self._ticket_keys(worker_id, ticket_ids), args)
            if reply[0] != "retry":
                break
        else:
            raise UnavailableError(f"reconcile {worker_id!r} kept racing with new tickets")
        ledger, released, adopted = _unwrap(reply)
        await self._shorten_owner_ttl([FencingToken.parse(t).ticket_id for t in released])
        return ReconcileResult(
            released=tuple(sorted(released)),
            adopted=tuple(sorted(adopted)),
            snapshot=_snapshot(worker_id, ledger),
        )

    # -- internals --------------------------------------------------------------------------

    async def _token_script(self, name: str, token: FencingToken, args: list[Any]) -> Ticket:
        worker_id = await self._client.get(self._keys.ticket_owner(token.ticket_id))
        if worker_id is None:
            raise StaleTokenError(f"unknown ticket {token.ticket_id}")
        keys = [*self._keys.ledger_keys(worker_id), self._keys.ticket(worker_id, token.ticket_id)]
        reply = _unwrap(await self._scripts(name, keys, [token.ticket_id, token.attempt, *args]))
        return _ticket(_pairs(reply))

    async def _live_ticket_ids(self, worker_id: str) -> list[str]:
        return await self._client.zrangebyscore(self._keys.ticket_index(worker_id), "+inf", "+inf")

    def _ticket_keys(self, worker_id: str, ticket_ids: Sequence[str]) -> list[str]:
        return [*self._keys.ledger_keys(worker_id),
                *(self._keys.ticket(worker_id, ticket_id) for ticket_id in ticket_ids)]

    async def _shorten_owner_ttl(self, ticket_ids: Sequence[str]) -> None:
        """Retired tickets need their id index only as long as their own retention."""
        if not ticket_ids:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for ticket_id in ticket_ids:
                pipe.pexpire(self._keys.ticket_owner(ticket_id), self._backstop_ms)
            await pipe.execute()


def _arg(value: object) -> str:
    """A number for a script argument; anything else becomes text the script rejects."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _time(value) if math.isfinite(value) else "nan"
    return "?"


def _snapshot(worker_id: str, counts: Sequence[Any]) -> LedgerSnapshot:
    total, reserved, held = (int(x) for x in counts)
    return LedgerSnapshot(worker_id, total, reserved, held)


class RedisWorkerStore:
    """``WorkerStore`` on Redis: one hash per worker (expiry on the injected clock, with a Redis
    ``PEXPIRE`` backstop of the same TTL) and a member set per (deployment, role)."""

    def __init__(self, client: aioredis.Redis, scripts: _Scripts, keys: RedisKeys,
                 clock: Clock) -> None:
        self._client = client
        self._scripts = scripts
        self._keys = keys
        self._clock = clock

    @_store_call
    async def upsert(self, worker: WorkerRecord, ttl_s: float) -> None:
        if not worker.worker_id:
            raise InvalidArgumentError("worker_id: required", field="worker_id")
        check_ttl(ttl_s)
        key = self._keys.worker(worker.worker_id)
        old_deployment, old_role = await self._client.hmget(key, ["deployment", "role"])
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=_worker_fields(worker, self._clock() + ttl_s))
            pipe.pexpire(key, _ms(ttl_s))
            pipe.sadd(self._keys.worker_members(worker.deployment, worker.role), worker.worker_id)
            pipe.sadd(self._keys.worker_deployments(), worker.deployment)
            if old_deployment is not None and (old_deployment, old_role) != (
                worker.deployment, str(worker.role)
            ):
                pipe.srem(self._keys.worker_members(old_deployment, old_role), worker.worker_id)
            await pipe.execute()

    @_store_call
    async def heartbeat(self, worker_id: str, load: WorkerLoad, ttl_s: float) -> WorkerRecord:
        check_ttl(ttl_s)
        now = self._clock()
        try:
            reply = _unwrap(
                await self._scripts(
                    "worker_heartbeat",
                    [self._keys.worker(worker_id)],
                    [_time(now), _time(now + ttl_s), _ms(ttl_s), load.num_queued_prefill_tokens,
                     load.num_running_seqs, load.num_free_blocks, load.num_total_blocks],
                )
            )
        except NotFoundError:
            raise NotFoundError(f"no worker {worker_id!r} (expired or never registered)") from None
        return _worker(_pairs(reply))

    @_store_call
    async def set_state(self, worker_id: str, state: WorkerState) -> WorkerRecord:
        state = WorkerState(state)
        try:
            reply = _unwrap(
                await self._scripts(
                    "worker_set_state", [self._keys.worker(worker_id)],
                    [_time(self._clock()), str(state)],
                )
            )
        except NotFoundError:
            raise NotFoundError(f"no worker {worker_id!r} (expired or never registered)") from None
        return _worker(_pairs(reply))

    @_store_call
    async def get(self, worker_id: str) -> WorkerRecord | None:
        fields = await self._client.hgetall(self._keys.worker(worker_id))
        return _worker(fields) if _is_live_worker(fields, self._clock()) else None

    @_store_call
    async def list(
        self, deployment: str | None = None, role: WorkerRole | None = None
    ) -> list[WorkerRecord]:
        now = self._clock()
        if deployment is None:
            deployments = sorted(await self._client.smembers(self._keys.worker_deployments()))
        else:
            deployments = [deployment]
        roles = [WorkerRole(role)] if role is not None else list(WorkerRole)
        set_keys = [self._keys.worker_members(d, r) for d in deployments for r in roles]
        async with self._client.pipeline(transaction=False) as pipe:
            for set_key in set_keys:
                pipe.smembers(set_key)
            member_sets = await pipe.execute()
        pairs = [(k, m) for k, members in zip(set_keys, member_sets, strict=True) for m in members]
        async with self._client.pipeline(transaction=False) as pipe:
            for _, worker_id in pairs:
                pipe.hgetall(self._keys.worker(worker_id))
            all_fields = await pipe.execute()
        records, stale = [], []
        for (set_key, worker_id), fields in zip(pairs, all_fields, strict=True):
            record = _worker(fields) if _is_live_worker(fields, now) else None
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

    @_store_call
    async def remove(self, worker_id: str) -> None:
        key = self._keys.worker(worker_id)
        deployment, role = await self._client.hmget(key, ["deployment", "role"])
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.delete(key)
            if deployment is not None:
                pipe.srem(self._keys.worker_members(deployment, role), worker_id)
            await pipe.execute()


class RedisPoolEventStream:
    """``PoolEventStream`` on Redis Streams, one stream per deployment with approximate MAXLEN
    trimming. Cursors are ``epoch:seq``; the epoch is new whenever the stream's meta hash is
    missing (a store loss), so an old cursor is then a gap, as is one older than the oldest
    retained event."""

    def __init__(self, client: aioredis.Redis, scripts: _Scripts, keys: RedisKeys,
                 options: StateOptions) -> None:
        self._client = client
        self._scripts = scripts
        self._keys = keys
        self._options = options

    def _stream_keys(self, deployment: str) -> list[str]:
        return [self._keys.events_meta(deployment), self._keys.events_stream(deployment)]

    @_store_call
    async def publish(self, event: PoolEvent) -> str:
        if not event.deployment:
            raise InvalidArgumentError("deployment: required", field="deployment")
        epoch, seq = _unwrap(
            await self._scripts(
                "events_publish", self._stream_keys(event.deployment),
                [uuid.uuid4().hex, self._options.stream_max_len, _event_json(event)],
            )
        )
        return format_cursor(epoch, int(seq))

    async def _head(self, deployment: str) -> tuple[str, int]:
        epoch, seq = _unwrap(
            await self._scripts("events_head", self._stream_keys(deployment), [uuid.uuid4().hex])
        )
        return epoch, int(seq)

    @_store_call
    async def read(self, deployment: str, cursor: str, timeout_s: float = 0.0) -> PoolEvents:
        parsed = parse_cursor(cursor)
        epoch, last_seq = await self._head(deployment)
        head = format_cursor(epoch, last_seq)
        if parsed is None or parsed[0] != epoch or parsed[1] > last_seq:
            return PoolEvents((), head, is_gap=True)
        seq = parsed[1]
        stream_key = self._keys.events_stream(deployment)
        if seq < last_seq:
            entries = await self._client.xrange(
                stream_key, f"{seq + 1}-0", "+", count=MAX_EVENTS_PER_READ
            )
            return self._events_or_gap(epoch, seq, entries, head)
        if timeout_s <= 0:
            return PoolEvents((), cursor, is_gap=False)
        reply = await self._client.xread(
            {stream_key: f"{seq}-0"}, count=MAX_EVENTS_PER_READ, block=_ms(timeout_s)
        )
        if not reply:
            return PoolEvents((), cursor, is_gap=False)
        new_epoch, new_seq = await self._head(deployment)
        if new_epoch != epoch:  # the store was lost while we waited
            return PoolEvents((), format_cursor(new_epoch, new_seq), is_gap=True)
        return self._events_or_gap(epoch, seq, reply[0][1], head)

    @staticmethod
    def _events_or_gap(
        epoch: str, seq: int, entries: list[tuple[str, dict[str, str]]], head: str
    ) -> PoolEvents:
        """Events after ``seq``, or a gap when the first of them is not ``seq + 1`` (trimmed)."""
        seqs = [int(entry_id.partition("-")[0]) for entry_id, _ in entries]
        if not seqs or seqs[0] != seq + 1:
            return PoolEvents((), head, is_gap=True)
        events = tuple(
            _event(fields["event"], format_cursor(epoch, s))
            for s, (_, fields) in zip(seqs, entries, strict=True)
        )
        return PoolEvents(events, events[-1].cursor, is_gap=False)

    @_store_call
    async def snapshot(self, deployment: str, workers: WorkerStore) -> PoolSnapshot:
        # The cursor first: events after it may repeat what the list shows, but none is lost.
        epoch, seq = await self._head(deployment)
        return PoolSnapshot(tuple(await workers.list(deployment)), format_cursor(epoch, seq))


class RedisTargetStore:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._client = client
        self._keys = keys

    @_store_call
    async def set_target(self, deployment: str, role: WorkerRole, num_workers: int) -> None:
        if not deployment:
            raise InvalidArgumentError("deployment: required", field="deployment")
        check_count(num_workers, "num_workers", 0)
        await self._client.set(self._keys.target(deployment, WorkerRole(role)), num_workers)

    @_store_call
    async def get_target(self, deployment: str, role: WorkerRole) -> int | None:
        value = await self._client.get(self._keys.target(deployment, WorkerRole(role)))
        return None if value is None else int(value)


class RedisStateBackend:
    """``StateBackend`` on one Redis (or, with the same scripts, a Redis Cluster client).
    ``clock`` is the coordinator's clock."""

    def __init__(
        self, client: aioredis.Redis, clock: Clock, options: StateOptions | None = None
    ) -> None:
        options = options or StateOptions()
        self.client = client
        self.keys = RedisKeys(options.key_prefix)
        scripts = _Scripts(client)
        self.workers = RedisWorkerStore(client, scripts, self.keys, clock)
        self.tickets = RedisTicketLedger(client, scripts, self.keys, clock, options)
        self.events = RedisPoolEventStream(client, scripts, self.keys, options)
        self.targets = RedisTargetStore(client, self.keys)

    @classmethod
    def from_url(
        cls, url: str, clock: Clock, options: StateOptions | None = None
    ) -> RedisStateBackend:
        """A client for ``url`` with RESP2 replies, string decoding and no automatic retries."""
        client = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            protocol=2,
            retry=Retry(NoBackoff(), 0),
            socket_connect_timeout=5.0,
        )
        return cls(client, clock, options)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (redis_errors.ConnectionError, redis_errors.TimeoutError):
            return False

    async def close(self) -> None:
        await self.client.aclose()
