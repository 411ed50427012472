"""The capacity governor's live loop: every interval, for each deployment, observe -> decide ->
record -> actuate.

- **Observe** (from the hot-state store, nothing the data path has to do for it):
  pool sizes and states from the worker records (``READY`` serve; ``REGISTERING``/``LOADING``
  are starting; ``DRAINING`` are leaving); decode utilisation = KV blocks in use / total over
  ready decode workers (from heartbeats); prefill utilisation = share of ready prefill workers
  with work at their last heartbeat (queued prompt tokens or running prompts), a snapshot sample
  of the busy fraction; queued prompt tokens summed over prefill workers.
  **Arrival rate**: the transfer tickets the router opened in the interval (every request opens
  one, local prefill included; retries open more, so requests are counted by distinct
  ``request_id``). It is the least invasive real signal: the tickets are in the store already
  (``TicketLedger.list_tickets``; a ticket stays readable ``ticket_retention_s``, 600 s by
  default, after its blocks are free, which must exceed the interval), and no service had to
  change to provide it. The prompt lengths' first three moments come from the same tickets.
  **Mean output length** is not in the store; Little's law on the decode pool estimates it:
  ``running sequences = arrival rate x output tokens x step time`` (step time from the
  performance model at the observed batch), smoothed, starting from ``default_output_tokens``;
  the outputs' spread is not observed (sizing takes none). SLO attainment is the
  latest per-window aggregate the routers write to the durable store (1.0 without one).
- **Decide**: the deployment's ``ScalingPolicy`` (``autoscaler.Autoscaler``): pure, the same
  object the simulator runs.
- **Record**: one ``ScalingDecisionRecord`` per pool in the durable store, with the inputs and
  the forecast (the ``forecast_*`` and ``headroom_*`` inputs), written from a thread
  (``asyncio.to_thread``) so the event loop never waits on Postgres. A failed write is logged;
  the loop carries on (serving does not depend on the durable store).
- **Local-prefill threshold** (``governor.thresholds``, when given): the planner's threshold
  for the interval's demand (its prompt lengths) and the ready pools, published to the routers
  unless an operator pinned one, and recorded with its inputs.
- **Plan by replay** (``live_plan``, when given; its own period, ``LivePlanConfig.interval_s``):
  the recent window of observed requests becomes a trace, and the planner's plan for it is
  replayed on it through the simulator and grown until the replay meets the SLO percentile, as
  ``pdserve plan --trace`` does (``governor.live_plan``). It runs in a thread, off the event loop,
  between autoscaling passes; each plan is recorded in the durable store
  (``CapacityPlanRecord``, its window and SLO as inputs) and is what ``GetPlan`` reports as the
  replayed plan beside the autoscaler's. It advises; the autoscaler still sets the targets.
- **Actuate** unless the controls say dry run: set each pool's target size through a
  ``TargetSetter`` (the pool managers' ``SetTargetSize`` RPC, or the in-process managers of
  ``pdserve up``). The pool managers start instances through their provisioner and choose
  which ones to drain; scale-down is always a drain.

Operator controls (``SetAutoscalerControls``) are kept with the deployment's durable record
(``config["autoscaler_controls"]``) so that a restarted governor keeps a freeze, a dry run or an
override. One governor replica acts at a time (active/standby is the reliability work's job).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import grpc

from pdserve.api.v1 import pool_pb2, pool_pb2_grpc
from pdserve.capacity.autoscaler import Autoscaler
from pdserve.capacity.controls import AutoscalerConfig, AutoscalerControls
from pdserve.capacity.local_prefill import ThresholdInputs
from pdserve.capacity.plan_inputs import InstanceShape, Slo
from pdserve.capacity.scaling import (
    PoolObservation,
    ScalingDecision,
    ScalingObservation,
    ScalingPolicy,
)
from pdserve.capacity.sizing import InstanceProfile
from pdserve.common.convert import role_to_pb
from pdserve.common.errors import InvalidArgumentError, NotFoundError
from pdserve.common.grpc_client import error_from_rpc_error
from pdserve.common.types import Clock, Ticket, WorkerRecord, WorkerRole, WorkerState
from pdserve.db.records import (
    CapacityPlanRecord,
    DeploymentRecord,
    ScalingAction,
    ScalingDecisionRecord,
)
from pdserve.db.repository import Repository
from pdserve.governor import live_plan
from pdserve.governor.metrics import DECISIONS, TARGETS
from pdserve.governor.thresholds import DeploymentRef, ThresholdGovernor
from pdserve.state.interfaces import StateBackend

logger = logging.getLogger(__name__)

CONTROLS_KEY = "autoscaler_controls"
"""Key of the operator controls in ``DeploymentRecord.config``."""

_FORECAST_PREFIXES = ("forecast_", "headroom_")
_STARTING = (WorkerState.REGISTERING, WorkerState.LOADING)


class TargetSetter(Protocol):
    """Sets the target size of one pool of one deployment (the pool managers actuate it)."""

    async def set_target(self, deployment: str, role: WorkerRole, num_workers: int) -> None: ...


class PoolManagerLike(Protocol):
    async def set_target(self, deployment: str, num_workers: int) -> int: ...


class ManagerTargetSetter:
    """In-process pool managers (``pdserve up``), by role."""

    def __init__(self, managers: Mapping[WorkerRole, PoolManagerLike]) -> None:
        self._managers = dict(managers)

    async def set_target(self, deployment: str, role: WorkerRole, num_workers: int) -> None:
        await self._managers[role].set_target(deployment, num_workers)


class GrpcTargetSetter:
    """The pool managers' ``SetTargetSize`` RPC, one channel per role, with a deadline."""

    def __init__(self, channels: Mapping[WorkerRole, grpc.aio.Channel],
                 timeout_s: float = 5.0) -> None:
        self._stubs = {role: pool_pb2_grpc.PoolServiceStub(channel)
                       for role, channel in channels.items()}
        self._timeout_s = timeout_s

    async def set_target(self, deployment: str, role: WorkerRole, num_workers: int) -> None:
        try:
            await self._stubs[role].SetTargetSize(pool_pb2.SetTargetSizeRequest(
                deployment=deployment, role=role_to_pb(role), num_workers=num_workers,
                set_by="governor"), timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """A deployment the governor sizes: its name, what one instance can do, and the look-ahead
    (``cold_start_s``: launch to serving, on the governor's clock)."""

    name: str
    model: str
    gpu: str
    profile: InstanceProfile
    cold_start_s: float
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    """How the loop runs. ``history_intervals``: arrival rates handed to the policy;
    ``output_smoothing``: weight of a new Little's-law estimate of the mean output length."""

    interval_s: float = 30.0
    history_intervals: int = 120
    default_output_tokens: float = 256.0
    output_smoothing: float = 0.3
    max_decisions_in_memory: int = 1000


@dataclass(frozen=True, slots=True)
class LivePlanConfig:
    """The governor's plans by replay: every ``interval_s``, the requests of the last
    ``window_s`` (at most the store's ticket retention, 600 s by default: older tickets are
    gone) planned against ``slo`` (wall-clock seconds) and replayed, at most ``max_replays``
    replays or ``time_budget_s`` seconds of replay per deployment."""

    slo: Slo
    interval_s: float = 300.0
    window_s: float = 600.0
    max_replays: int = 8
    time_budget_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "window_s", "time_budget_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name}: must be > 0, got {getattr(self, name)}",
                                           field=name)
        if self.max_replays < 1:
            raise InvalidArgumentError(f"max_replays: must be >= 1, got {self.max_replays}",
                                       field="max_replays")


