"""``TicketLedger`` on Redis: tickets and each decode worker's block ledger, every mutation one Lua
script over the worker's hash-tagged keys (``pdserve.state.redis.keys``)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine, Sequence
from typing import Any

import redis.asyncio as aioredis

from pdserve.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    StaleTokenError,
    UnavailableError,
)
from pdserve.common.types import (
    TICKET_TRANSITIONS,
    BlockReport,
    Clock,
    DecodeWorkerView,
    FencingToken,
    LedgerSnapshot,
    ReconcileResult,
    Ticket,
    TicketSpec,
    TicketState,
)
from pdserve.state.redis.calls import LuaScripts, store_call, unwrap_reply
from pdserve.state.redis.clients import is_cluster
from pdserve.state.redis.codec import pairs, redis_time, text_map, text_or_none, texts, to_ms
from pdserve.state.redis.keys import RedisKeys, slot_tag
from pdserve.state.shared import (
    FREEING_STATES,
    REASON_ADOPTED,
    REASON_LEASE_EXPIRED,
    REASON_LEASE_EXPIRED_DONE,
    REASON_NOT_REPORTED,
    REASON_RELEASED,
    REASON_WORKER_DROPPED,
    BlockHolding,
    StateOptions,
    WorkerUnverifiedError,
    check_count,
    check_required,
    check_ttl,
    ordered_tickets,
    parse_report,
)

SCRIPT_CHUNK_TICKETS = 500
"""Most tickets one reap script handles, so no single script blocks Redis for long."""

logger = logging.getLogger(__name__)

_DONE_FROM = " ".join(s for s, targets in TICKET_TRANSITIONS.items() if TicketState.DONE in targets)
"""The states a ticket may move to DONE from (``hold_done``'s argument)."""

MAX_SCRIPT_RACES = 8
"""drop_worker/reconcile retry this often when a ticket is opened between listing and script."""

BACKSTOP_MARGIN_S = 60.0
"""Redis-clock expiry of a retired ticket, beyond its clock-based retention."""

MAX_CACHED_OWNERS = 65_536
"""Ticket id -> decode worker entries this replica remembers (a ticket's worker never changes),
so the scripts of tickets it has seen skip reading the id index first."""


def _ticket_from_fields(fields: dict[str, str]) -> Ticket:
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


def _script_arg(value: object) -> str:
    """A number for a script argument; anything else becomes text the script rejects."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return redis_time(value) if math.isfinite(value) else "nan"
    return "?"


def _view_args(view: DecodeWorkerView) -> list[str]:
    return [view.deployment, str(view.state), redis_time(view.expires_s)]


def _ledger_snapshot(worker_id: str, counts: Sequence[Any]) -> LedgerSnapshot:
    total, reserved, held = (int(x) for x in counts)
    return LedgerSnapshot(worker_id, total, reserved, held)


class RedisTicketLedger:
    """``TicketLedger`` on Redis. Each mutation: read the ticket's worker from its index key, then
    run one script over that worker's hash-tagged keys."""

    def __init__(
        self,
        client: aioredis.Redis,
        scripts: LuaScripts,
        keys: RedisKeys,
        clock: Clock,
        options: StateOptions,
    ) -> None:
        self._client = client
        self._scripts = scripts
        self._keys = keys
        self._clock = clock
        self._options = options
        self._owners: dict[str, str] = {}
        """Ticket id -> its decode worker, for tickets this replica opened or read (bounded)."""
        self._is_cluster = is_cluster(client)
        self._background: set[asyncio.Task[None]] = set()

    def _remember_owner(self, ticket_id: str, worker_id: str) -> None:
        owners = self._owners
        if len(owners) >= MAX_CACHED_OWNERS:
            del owners[next(iter(owners))]  # oldest first: dicts keep insertion order
        owners[ticket_id] = worker_id

    async def _owner_of(self, ticket_id: str) -> str | None:
        worker_id = self._owners.get(ticket_id)
        if worker_id is None:
            worker_id = text_or_none(await self._client.get(self._keys.ticket_owner(ticket_id)))
            if worker_id is None:  # opened by an earlier release
                worker_id = text_or_none(
                    await self._client.get(self._keys.legacy_ticket_owner(ticket_id)))
            if worker_id is not None:
                self._remember_owner(ticket_id, worker_id)
        return worker_id

    @property
    def _index_ttl_ms(self) -> int:
        return to_ms(self._options.ticket_index_ttl_s)

    @property
    def _backstop_ms(self) -> int:
        return to_ms(self._options.ticket_retention_s + BACKSTOP_MARGIN_S)

    def _purge_time(self, now: float) -> str:
        return redis_time(now + self._options.ticket_retention_s)

    @store_call
    async def set_capacity(
        self, worker_id: str, num_total_blocks: int, view: DecodeWorkerView | None = None
    ) -> LedgerSnapshot:
        check_required(worker_id, "worker_id")
        check_count(num_total_blocks, "num_total_blocks", 0)
        reply = unwrap_reply(
            await self._scripts(
                "set_capacity", self._keys.ledger_keys(worker_id),
                [num_total_blocks, *(_view_args(view) if view is not None else ())],
            )
        )
        await self._client.sadd(self._keys.ledger_workers(), worker_id)
        return _ledger_snapshot(worker_id, reply)

    @store_call
    async def describe_worker(self, worker_id: str, view: DecodeWorkerView) -> None:
        check_required(worker_id, "worker_id")
        unwrap_reply(await self._scripts(
            "describe_worker", self._keys.ledger_keys(worker_id), _view_args(view)))

    @store_call
    async def drop_worker(self, worker_id: str) -> list[Ticket]:
        now = self._clock()
        for _ in range(MAX_SCRIPT_RACES):
            ticket_ids = await self._live_ticket_ids(worker_id)
            reply = await self._scripts(
                "drop_worker",
                self._ticket_keys(worker_id, ticket_ids),
                [redis_time(now), self._purge_time(now), self._backstop_ms, REASON_WORKER_DROPPED,
                 *ticket_ids],
            )
            if reply[0] != "retry":
                break
        else:
            raise UnavailableError(f"drop_worker {worker_id!r} kept racing with new tickets")
        await self._client.srem(self._keys.ledger_workers(), worker_id)
        await self._shorten_owner_ttl(ticket_ids)
        return ordered_tickets(_ticket_from_fields(pairs(flat)) for flat in unwrap_reply(reply))

    @store_call
    async def open(self, spec: TicketSpec, *, should_check_worker: bool = False) -> Ticket:
        check_count(spec.num_prompt_tokens, "num_prompt_tokens", 0)
        now = self._clock()
        worker_id = spec.decode_worker_id
        lease_s = spec.lease_s
        if not isinstance(lease_s, int | float) or isinstance(lease_s, bool):
            raise InvalidArgumentError(f"lease_s: a number, got {lease_s!r}", field="lease_s")
        deadline = redis_time(now + lease_s) if math.isfinite(lease_s) else "0"
        token = self._new_token(worker_id)
        ticket_id = token.ticket_id
        keys = [*self._ticket_keys(worker_id, [ticket_id]), self._keys.ticket_owner(ticket_id)]
        args = [ticket_id, token.attempt, redis_time(now), deadline,
                _script_arg(spec.num_blocks), _script_arg(lease_s), spec.deployment,
                worker_id, spec.prefill_worker_id, spec.request_id,
                _script_arg(spec.num_prompt_tokens), self._index_ttl_ms,
                "1" if should_check_worker else "0"]
        if not self._is_cluster:
            # One node: the index an earlier release reads and the set of workers with tickets
            # are written by the same script (on a cluster they live on other masters).
            keys += [self._keys.legacy_ticket_owner(ticket_id), self._keys.ticket_workers()]
        reply = await self._scripts("open", keys, args)
        if reply[0] == "err" and reply[1] == "unverified":
            raise WorkerUnverifiedError(worker_id)
        fields = unwrap_reply(reply)  # a UUID collision is refused before anything is reserved
        self._remember_owner(ticket_id, worker_id)
        if self._is_cluster:
            self._in_background(self._mark_opened_elsewhere(ticket_id, worker_id))
        return _ticket_from_fields(pairs(fields))

    def _new_token(self, worker_id: str) -> FencingToken:
        """A fresh ticket id; on a cluster it starts with ``slot_tag(worker_id)``, so its index
        shares the worker's slot (the rest of the UUID stays random, its version bits too)."""
        token = FencingToken.new()
        if not self._is_cluster:
            return token
        tag = slot_tag(worker_id)
        return FencingToken(tag + token.ticket_id[len(tag):], token.attempt)

    async def _mark_opened_elsewhere(self, ticket_id: str, worker_id: str) -> None:
        """A cluster's writes of a new ticket outside its worker's slot: the index an earlier
        release reads and the set of workers with tickets (also rebuilt by every heartbeat's
        reconcile). Off the ticket's path: a master that is down delays neither."""
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.set(self._keys.legacy_ticket_owner(ticket_id), worker_id, nx=True,
                     px=self._index_ttl_ms)
            pipe.sadd(self._keys.ticket_workers(), worker_id)
            await pipe.execute()

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    async def finish_background_writes(self, timeout_s: float = 5.0) -> None:
        """Wait (a while) for the writes put off the ticket path, before the client closes."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("background index write failed: %s", task.exception())

    @store_call
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

    @store_call
    async def find(self, ticket_id: str) -> Ticket | None:
        worker_id = await self._owner_of(ticket_id)
        if worker_id is None:
            return None
        fields = text_map(await self._client.hgetall(self._keys.ticket(worker_id, ticket_id)))
        if not fields or _is_purged(fields, self._clock()):
            return None
        return _ticket_from_fields(fields)

    @store_call
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
            [redis_time(now), str(state), reason, allowed_from, is_freeing, self._purge_time(now),
             self._backstop_ms],
            self._index_keys(token.ticket_id),
        )
        if is_freeing == "1" and self._is_cluster:
            await self._shorten_owner_ttl([token.ticket_id])
        return ticket

    @store_call
    async def extend(self, token: FencingToken, lease_s: float) -> Ticket:
        check_ttl(lease_s, "lease_s")
        now = self._clock()
        return await self._token_script(
            "extend", token, [redis_time(now), redis_time(now + lease_s)]
        )

    @store_call
    async def mark_held(self, token: FencingToken) -> Ticket:
        return await self._token_script("mark_held", token, [redis_time(self._clock())])

    @store_call
    async def hold_done(self, token: FencingToken) -> tuple[Ticket, bool]:
        reply = await self._token_reply(
            "hold_done", token, [redis_time(self._clock()), _DONE_FROM])
        return _ticket_from_fields(pairs(reply[1:])), reply[0] == "1"

    @store_call
    async def release(self, token: FencingToken) -> Ticket:
        now = self._clock()
        ticket = await self._token_script(
            "release",
            token,
            [redis_time(now), self._purge_time(now), self._backstop_ms, REASON_RELEASED],
            self._index_keys(token.ticket_id),
        )
        if self._is_cluster:
            await self._shorten_owner_ttl([token.ticket_id])
        return ticket

    @store_call
    async def reap_expired(self, worker_id: str | None = None) -> list[Ticket]:
        now = self._clock()
        worker_ids = await self._one_or_all(worker_id, self._keys.ledger_workers())
        expired: list[Ticket] = []
        for one_worker_id in worker_ids:
            lapsed_ids = texts(await self._client.zrangebyscore(
                self._keys.leases(one_worker_id), "-inf", f"({redis_time(now)}"
            ))
            for start in range(0, len(lapsed_ids), SCRIPT_CHUNK_TICKETS):
                chunk = lapsed_ids[start : start + SCRIPT_CHUNK_TICKETS]
                reply = unwrap_reply(
                    await self._scripts(
                        "reap",
                        self._ticket_keys(one_worker_id, chunk),
                        [redis_time(now), self._purge_time(now), self._backstop_ms,
                         REASON_LEASE_EXPIRED, REASON_LEASE_EXPIRED_DONE, *chunk],
                    )
                )
                expired.extend(_ticket_from_fields(pairs(flat)) for flat in reply)
        await self._shorten_owner_ttl([t.token.ticket_id for t in expired])
        return ordered_tickets(expired)

    @store_call
    async def snapshot(self, worker_id: str) -> LedgerSnapshot:
        reply = await self._client.hmget(
            self._keys.ledger(worker_id),
            ["num_total_blocks", "num_reserved_blocks", "num_held_blocks"],
        )
        if reply[0] is None:
            raise NotFoundError(f"no ledger for decode worker {worker_id!r}")
        return _ledger_snapshot(worker_id, reply)

    @store_call
    async def list_tickets(
        self, worker_id: str | None = None, state: TicketState | None = None
    ) -> list[Ticket]:
        now = self._clock()
        worker_ids = await self._one_or_all(worker_id, self._keys.ticket_workers())
        if worker_id is None:
            # Workers with a ledger too: on a cluster the set of workers with tickets is
            # written off the open's path, so it may not name a worker's first ticket yet.
            with_ledger = texts(await self._client.smembers(self._keys.ledger_workers()))
            worker_ids = sorted(set(worker_ids) | set(with_ledger))
        tickets: list[Ticket] = []
        for one_worker_id in worker_ids:
            index_key = self._keys.ticket_index(one_worker_id)
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(index_key, "-inf", redis_time(now))
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
                    ticket = _ticket_from_fields(fields)
                    if state is None or ticket.state is state:
                        tickets.append(ticket)
        return ordered_tickets(tickets)

    @store_call
    async def reconcile(self, report: BlockReport) -> ReconcileResult:
        reported = parse_report(report)
        worker_id = report.worker_id
        now = self._clock()
        async with self._client.pipeline(transaction=False) as pipe:
            for ticket_id in reported:  # adoption needs the id -> worker index; harmless otherwise
                for owner_key in (self._keys.ticket_owner(ticket_id),
                                  self._keys.legacy_ticket_owner(ticket_id)):
                    pipe.set(owner_key, worker_id, nx=True, px=self._index_ttl_ms)
            pipe.sadd(self._keys.ledger_workers(), worker_id)
            pipe.sadd(self._keys.ticket_workers(), worker_id)
            await pipe.execute()
        for _ in range(MAX_SCRIPT_RACES):
            ticket_ids = sorted(set(await self._live_ticket_ids(worker_id)) | set(reported))
            args: list[Any] = [
                redis_time(now), self._purge_time(now), self._backstop_ms,
                redis_time(now - self._options.reconcile_grace_s), report.num_total_blocks,
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
        ledger, released, adopted, stale = unwrap_reply(reply)
        await self._shorten_owner_ttl([FencingToken.parse(t).ticket_id for t in released])
        return ReconcileResult(
            released=tuple(sorted(released)),
            adopted=tuple(sorted(adopted)),
            snapshot=_ledger_snapshot(worker_id, ledger),
            stale=tuple(sorted(stale)),
        )

    # -- internals --------------------------------------------------------------------------

    async def _token_script(self, name: str, token: FencingToken, args: list[Any],
                            extra_keys: Sequence[str] = ()) -> Ticket:
        return _ticket_from_fields(pairs(await self._token_reply(name, token, args, extra_keys)))

    async def _token_reply(self, name: str, token: FencingToken, args: list[Any],
                           extra_keys: Sequence[str] = ()) -> list[Any]:
        """The unwrapped reply of a script over one ticket (found by its id index); its keys
        are the ticket's, then ``extra_keys``."""
        worker_id = await self._owner_of(token.ticket_id)
        if worker_id is None:
            raise StaleTokenError(f"unknown ticket {token.ticket_id}")
        keys = [*self._keys.ledger_keys(worker_id), self._keys.ticket(worker_id, token.ticket_id),
                *extra_keys]
        return unwrap_reply(
            await self._scripts(name, keys, [token.ticket_id, token.attempt, *args])
        )

    async def _one_or_all(self, worker_id: str | None, set_key: str) -> list[str]:
        """``[worker_id]``, or for None every worker of the set at ``set_key``, sorted."""
        if worker_id is not None:
            return [worker_id]
        return sorted(texts(await self._client.smembers(set_key)))

    async def _live_ticket_ids(self, worker_id: str) -> list[str]:
        return texts(
            await self._client.zrangebyscore(self._keys.ticket_index(worker_id), "+inf", "+inf")
        )

    def _ticket_keys(self, worker_id: str, ticket_ids: Sequence[str]) -> list[str]:
        return [*self._keys.ledger_keys(worker_id),
                *(self._keys.ticket(worker_id, ticket_id) for ticket_id in ticket_ids)]

    def _index_keys(self, ticket_id: str) -> list[str]:
        """The id index keys a freeing script shortens itself, on one node (a cluster keeps
        the earlier release's index on other masters: ``_shorten_owner_ttl`` there)."""
        if self._is_cluster:
            return []
        return [self._keys.ticket_owner(ticket_id), self._keys.legacy_ticket_owner(ticket_id)]

    async def _shorten_owner_ttl(self, ticket_ids: Sequence[str]) -> None:
        """Retired tickets need their id index only as long as their own retention. (On a
        cluster off the caller's path: the earlier release's index lives on other masters.)"""
        if not ticket_ids:
            return
        if self._is_cluster:
            self._in_background(self._shorten_now(ticket_ids))
        else:
            await self._shorten_now(ticket_ids)

    async def _shorten_now(self, ticket_ids: Sequence[str]) -> None:
        async with self._client.pipeline(transaction=False) as pipe:
            for ticket_id in ticket_ids:
                pipe.pexpire(self._keys.ticket_owner(ticket_id), self._backstop_ms)
                pipe.pexpire(self._keys.legacy_ticket_owner(ticket_id), self._backstop_ms)
            await pipe.execute()

