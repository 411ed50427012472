"""The governor's local-prefill threshold, live: on each pass of the autoscaling loop, per
deployment, compute the threshold from what the interval showed (``capacity.local_prefill``),
put it in force for the routers unless an operator pinned one, and record the decision with its
inputs in the durable store.

- **Publish**: the threshold in force lives in the hot state (``ThresholdStore``, a version per
  deployment); routers read all of them on a short interval (``router.thresholds``). A pass
  publishes only a change, so the version moves only when the routers' decisions may. In a dry
  run (``ThresholdConfig.is_dry_run``) computed values are recorded, never published; pins are
  published all the same (an operator asked for them).
- **Pin**: ``pin`` (the ``SetLocalPrefillThreshold`` RPC) keeps the pin in the deployment's
  durable record (``config["local_prefill_pin"]``) and publishes it at once as ``pinned``; the
  hot state is then what says a pin is in force, so any governor replica may take the call and
  the active one sees it on its next pass. After a store loss (nothing published) the pass reads
  the pin from the durable record and publishes it again. Unpinning publishes the planner's
  latest value again, or clears the threshold (the routers' own setting) until the next pass
  computes one.
- **Record**: one ``ThresholdDecisionRecord`` per decision (each pass that computed a value or
  published one, and each pin or unpin; the unpin's carries the inputs of the value it
  restores), written from a thread; a failed write is logged and the
  decision stands. Without a durable store the latest decisions are kept in memory (bounded).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from pdserve.capacity.local_prefill import (
    ThresholdDecision,
    ThresholdInputs,
    compute_threshold,
    decide_threshold,
)
from pdserve.capacity.plan_inputs import Slo
from pdserve.common.types import Clock, PublishedThreshold, ThresholdSource
from pdserve.db.records import DeploymentRecord, ThresholdDecisionRecord
from pdserve.db.repository import Repository
from pdserve.state.interfaces import StateBackend

logger = logging.getLogger(__name__)

PIN_KEY = "local_prefill_pin"
"""Key of an operator's pin (``{"threshold_tokens": N}``) in ``DeploymentRecord.config``."""

MAX_DECISIONS_IN_MEMORY = 1000


@dataclass(frozen=True, slots=True)
class ThresholdConfig:
    """``slo``: the bounds the threshold is derived against (wall-clock seconds);
    ``is_dry_run``: record computed thresholds, never publish them."""

    slo: Slo
    is_dry_run: bool = False


@dataclass(frozen=True, slots=True)
class ThresholdState:
    """What ``GetLocalPrefillThreshold`` reports: the threshold in force (None: the routers use
    their own setting) and the latest decision."""

    published: PublishedThreshold | None
    latest: ThresholdDecisionRecord | None


@dataclass(frozen=True, slots=True)
class DeploymentRef:
    """What the durable pin needs to know of a deployment (its record may not exist yet)."""

    name: str
    model: str
    gpu: str
    tp_size: int