@dataclass(frozen=True, slots=True)
class DemandSample:
    """What the store says about one interval's demand."""

    num_requests: int
    mean_prompt_tokens: float | None
    prompt_tokens: tuple[int, ...] = ()
    """The prompt length of each request counted."""

    @property
    def mean_squared_prompt_tokens(self) -> float:
        """Mean of the squared prompt lengths (0 when nothing was counted)."""
        prompts = self.prompt_tokens
        return sum(p * p for p in prompts) / len(prompts) if prompts else 0.0

    @property
    def mean_cubed_prompt_tokens(self) -> float:
        """Mean of the cubed prompt lengths (0 when nothing was counted)."""
        prompts = self.prompt_tokens
        return sum(p * p * p for p in prompts) / len(prompts) if prompts else 0.0


def demand_in_window(tickets: Sequence[Ticket], deployment: str, start_s: float, end_s: float,
                     already_counted: set[str]) -> tuple[DemandSample, set[str]]:
    """Requests of ``deployment`` whose first ticket in the store was opened in ``(start_s,
    end_s]``, counted once by request id (a retry opens a new ticket with the same id; ids
    in ``already_counted``, the previous window's, are skipped). Returns the sample and the ids
    counted now."""
    counted: set[str] = set()
    prompts: list[int] = []
    for ticket in tickets:
        if ticket.deployment != deployment or not start_s < ticket.created_s <= end_s:
            continue
        request_id = ticket.request_id or str(ticket.token)
        if request_id in counted or request_id in already_counted:
            continue
        counted.add(request_id)
        prompts.append(ticket.num_prompt_tokens)
    prompt_tokens = sum(prompts)
    mean = prompt_tokens / len(counted) if counted and prompt_tokens else None
    return DemandSample(len(counted), mean, tuple(prompts)), counted


