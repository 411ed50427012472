"""The live router's admission policy inside the simulator.

``pdserve.router.admission.AdmissionPolicy`` is the object the live router calls; the simulator
calls it at the same points of a request's life: ``admit`` after routing on the first attempt
(against the worker that would prefill: the chosen prefill instance, or the decode instance for
local prefill), ``dispatched`` when a prefill is sent (every attempt), ``prefill_done`` when the
prefill compute ends (or the attempt is aborted), ``finish`` when the request ends however it
ends. The worker snapshot is what a heartbeat would carry, fresh at every call (the simulator's
one router knows every queue exactly): the instance's queued prefill tokens, and the same
performance-model prior the live router computes (``router.prediction.prior_tokens_per_s``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from pdserve.router.admission import (
    AdmissionConfig,
    AdmissionOutcome,
    AdmissionPolicy,
    AdmissionRequest,
)
from pdserve.router.prediction import WorkerSnapshot, prior_tokens_per_s
from pdserve.sim.config import ClusterSpec
from pdserve.sim.state import READY, AnyInstance, DecodeInstance, PrefillInstance, SimRequest


class LiveAdmission:
    """``AdmissionPolicy`` driven by simulated requests; counts outcomes and keeps each shed
    request's outcome by trace row (``shed``)."""

    def __init__(self, config: AdmissionConfig, cluster: ClusterSpec,
                 tenants: np.ndarray | None) -> None:
        self.policy = AdmissionPolicy(config)
        self._cluster = cluster
        self._tenants = tenants
        self.outcomes: Counter[str] = Counter()
        self.shed: dict[int, AdmissionOutcome] = {}
        self._met: set[str] = set()

    def meet(self, prefills: Sequence[PrefillInstance], req: SimRequest, now: float) -> None:
        """The live router estimates every ready prefill worker's queue when it routes (the
        first estimate fixes a worker's prior rate, from the prompt being routed then): do so
        for the ready prefill instances the policy has not seen yet."""
        if len(self._met) >= len(prefills):
            return
        for pre in prefills:
            if pre.state == READY and pre.wid not in self._met:
                self._met.add(pre.wid)
                self.policy.estimated_queued_tokens(self._snapshot(pre, req.prompt, now), now)

    def _snapshot(self, inst: AnyInstance, num_tokens: int, now: float) -> WorkerSnapshot:
        cluster = self._cluster
        if isinstance(inst, DecodeInstance):
            queued = sum(req.prompt - req.prefilled for req, attempt in inst.local
                         if req.attempt == attempt)
            tp_size = cluster.tp_size
        else:
            queued = inst.queued_tokens
            tp_size = cluster.prefill_tp
        return WorkerSnapshot(inst.wid, queued, now, prior_tokens_per_s(
            cluster.model, cluster.gpu, tp_size, num_tokens))

    def admit(self, req: SimRequest, inst: AnyInstance, now: float) -> bool:
        """The live decision for ``req`` if it were prefilled on ``inst`` now; a shed request is
        remembered in ``shed``."""
        tenants = self._tenants
        tenant = "" if tenants is None else str(tenants[req.i])
        decision = self.policy.admit(AdmissionRequest(str(req.i), tenant, req.prompt),
                                     self._snapshot(inst, req.prompt, now), now)
        self.outcomes[decision.outcome.value] += 1
        if not decision.is_admitted:
            self.shed[req.i] = decision.outcome
        return decision.is_admitted

    def dispatched(self, req: SimRequest, inst: AnyInstance, now: float) -> None:
        self.policy.dispatched(str(req.i), self._snapshot(inst, req.prompt, now), now)

    def prefill_done(self, req: SimRequest, now: float, *, is_ok: bool = True) -> None:
        self.policy.prefill_done(str(req.i), now, is_ok=is_ok)

    def finish(self, req: SimRequest) -> None:
        self.policy.finish(str(req.i))
