"""The pool manager core: membership, lifecycle, health and scale actuation of one pool (prefill
or decode) for one or more deployments. The gRPC servicer is a thin adapter over this class.

Everything it knows lives in the shared state backend, so several replicas can serve the same
pool; only scale actuation must run on one replica at a time (``run_actuator`` is started on the
replica that holds the pool's actuation role).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from pdserve.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from pdserve.common.hf_tokenizer import HfTokenizer
from pdserve.common.leadership import LeaderElector
from pdserve.common.tokenizer_bundle import TokenizerBundle
from pdserve.common.types import (
    BlockReport,
    Clock,
    DecodeWorkerView,
    FencingToken,
    PoolEvent,
    PoolEventKind,
    TicketState,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)
from pdserve.pool.lifecycle import is_legal
from pdserve.pool.metrics import observe_ledger, observe_pool
from pdserve.pool.provisioner import Provisioner, WorkerLaunch
from pdserve.state.expert_loads import ExpertLoadReport, ExpertLoadStore, expert_load_store_for
from pdserve.state.interfaces import StateBackend
from pdserve.state.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    """How one pool manager runs. Seconds throughout."""

    role: WorkerRole
    join_token: str
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    """No heartbeat for this long marks a worker FAILED."""
    record_ttl_s: float = 60.0
    """A record with no heartbeat disappears from the store after this long."""
    health_interval_s: float = 0.5
    actuate_interval_s: float = 1.0
    launch_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per deployment, extra worker arguments for the provisioner."""
    ready_timeout_s: float = 0.0
    """A launched worker not READY this long after its launch (or its adoption by this
    manager) is stopped and replaced; 0 = wait for ever. Longer than the slowest cold start."""


@dataclass(frozen=True, slots=True)
class Registration:
    worker_id: str
    deployment: str
    address: str
    kv_address: str = ""
    num_total_blocks: int = 0
    spec: bytes = b""
    state: WorkerState = WorkerState.REGISTERING
    tokenizer_sha256: str = ""
    """Digest of the tokenizer the worker serves (``WorkerInfo.tokenizer_sha256``); "" = none."""
    tokenizer: TokenizerBundle | None = None
    """The bundle itself, sent with ``Register`` (not when a heartbeat rebuilds the record)."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    worker_id: str
    state: WorkerState
    load: WorkerLoad
    held_blocks: dict[str, int] | None = None
    added_prefix_hashes: tuple[int, ...] = ()
    removed_prefix_hashes: tuple[int, ...] = ()
    is_full_prefix_report: bool = False
    join_token: str = ""
    registration: Registration | None = None
    expert_token_counts: tuple[int, ...] = ()
    """MoE workers: tokens per (layer, expert) since the last report, flattened."""
    num_moe_layers: int = 0
    tokenizer: TokenizerBundle | None = None
    """The worker's tokenizer, sent because the previous directives asked for it."""


@dataclass(frozen=True, slots=True)
class HeartbeatDirectives:
    should_drain: bool = False
    was_readopted: bool = False
    should_send_full_prefix_report: bool = False
    should_send_tokenizer: bool = False
    """The store lacks the worker's tokenizer bundle (lost with a store restart)."""
    drop_tokens: tuple[str, ...] = ()
    """Tickets the worker reported that the ledger no longer holds for it (it drops them)."""
    drop_reasons: tuple[str, ...] = ()
    """Why, for each of ``drop_tokens`` (``_drop_reason``)."""


class LifecycleSink(Protocol):
    """Durable record of worker lifecycle events (Postgres in production)."""

    def record(self, worker: WorkerRecord, from_state: WorkerState | None, reason: str) -> None: ...