def observe_pool(records: Sequence[WorkerRecord], role: WorkerRole) -> PoolObservation:
    """A pool as its worker records show it (see the module docstring for the utilisation)."""
    pool = [r for r in records if r.role is role]
    ready = [r for r in pool if r.state is WorkerState.READY]
    if role is WorkerRole.DECODE:
        total = sum(r.load.num_total_blocks for r in ready)
        free = sum(r.load.num_free_blocks for r in ready)
        utilization = (total - free) / total if total else 0.0
    else:
        busy = sum(1 for r in ready
                   if r.load.num_queued_prefill_tokens > 0 or r.load.num_running_seqs > 0)
        utilization = busy / len(ready) if ready else 0.0
    return PoolObservation(
        num_ready=len(ready),
        num_starting=sum(1 for r in pool if r.state in _STARTING),
        num_draining=sum(1 for r in pool if r.state is WorkerState.DRAINING),
        utilization=min(1.0, max(0.0, utilization)),
        num_queued_tokens=(sum(r.load.num_queued_prefill_tokens for r in pool)
                           if role is WorkerRole.PREFILL else 0),
    )


def estimate_mean_output_tokens(profile: InstanceProfile, num_running_seqs: int,
                                num_decode_ready: int, arrival_rate_per_s: float,
                                mean_prompt_tokens: float) -> float | None:
    """Little's law on the decode pool: a request holds a batch slot for ``output x step``
    seconds, so ``running = rate x output x step(batch, context)``. The step depends on the
    context, which depends on the output: two fixed-point passes settle it. None when the pool
    is idle or nothing arrived (no information)."""
    if num_running_seqs <= 0 or num_decode_ready <= 0 or arrival_rate_per_s <= 0:
        return None
    batch = max(1, math.ceil(num_running_seqs / num_decode_ready))
    output = 256.0
    for _ in range(2):
        context = mean_prompt_tokens + output / 2.0
        step_s = (profile.decode_perf.decode_step_time_s(batch, math.ceil(batch * context))
                  / profile.speedup)
        output = num_running_seqs / (arrival_rate_per_s * step_s)
    return max(1.0, output)