class ThresholdGovernor:
    """Computes, publishes, pins and records local-prefill thresholds (module docstring)."""

    def __init__(self, backend: StateBackend, config: ThresholdConfig, *, clock: Clock,
                 repository: Repository | None = None) -> None:
        self._store = backend.thresholds
        self.config = config
        self._clock = clock
        self._repository = repository
        self._pins: dict[str, int | None] = {}
        """The pin as this process last saw it (the durable record has the last word)."""
        self._decisions: dict[str, deque[ThresholdDecisionRecord]] = {}

    # -- the pass ---------------------------------------------------------------------------

    async def step(self, deployment: DeploymentRef,
                   inputs: ThresholdInputs) -> ThresholdDecisionRecord | None:
        """One pass for one deployment; the decision recorded, or None (nothing to decide:
        no pin and no request in the interval, so what is in force stays)."""
        published = await self._store.get(deployment.name)
        pin = await self._pin_in_force(deployment.name, published)
        computed = await asyncio.to_thread(compute_threshold, inputs)
        decision = decide_threshold(pin, computed)
        if decision is None:
            return None
        is_publishing = decision.differs_from(published) and (
            decision.source is ThresholdSource.PINNED or not self.config.is_dry_run)
        if decision.computed_tokens is None and not is_publishing:
            return None  # pinned, in force already, and nothing new computed: no decision
        if is_publishing:
            published = await self._store.publish(deployment.name, decision.threshold_tokens,
                                                  decision.source)
            logger.info("local-prefill threshold of %s: %d tokens (%s, version %d)",
                        deployment.name, decision.threshold_tokens, decision.source,
                        published.version)
        return await self._record(deployment.name, decision, computed.inputs,
                                  published if is_publishing else None)

    async def _pin_in_force(self, deployment: str,
                            published: PublishedThreshold | None) -> int | None:
        if published is not None:
            pin = published.threshold_tokens if published.source is ThresholdSource.PINNED else None
            self._pins[deployment] = pin
            return pin
        if self._repository is None:
            return self._pins.get(deployment)
        try:  # nothing in force (a store loss, or never published): the durable pin
            return await asyncio.to_thread(self._stored_pin, deployment)
        except Exception:  # noqa: BLE001 - an input: this process's last view of it
            logger.warning("could not read the pin of %s", deployment, exc_info=True)
            return self._pins.get(deployment)

    def _stored_pin(self, deployment: str) -> int | None:
        assert self._repository is not None
        record = self._repository.get_deployment(deployment)
        pin = record.config.get(PIN_KEY) if record is not None else None
        return int(pin["threshold_tokens"]) if isinstance(pin, dict) else None

    async def _record(self, deployment: str, decision: ThresholdDecision,
                      inputs: Mapping[str, Any],
                      published: PublishedThreshold | None) -> ThresholdDecisionRecord:
        record = ThresholdDecisionRecord(
            deployment=deployment, threshold_tokens=decision.threshold_tokens,
            source=decision.source, reason=decision.reason,
            computed_tokens=decision.computed_tokens, is_published=published is not None,
            version=published.version if published is not None else None,
            inputs=dict(inputs),
            at=datetime.fromtimestamp(self._clock(), UTC))
        self._decisions.setdefault(deployment, deque(maxlen=MAX_DECISIONS_IN_MEMORY)).append(
            record)
        if self._repository is not None:
            try:
                await asyncio.to_thread(self._repository.record_threshold_decision, record)
            except Exception:  # noqa: BLE001 - the decision stands
                logger.warning("could not record a threshold decision of %s", deployment,
                               exc_info=True)
        return record

    # -- operator pins ----------------------------------------------------------------------

    async def pin(self, deployment: DeploymentRef, threshold_tokens: int | None) -> ThresholdState:
        """Pin the threshold (``threshold_tokens``) or unpin it (None); see the module
        docstring. The durable write comes first: a pin that would not survive a restart is
        refused (its error propagates)."""
        name = deployment.name
        if self._repository is not None:
            await asyncio.to_thread(self._store_pin, deployment, threshold_tokens)
        self._pins[name] = threshold_tokens
        if threshold_tokens is not None:
            decision = ThresholdDecision(threshold_tokens, ThresholdSource.PINNED,
                                         "pinned by an operator", None)
            published = await self._store.publish(name, threshold_tokens, ThresholdSource.PINNED)
            await self._record(name, decision, {}, published)
            return await self.current(name)
        latest = await self._latest_computed(name)
        if latest is None or latest.computed_tokens is None or self.config.is_dry_run:
            await self._store.clear(name)
            logger.info("local-prefill threshold of %s unpinned: the routers' own setting until "
                        "the governor computes one", name)
            return await self.current(name)
        computed = latest.computed_tokens
        decision = ThresholdDecision(computed, ThresholdSource.COMPUTED,
                                     "unpinned: the planner's latest value", computed)
        published = await self._store.publish(name, computed, ThresholdSource.COMPUTED)
        await self._record(name, decision, latest.inputs, published)
        return await self.current(name)

    def _store_pin(self, deployment: DeploymentRef, threshold_tokens: int | None) -> None:
        assert self._repository is not None
        record = self._repository.get_deployment(deployment.name) or DeploymentRecord(
            name=deployment.name, model=deployment.model, gpu=deployment.gpu,
            tp_size=deployment.tp_size)
        config = {key: value for key, value in record.config.items() if key != PIN_KEY}
        if threshold_tokens is not None:
            config[PIN_KEY] = {"threshold_tokens": threshold_tokens}
        self._repository.upsert_deployment(replace(record, config=config, created_at=None,
                                                   updated_at=None))

    async def _latest_computed(self, deployment: str) -> ThresholdDecisionRecord | None:
        """The latest decision with a computed value (its inputs go with an unpin's record)."""
        for record in await self.decisions(deployment, limit=50):
            if record.computed_tokens is not None:
                return record
        return None

    # -- queries ----------------------------------------------------------------------------

    async def decisions(self, deployment: str, limit: int = 100) -> list[ThresholdDecisionRecord]:
        """Newest first: from the durable store when there is one, else from memory."""
        if self._repository is not None:
            return await asyncio.to_thread(self._repository.list_threshold_decisions,
                                           deployment, limit)
        return list(reversed(self._decisions.get(deployment, ())))[:limit]

    async def current(self, deployment: str) -> ThresholdState:
        published = await self._store.get(deployment)
        latest = await self.decisions(deployment, limit=1)
        return ThresholdState(published, latest[0] if latest else None)