class PoolManager:
    def __init__(
        self,
        policy: PoolPolicy,
        backend: StateBackend,
        prefix_index: PrefixIndex,
        clock: Clock,
        provisioner: Provisioner | None = None,
        lifecycle_sink: LifecycleSink | None = None,
        expert_loads: ExpertLoadStore | None = None,
    ) -> None:
        """``expert_loads`` is where MoE workers' per-expert token counts go for the governor's
        placement loop; by default the store beside ``backend`` (which the governor reads)."""
        self.policy = policy
        self._backend = backend
        self._expert_loads = expert_loads or expert_load_store_for(backend)
        self._prefix_index = prefix_index
        self._clock = clock
        self._store_failed_s = -math.inf
        """When a store call last failed UNAVAILABLE here (heartbeats lost then are no
        worker's silence)."""
        self._provisioner = provisioner
        self._lifecycle_sink = lifecycle_sink
        self._launched: dict[str, str] = {}  # worker_id -> deployment, launched and not yet gone
        self._launched_at: dict[str, float] = {}  # worker_id -> clock() at launch or adoption
        self._registered: set[str] = set()  # launched workers seen in the store

    # -- membership ---------------------------------------------------------------------------

    def check_join_token(self, join_token: str) -> None:
        """Raise ``UnauthenticatedError`` unless ``join_token`` admits workers to this pool."""
        self._check_token(join_token)

    join_token_source: Callable[[], Iterable[str]] | None = None
    """When set (e.g. ``pdserve.common.credentials.TokenFile.tokens``, which follows edits to its
    file), the join tokens valid now, replacing ``policy.join_token``: rotation adds a token,
    moves the workers over, then removes the old one, with no restart of the pool manager."""

    def _check_token(self, join_token: str) -> None:
        source = self.join_token_source
        valid = source() if source is not None else (self.policy.join_token,)
        is_valid = False
        for token in valid:  # compare with every token: the time does not tell which matched
            is_valid |= bool(token) and hmac.compare_digest(join_token.encode(), token.encode())
        if not is_valid:
            raise UnauthenticatedError("join_token: not valid for this pool")

    async def register(self, registration: Registration, join_token: str) -> WorkerRecord:
        self._check_token(join_token)
        if not registration.deployment:
            raise InvalidArgumentError("worker.deployment: required", field="worker.deployment")
        if not registration.address:
            raise InvalidArgumentError("worker.address: required", field="worker.address")
        if self.policy.role is WorkerRole.DECODE and registration.num_total_blocks <= 0:
            raise InvalidArgumentError(
                "worker.kv_layout.num_blocks: a decode worker must report its KV blocks",
                field="worker.kv_layout.num_blocks",
            )
        if registration.tokenizer is not None:
            await self._accept_tokenizer(registration.tokenizer_sha256, registration.tokenizer)
        worker_id = registration.worker_id or f"{self.policy.role.value[0]}-{uuid.uuid4().hex[:12]}"
        now = self._clock()
        previous = await self._backend.workers.get(worker_id)
        record = WorkerRecord(
            worker_id=worker_id,
            deployment=registration.deployment,
            role=self.policy.role,
            state=registration.state,
            address=registration.address,
            kv_address=registration.kv_address,
            load=WorkerLoad(num_total_blocks=registration.num_total_blocks,
                            num_free_blocks=registration.num_total_blocks),
            last_heartbeat_s=now,
            registered_s=now,
            spec=registration.spec,
        )
        await self._backend.workers.upsert(record, self.policy.record_ttl_s)
        if self.policy.role is WorkerRole.DECODE:
            await self._backend.tickets.set_capacity(
                worker_id, registration.num_total_blocks, self._view(record))
        await self._prefix_index.update(registration.deployment, worker_id, (), (), is_full=True)
        await self._publish_upsert(record)
        self._record(record, previous.state if previous else None, "registered")
        logger.info("worker %s registered (%s, %s)", worker_id, record.role, record.deployment)
        return record

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatDirectives:
        try:
            return await self._heartbeat(beat)
        except UnavailableError:
            self._store_failed_s = self._clock()  # the worker spoke; the store did not listen
            raise

    async def _heartbeat(self, beat: Heartbeat) -> HeartbeatDirectives:
        expert_report = None
        if beat.expert_token_counts or beat.num_moe_layers:
            # Validated before anything changes: a malformed report refuses the whole heartbeat.
            expert_report = ExpertLoadReport(beat.worker_id, beat.num_moe_layers,
                                             np.asarray(beat.expert_token_counts))
        tokenizer_sha256 = beat.registration.tokenizer_sha256 if beat.registration else ""
        if beat.tokenizer is not None:
            self._check_token(beat.join_token)  # only members may put bundles in the store
            await self._accept_tokenizer(tokenizer_sha256, beat.tokenizer)
        record = await self._backend.workers.get(beat.worker_id)
        was_readopted = False
        if record is None or record.state is WorkerState.FAILED:
            if beat.registration is None or beat.state is WorkerState.FAILED:
                raise NotFoundError(f"worker {beat.worker_id} is not registered; register again")
            # The store lost the record (restart) or declared the worker dead while it was only
            # slow: the worker proves itself with the join token and is taken back.
            registration = replace(beat.registration, worker_id=beat.worker_id, state=beat.state)
            record = await self.register(registration, beat.join_token)
            was_readopted = True
        should_drain = False
        drop_tokens: tuple[str, ...] = ()
        drop_reasons: tuple[str, ...] = ()
        state = beat.state
        if record.state is WorkerState.DRAINING and state in (
            WorkerState.READY,
            WorkerState.LOADING,
        ):
            state, should_drain = WorkerState.DRAINING, True
        elif not is_legal(record.state, state):
            raise InvalidArgumentError(
                f"state: {record.state} -> {state} is not a legal worker transition", field="state"
            )
        if state is not record.state:
            record = await self._backend.workers.set_state(beat.worker_id, state)
            await self._describe(record)
            self._record(record, None, "reported")
        record = await self._backend.workers.heartbeat(
            beat.worker_id, beat.load, self.policy.record_ttl_s
        )
        is_described = False
        if self.policy.role is WorkerRole.DECODE and beat.held_blocks is not None:
            if beat.load.num_total_blocks > 0:
                # Reconcile first: after a store loss it re-adopts the sequences the worker holds
                # before any new ticket can reserve their blocks.
                reconciled = await self._backend.tickets.reconcile(
                    BlockReport(beat.worker_id, beat.load.num_total_blocks, dict(beat.held_blocks))
                )
                observe_ledger(record.deployment, reconciled)
                drop_tokens = reconciled.stale
                drop_reasons = tuple([await self._drop_reason(t) for t in drop_tokens])
                await self._backend.tickets.set_capacity(
                    beat.worker_id, beat.load.num_total_blocks, self._view(record))
                is_described = True
        if not is_described:
            await self._describe(record)  # its view's expiry follows the record's
        if self.policy.role is WorkerRole.PREFILL and (
            beat.added_prefix_hashes or beat.removed_prefix_hashes or beat.is_full_prefix_report
        ):
            await self._prefix_index.update(
                record.deployment, beat.worker_id, beat.added_prefix_hashes,
                beat.removed_prefix_hashes, beat.is_full_prefix_report,
            )
        if expert_report is not None:
            await self._expert_loads.append(record.deployment, self.policy.role, expert_report)
        should_send_tokenizer = bool(tokenizer_sha256) and not await (
            self._backend.tokenizers.touch(tokenizer_sha256, self.policy.record_ttl_s))
        await self._publish_upsert(record)
        if state is WorkerState.DRAINED:
            await self._retire(record)
        return HeartbeatDirectives(
            should_drain=should_drain or record.state is WorkerState.DRAINING,
            was_readopted=was_readopted,
            should_send_full_prefix_report=was_readopted,
            should_send_tokenizer=should_send_tokenizer,
            drop_tokens=drop_tokens,
            drop_reasons=drop_reasons,
        )

    async def _drop_reason(self, token: str) -> str:
        """Why the ledger no longer holds ``token`` for its worker, in the form the coordinator's
        DropTicket gives (``"<state>: <reason>"``); "" if it kept no record of the ticket (or
        the store could not say: the drop does not wait on the explanation)."""
        parsed = FencingToken.parse(token)
        try:
            ticket = await self._backend.tickets.find(parsed.ticket_id)
        except Exception:  # an explanation, not a dependency
            logger.debug("no record of dropped ticket %s", token, exc_info=True)
            return ""
        if ticket is None:
            return ""
        if ticket.token != parsed:
            return f"at attempt {ticket.token.attempt}"
        if ticket.state is TicketState.DONE:  # done, and its held blocks since released
            return "released"
        return f"{ticket.state}: {ticket.reason}" if ticket.reason else str(ticket.state)

    def _view(self, record: WorkerRecord) -> DecodeWorkerView:
        return DecodeWorkerView.of(record, self.policy.record_ttl_s)

    async def _describe(self, record: WorkerRecord) -> None:
        """A decode worker's new state, also in the view ticket opens check (beside its
        ledger), before anyone is told of it. A concurrent heartbeat may still write the state
        it read before this change; the next heartbeat writes this one again."""
        if self.policy.role is WorkerRole.DECODE:
            await self._backend.tickets.describe_worker(record.worker_id, self._view(record))

    async def _accept_tokenizer(self, tokenizer_sha256: str, bundle: TokenizerBundle) -> None:
        """Keep a worker's tokenizer bundle in the store, where routers load it by digest; it
        lives as long as a worker record (every heartbeat of a worker serving it extends it).

        A bundle already stored is only refreshed (equal digests are equal content); a new one
        must load as the routers will load it (``HfTokenizer.from_bundle``, in a thread: a large
        vocabulary takes about a second). Raises ``InvalidArgumentError`` naming the field: the
        worker's advertised digest must be the bundle's, and the bundle must load.
        """
        if tokenizer_sha256 != bundle.sha256:
            raise InvalidArgumentError(
                f"worker.tokenizer_sha256: {tokenizer_sha256!r} is not the digest of the "
                f"tokenizer sent ({bundle.sha256})", field="worker.tokenizer_sha256")
        store, ttl_s = self._backend.tokenizers, self.policy.record_ttl_s
        if await store.touch(bundle.sha256, ttl_s):
            return
        await asyncio.to_thread(HfTokenizer.from_bundle, bundle)
        await store.put(bundle, ttl_s)
        logger.info("tokenizer %s stored (%d bytes)", bundle.sha256[:12], bundle.num_bytes)

    async def deregister(self, worker_id: str) -> None:
        record = await self._backend.workers.get(worker_id)
        if record is None:
            return
        await self._remove(record, "deregistered")

    async def drain(self, worker_id: str, reason: str = "") -> WorkerRecord:
        record = await self._backend.workers.get(worker_id)
        if record is None:
            raise NotFoundError(f"worker_id: no worker {worker_id!r}", field="worker_id")
        if record.state in (WorkerState.DRAINING, WorkerState.DRAINED, WorkerState.FAILED):
            return record
        record = await self._backend.workers.set_state(worker_id, WorkerState.DRAINING)
        await self._describe(record)
        self._record(record, None, reason or "drain requested")
        await self._publish_upsert(record)
        return record

    async def list_workers(
        self, deployment: str | None = None, role: WorkerRole | None = None
    ) -> list[WorkerRecord]:
        return await self._backend.workers.list(deployment, role or self.policy.role)

    async def set_target(self, deployment: str, num_workers: int) -> int:
        if not deployment:
            raise InvalidArgumentError("deployment: required", field="deployment")
        if num_workers < 0:
            raise InvalidArgumentError("num_workers: must be >= 0", field="num_workers")
        previous = await self._backend.targets.get_target(deployment, self.policy.role) or 0
        await self._backend.targets.set_target(deployment, self.policy.role, num_workers)
        await self._backend.events.publish(
            PoolEvent(cursor="", kind=PoolEventKind.TARGET, deployment=deployment)
        )
        return previous

    async def get_target(self, deployment: str) -> int:
        return await self._backend.targets.get_target(deployment, self.policy.role) or 0

    # -- health -------------------------------------------------------------------------------

    async def check_health(self) -> list[WorkerRecord]:
        """Mark workers whose heartbeats stopped FAILED; returns them."""
        now = self._clock()
        failed = []
        records = await self._backend.workers.list(None, self.policy.role)
        observe_pool(self.policy.role, records)
        for record in records:
            if record.state in (WorkerState.FAILED, WorkerState.DRAINED):
                continue
            # A heartbeat the store could not take is not the worker's silence: count from the
            # last store failure this manager saw too (a failover can take longer than the
            # timeout; every worker would be failed the moment the store answers again).
            heard_s = max(record.last_heartbeat_s, self._store_failed_s)
            if now - heard_s > self.policy.heartbeat_timeout_s:
                failed.append(await self._fail(record, "missed heartbeats"))
        return failed

    async def _fail(self, record: WorkerRecord, reason: str) -> WorkerRecord:
        logger.warning("worker %s failed: %s", record.worker_id, reason)
        record = await self._backend.workers.set_state(record.worker_id, WorkerState.FAILED)
        await self._describe(record)
        self._record(record, None, reason)
        if self.policy.role is WorkerRole.DECODE:
            await self._backend.tickets.drop_worker(record.worker_id)
        await self._prefix_index.drop(record.deployment, record.worker_id)
        await self._publish_upsert(record)
        return record

    async def _retire(self, record: WorkerRecord) -> None:
        if self._provisioner is not None and record.worker_id in self._launched:
            self._forget(record.worker_id)
            await self._provisioner.stop(record.worker_id)
        await self._remove(record, "drained")

    async def _remove(self, record: WorkerRecord, reason: str) -> None:
        if self.policy.role is WorkerRole.DECODE:
            await self._backend.tickets.drop_worker(record.worker_id)
        await self._prefix_index.drop(record.deployment, record.worker_id)
        await self._backend.workers.remove(record.worker_id)
        await self._backend.events.publish(
            PoolEvent(cursor="", kind=PoolEventKind.REMOVED, deployment=record.deployment,
                      worker_id=record.worker_id)
        )
        self._record(record, record.state, reason)

    # -- actuation ----------------------------------------------------------------------------

    async def actuate(self, deployments: Iterable[str]) -> None:
        """Bring each deployment's pool to its target: start workers, or drain the least useful;
        replace launched workers that do not become READY in time."""
        if self._provisioner is None:
            return
        for deployment in deployments:
            target = await self._backend.targets.get_target(deployment, self.policy.role)
            if target is None:
                continue
            running = set(await self._provisioner.handles(deployment, self.policy.role.value))
            for handle in sorted(running - self._launched.keys()):
                # Started by an earlier pool manager process or another replica (containers and
                # pods outlive it): adopted, so it counts as pending until it registers and is
                # stopped once drained.
                logger.info("adopting %s worker %s of %s", self.policy.role, handle, deployment)
                self._launched[handle] = deployment
                self._launched_at[handle] = self._clock()
            records = await self._backend.workers.list(deployment, self.policy.role)
            for record in records:
                if record.state is WorkerState.READY:
                    self._launched_at.pop(record.worker_id, None)  # became ready: no deadline
            if await self._replace_unready(deployment, records):
                running = set(await self._provisioner.handles(deployment, self.policy.role.value))
                records = await self._backend.workers.list(deployment, self.policy.role)
            known = {r.worker_id for r in records}
            live = [r for r in records if r.state in (
                WorkerState.REGISTERING, WorkerState.LOADING, WorkerState.READY)]
            self._registered.update(w for w in self._launched if w in known)
            for worker_id in [w for w, d in self._launched.items()
                              if d == deployment and w not in known
                              and (w in self._registered or w not in running)]:
                # Gone without this replica seeing it leave (drained or removed, its last
                # heartbeat handled by another replica; or died before registering): not
                # pending. A drained process may still be shutting down: make sure it ends.
                self._forget(worker_id)
                if worker_id in running:
                    await self._provisioner.stop(worker_id)
            pending = [w for w, d in self._launched.items() if d == deployment and w not in known]
            num_live = len(live) + len(pending)
            for _ in range(target - num_live):
                handle = await self._provisioner.start(WorkerLaunch(
                    worker_id=f"{self.policy.role.value[0]}-{uuid.uuid4().hex[:12]}",
                    deployment=deployment, role=self.policy.role.value,
                    args=self.policy.launch_args.get(deployment, ()),
                ))
                self._launched[handle] = deployment
                self._launched_at[handle] = self._clock()
            for record in choose_drain_victims(live, num_live - target):
                await self.drain(record.worker_id, "scale down")
            for record in records:
                if record.state is WorkerState.FAILED and record.worker_id in self._launched:
                    self._forget(record.worker_id)
                    await self._provisioner.stop(record.worker_id)

    async def _replace_unready(self, deployment: str, records: list[WorkerRecord]) -> bool:
        """Stop this deployment's launched workers that are not READY ``ready_timeout_s`` after
        their launch (a hung engine, an image that cannot start): the rest of the actuation pass
        starts replacements. ``_launched_at`` holds only workers never seen READY. Returns
        whether it stopped any."""
        timeout_s = self.policy.ready_timeout_s
        if timeout_s <= 0 or self._provisioner is None:
            return False
        now = self._clock()
        by_id = {r.worker_id: r for r in records}
        stopped = False
        for worker_id, launched_s in list(self._launched_at.items()):
            record = by_id.get(worker_id)
            if (self._launched.get(worker_id) != deployment or now - launched_s < timeout_s
                    or (record is not None and record.state not in (
                        WorkerState.REGISTERING, WorkerState.LOADING))):
                continue  # not this deployment's, still in time, or leaving some other way
            logger.warning("%s worker %s not READY %.0f s after launch: replacing it",
                           self.policy.role, worker_id, timeout_s)
            self._forget(worker_id)
            await self._provisioner.stop(worker_id)
            if record is not None:
                await self._fail(record, "never became ready")
            stopped = True
        return stopped

    def _forget(self, worker_id: str) -> None:
        self._launched.pop(worker_id, None)
        self._launched_at.pop(worker_id, None)
        self._registered.discard(worker_id)

    async def run(self, stop: asyncio.Event, deployments: Iterable[str] = ()) -> None:
        """Health checks and actuation until ``stop`` is set."""
        deployments = tuple(deployments)
        next_actuation = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                await self.check_health()
                if loop.time() >= next_actuation and self._may_actuate():
                    await self.actuate(deployments)
                    next_actuation = loop.time() + self.policy.actuate_interval_s
            except Exception as exc:  # noqa: BLE001 - keep managing through store hiccups
                if isinstance(exc, UnavailableError):
                    self._store_failed_s = self._clock()
                logger.exception("pool manager pass failed")
            try:
                await asyncio.wait_for(stop.wait(), self.policy.health_interval_s)
            except TimeoutError:
                pass

    actuation_elector: LeaderElector | None = None
    """When set, only the replica holding its lease actuates (starts, drains and stops
    workers); health checks and membership run on every replica."""

    def _may_actuate(self) -> bool:
        return self.actuation_elector is None or self.actuation_elector.is_leader

    async def close(self) -> None:
        if self._provisioner is not None:
            await self._provisioner.close()

    # -- helpers ------------------------------------------------------------------------------

    async def _publish_upsert(self, record: WorkerRecord) -> None:
        await self._backend.events.publish(
            PoolEvent(cursor="", kind=PoolEventKind.UPSERTED, deployment=record.deployment,
                      worker=record, worker_id=record.worker_id)
        )

    def _record(self, record: WorkerRecord, from_state: WorkerState | None, reason: str) -> None:
        if self._lifecycle_sink is not None:
            try:
                self._lifecycle_sink.record(record, from_state, reason)
            except Exception:  # noqa: BLE001 - durable records never block serving
                logger.warning("could not record lifecycle event", exc_info=True)


def choose_drain_victims(live: list[WorkerRecord], count: int) -> list[WorkerRecord]:
    """Pure: the ``count`` workers whose loss costs least — not-yet-ready ones first, then the
    least loaded (fewest running sequences, then fewest queued prefill tokens)."""
    if count <= 0:
        return []
    order = {WorkerState.REGISTERING: 0, WorkerState.LOADING: 1, WorkerState.READY: 2}
    ranked = sorted(live, key=lambda r: (
        order[r.state], r.load.num_running_seqs, r.load.num_queued_prefill_tokens, r.worker_id))
    return ranked[:count]