@dataclass(slots=True)
class _Deployment:
    """The loop's memory of one deployment."""

    spec: DeploymentSpec
    policy: ScalingPolicy
    controls: AutoscalerControls
    rates: deque[float]
    last_observed_s: float | None = None
    counted_ids: set[str] = field(default_factory=set)
    mean_prompt_tokens: float = 0.0
    mean_squared_prompt_tokens: float = 0.0
    mean_cubed_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    latest: ScalingDecision | None = None
    latest_at_s: float = 0.0
    decisions: deque[ScalingDecisionRecord] = field(default_factory=deque)
    window: DemandSample = DemandSample(0, None)
    """The latest interval's demand (the local-prefill threshold reads its prompt lengths)."""
    replayed_plan: CapacityPlanRecord | None = None
    """The latest plan by replay of the observed window this process made."""


class CapacityGovernor:
    """Runs one ``Autoscaler`` per deployment against the live pools.

    ``repository`` None keeps decisions in memory only (bounded); ``target_setter`` None never
    actuates (every decision is then a recommendation, recorded as a dry run). ``policies``
    replaces the ``Autoscaler`` of a deployment by another ``ScalingPolicy``. ``thresholds``
    computes and publishes the local-prefill threshold on each pass (None: it is not).
    ``live_plan`` plans each deployment's observed window by replay on its own period (None:
    it does not). ``clock`` is wall-clock seconds, the coordinator's (ticket times are compared
    with it).
    """

    def __init__(self, deployments: Sequence[DeploymentSpec], backend: StateBackend, *,
                 clock: Clock, target_setter: TargetSetter | None = None,
                 repository: Repository | None = None,
                 config: GovernorConfig = GovernorConfig(),
                 controls: AutoscalerControls | None = None,
                 autoscaler_config: AutoscalerConfig | None = None,
                 policies: Mapping[str, ScalingPolicy] | None = None,
                 thresholds: ThresholdGovernor | None = None,
                 live_plan: LivePlanConfig | None = None) -> None:
        self._backend = backend
        self.thresholds = thresholds
        self.live_plan = live_plan
        self._clock = clock
        self.target_setter = target_setter
        self._repository = repository
        self.config = config
        self._deployments: dict[str, _Deployment] = {}
        controls = controls or AutoscalerControls()
        for spec in deployments:
            policy = (policies or {}).get(spec.name) or Autoscaler(
                spec.profile, autoscaler_config or AutoscalerConfig(), controls)
            self._deployments[spec.name] = _Deployment(
                spec=spec, policy=policy, controls=controls,
                rates=deque(maxlen=config.history_intervals),
                mean_output_tokens=config.default_output_tokens,
                decisions=deque(maxlen=config.max_decisions_in_memory))

    @property
    def deployments(self) -> tuple[str, ...]:
        return tuple(self._deployments)

    def _get(self, deployment: str) -> _Deployment:
        if not deployment:
            raise InvalidArgumentError("deployment: required", field="deployment")
        state = self._deployments.get(deployment)
        if state is None:
            raise NotFoundError(f"deployment: the governor does not size {deployment!r} "
                                f"(it sizes {', '.join(self._deployments) or 'none'})",
                                field="deployment")
        return state

    # -- operator controls ------------------------------------------------------------------

    def controls(self, deployment: str) -> AutoscalerControls:
        return self._get(deployment).controls

    async def set_controls(self, deployment: str, controls: AutoscalerControls) -> None:
        """Check, apply and keep the controls (``InvalidArgumentError`` names a bad field)."""
        state = self._get(deployment)
        controls.check(state.spec.profile)
        setter = getattr(state.policy, "set_controls", None)
        if setter is not None:
            setter(controls)
        state.controls = controls
        if self._repository is not None:
            await asyncio.to_thread(self._store_controls, state.spec, controls)

    def _store_controls(self, spec: DeploymentSpec, controls: AutoscalerControls) -> None:
        assert self._repository is not None
        record = self._repository.get_deployment(spec.name) or DeploymentRecord(
            name=spec.name, model=spec.model, gpu=spec.gpu, tp_size=spec.tp_size)
        config = {**record.config, CONTROLS_KEY: controls.as_dict()}
        self._repository.upsert_deployment(replace(record, config=config, created_at=None,
                                                   updated_at=None))

    async def load_controls(self) -> None:
        """Take up the controls kept in the durable store (at start-up)."""
        if self._repository is None:
            return
        for name, state in self._deployments.items():
            try:
                record = await asyncio.to_thread(self._repository.get_deployment, name)
            except Exception:  # start with the defaults; say why
                logger.warning("could not read the controls of %s", name, exc_info=True)
                continue
            if record is None or CONTROLS_KEY not in record.config:
                continue
            try:
                controls = AutoscalerControls.from_dict(record.config[CONTROLS_KEY])
                controls.check(state.spec.profile)
            except (InvalidArgumentError, KeyError, TypeError, ValueError):
                logger.warning("ignoring malformed stored controls of %s", name, exc_info=True)
                continue
            setter = getattr(state.policy, "set_controls", None)
            if setter is not None:
                setter(controls)
            state.controls = controls

    # -- the loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """``step`` every ``interval_s`` (and, with ``live_plan``, ``plan_step`` every
        ``live_plan.interval_s`` beside it) until ``stop`` is set. A scaling pass under way
        finishes; a plan under way is abandoned (it only advises, and may simulate for
        seconds more)."""
        await self.load_controls()
        plans = None
        if self.live_plan is not None:
            plans = asyncio.create_task(self._every(stop, self.live_plan.interval_s,
                                                    self.plan_step, "plan by replay"))
        try:
            await self._every(stop, self.config.interval_s, self.step, "governor pass")
        finally:
            if plans is not None:
                plans.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await plans

    @staticmethod
    async def _every(stop: asyncio.Event, interval_s: float,
                     step: Callable[[], Awaitable[object]], what: str) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
            if stop.is_set():
                return
            try:
                await step()
            except Exception:  # keep governing through store hiccups
                logger.exception("%s failed", what)

    async def plan_step(self) -> dict[str, CapacityPlanRecord]:
        """Plan each deployment's observed window by replay (``live_plan``); returns the
        plans made (a deployment with too few requests in the window gets none)."""
        config = self.live_plan
        if config is None:
            return {}
        now_s = self._clock()
        tickets = await self._backend.tickets.list_tickets()
        plans = {}
        for name, state in self._deployments.items():
            spec = state.spec
            try:
                window = await asyncio.to_thread(
                    live_plan.plan_observed_window, tickets, name, now_s - config.window_s,
                    now_s, mean_output_tokens=state.mean_output_tokens, slo=config.slo,
                    shapes=[InstanceShape(spec.model, spec.gpu, spec.tp_size)],
                    speedup=spec.profile.speedup, max_replays=config.max_replays,
                    time_budget_s=config.time_budget_s)
                if window is None:
                    continue
                record = live_plan.plan_record(name, window, now_s - config.window_s, now_s,
                                               now_s)
            except Exception:  # one deployment's failure spares the others
                logger.exception("planning %s by replay failed", name)
                continue
            state.replayed_plan = plans[name] = record
            if self._repository is not None:
                try:
                    await asyncio.to_thread(self._repository.record_capacity_plan, record)
                except Exception:  # the plan still stands in memory
                    logger.warning("could not record the replayed plan of %s", name,
                                   exc_info=True)
        return plans

    async def step(self) -> dict[str, ScalingDecision]:
        """One pass over every deployment; returns the decisions made."""
        now_s = self._clock()
        tickets = await self._backend.tickets.list_tickets()
        decisions = {}
        for name, state in self._deployments.items():
            try:
                decisions[name] = await self._step_one(state, tickets, now_s)
            except Exception:  # one deployment's failure spares the others
                logger.exception("governing %s failed", name)
        return decisions

    async def _step_one(self, state: _Deployment, tickets: Sequence[Ticket],
                        now_s: float) -> ScalingDecision:
        observation = await self._observe(state, tickets, now_s)
        decision = state.policy.decide(observation)
        is_dry_run = state.controls.is_dry_run or self.target_setter is None
        previous = {role: await self._backend.targets.get_target(state.spec.name, role)
                    for role in WorkerRole}
        records = self._records(state.spec.name, observation, decision, previous, is_dry_run,
                                now_s)
        state.latest, state.latest_at_s = decision, now_s
        for record in records:
            state.decisions.append(record)
            DECISIONS.labels(record.deployment, record.role, record.action,
                             str(record.is_dry_run).lower()).inc()
            TARGETS.labels(record.deployment, record.role).set(record.num_target_instances)
        if self._repository is not None:
            for record in records:
                try:
                    await asyncio.to_thread(self._repository.record_scaling_decision, record)
                except Exception:  # the decision still stands
                    logger.warning("could not record a scaling decision of %s",
                                   state.spec.name, exc_info=True)
        if not is_dry_run:
            assert self.target_setter is not None
            for role, target in ((WorkerRole.PREFILL, decision.num_prefill),
                                 (WorkerRole.DECODE, decision.num_decode)):
                if previous[role] != target:
                    await self.target_setter.set_target(state.spec.name, role, target)
        if self.thresholds is not None:
            try:
                await self.thresholds.step(deployment_ref(state.spec),
                                           self._threshold_inputs(state, observation))
            except Exception:  # the scaling decision stands; the threshold in force stays
                logger.warning("local-prefill threshold of %s failed", state.spec.name,
                               exc_info=True)
        return decision

    def _threshold_inputs(self, state: _Deployment,
                          observation: ScalingObservation) -> ThresholdInputs:
        assert self.thresholds is not None
        spec = state.spec
        rate = observation.arrival_rates_per_s[-1] if observation.arrival_rates_per_s else 0.0
        return ThresholdInputs(
            deployment=spec.name, shape=InstanceShape(spec.model, spec.gpu, spec.tp_size),
            rate_per_s=rate, prompt_tokens=state.window.prompt_tokens,
            mean_output_tokens=state.mean_output_tokens,
            num_prefill=observation.prefill.num_ready, num_decode=observation.decode.num_ready,
            slo=self.thresholds.config.slo, speedup=spec.profile.speedup)

    async def _observe(self, state: _Deployment, tickets: Sequence[Ticket],
                       now_s: float) -> ScalingObservation:
        spec, config = state.spec, self.config
        start_s = state.last_observed_s
        if start_s is None or now_s - start_s > 10 * config.interval_s:
            start_s = now_s - config.interval_s  # first pass, or after a long stall
        elapsed_s = max(now_s - start_s, 1e-3)
        sample, state.counted_ids = demand_in_window(tickets, spec.name, start_s, now_s,
                                                     state.counted_ids)
        state.window = sample
        state.last_observed_s = now_s
        rate = sample.num_requests / elapsed_s
        state.rates.append(rate)
        if sample.mean_prompt_tokens is not None:
            state.mean_prompt_tokens = sample.mean_prompt_tokens
            state.mean_squared_prompt_tokens = sample.mean_squared_prompt_tokens
            state.mean_cubed_prompt_tokens = sample.mean_cubed_prompt_tokens
        records = await self._backend.workers.list(spec.name)
        prefill = observe_pool(records, WorkerRole.PREFILL)
        decode = observe_pool(records, WorkerRole.DECODE)
        running = sum(r.load.num_running_seqs for r in records
                      if r.role is WorkerRole.DECODE and r.state is WorkerState.READY)
        estimate = estimate_mean_output_tokens(spec.profile, running, decode.num_ready,
                                               rate, state.mean_prompt_tokens or 1.0)
        if estimate is not None:
            weight = config.output_smoothing
            state.mean_output_tokens = (1 - weight) * state.mean_output_tokens + weight * estimate
        return ScalingObservation(
            now_s=now_s, deployment=spec.name, interval_s=config.interval_s,
            arrival_rates_per_s=tuple(state.rates),
            mean_prompt_tokens=state.mean_prompt_tokens,
            mean_squared_prompt_tokens=state.mean_squared_prompt_tokens,
            mean_cubed_prompt_tokens=state.mean_cubed_prompt_tokens,
            mean_output_tokens=state.mean_output_tokens,
            prefill=prefill, decode=decode, cold_start_s=spec.cold_start_s,
            slo_attainment=await self._slo_attainment(spec.name),
        )

    async def _slo_attainment(self, deployment: str) -> float:
        if self._repository is None:
            return 1.0
        try:
            windows = await asyncio.to_thread(self._repository.list_request_windows,
                                              deployment, limit=1)
        except Exception:  # an input, not a dependency
            logger.debug("no request windows for %s", deployment, exc_info=True)
            return 1.0
        if not windows or windows[0].num_requests == 0:
            return 1.0
        window = windows[0]
        return min(1.0, window.goodput_rps * window.window_s / window.num_requests)

    def _records(self, deployment: str, observation: ScalingObservation,
                 decision: ScalingDecision, previous: Mapping[WorkerRole, int | None],
                 is_dry_run: bool, now_s: float) -> list[ScalingDecisionRecord]:
        at = datetime.fromtimestamp(now_s, UTC)
        inputs: dict[str, Any] = {}
        forecast: dict[str, Any] = {}
        for key, value in decision.inputs.items():
            (forecast if key.startswith(_FORECAST_PREFIXES) else inputs)[key] = value
        inputs["decision_reason"] = decision.reason
        records = []
        for role, pool, target in (
                (WorkerRole.PREFILL, observation.prefill, decision.num_prefill),
                (WorkerRole.DECODE, observation.decode, decision.num_decode)):
            current = pool.num_ready + pool.num_starting
            last_target = previous[role]
            before = last_target if last_target is not None else current
            action = (ScalingAction.SCALE_UP if target > before
                      else ScalingAction.SCALE_DOWN if target < before else ScalingAction.HOLD)
            reason = str(decision.inputs.get(f"{role.value}_reason", decision.reason))
            records.append(ScalingDecisionRecord(
                deployment=deployment, role=role, num_current_instances=current,
                num_target_instances=target, action=action, reason=reason,
                is_dry_run=is_dry_run, inputs=inputs, forecast=forecast, at=at))
        return records

    # -- queries ----------------------------------------------------------------------------

    async def list_decisions(self, deployment: str, *, role: WorkerRole | None = None,
                             limit: int = 100) -> list[ScalingDecisionRecord]:
        """Newest first: from the durable store when there is one, else from memory."""
        state = self._get(deployment)
        if self._repository is not None:
            return await asyncio.to_thread(self._repository.list_scaling_decisions, deployment,
                                           limit, role=role)
        kept = [r for r in reversed(state.decisions) if role is None or r.role is role]
        return kept[:limit]

    async def latest(self, deployment: str) -> tuple[ScalingDecision | None, float,
                                                     tuple[ScalingDecisionRecord, ...]]:
        """The plan in force: the latest decision this process made (with its time), or else
        the latest stored decision of each pool."""
        state = self._get(deployment)
        if state.latest is not None:
            return state.latest, state.latest_at_s, ()
        stored: list[ScalingDecisionRecord] = []
        if self._repository is not None:
            for role in WorkerRole:
                found = await asyncio.to_thread(self._repository.list_scaling_decisions,
                                                deployment, 1, role=role)
                stored.extend(found)
        return None, 0.0, tuple(stored)

    async def latest_replayed_plan(self, deployment: str) -> CapacityPlanRecord | None:
        """The latest plan by replay of the observed window: this process's, or else the
        durable store's latest (None: none made yet)."""
        state = self._get(deployment)
        if state.replayed_plan is not None or self._repository is None:
            return state.replayed_plan
        stored = await asyncio.to_thread(self._repository.latest_capacity_plan, deployment)
        if stored is None or stored.outputs.get("source") != live_plan.SOURCE:
            return None
        return stored

    def spec(self, deployment: str) -> DeploymentSpec:
        return self._get(deployment).spec


def deployment_ref(spec: DeploymentSpec) -> DeploymentRef:
    return DeploymentRef(spec.name, spec.model, spec.gpu, spec.tp_size)
