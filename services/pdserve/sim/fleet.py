"""The simulated instances of one deployment's two pools and their lifecycle.

An instance is launched ``STARTING`` (its cold start), becomes ``READY``, and leaves by draining
(``DRAINING``: it finishes its work and takes none, then is ``GONE``) or fails (``FAILED``: its
work is lost). Every change is integrated into the usage counts first, re-keys the instance in
the candidate ``Shortlist`` and is logged as an instance event.
"""

from __future__ import annotations

from pdserve.common.types import WorkerRole
from pdserve.sim.config import SimConfig
from pdserve.sim.engine_model import InstanceModel
from pdserve.sim.recorder import Recorder
from pdserve.sim.shortlist import Shortlist
from pdserve.sim.state import (
    DRAINING,
    FAILED,
    GONE,
    READY,
    STARTING,
    AnyInstance,
    DecodeInstance,
    InstanceState,
    PrefillInstance,
)
from pdserve.sim.usage import Usage


class Fleet:
    """Both pools (``prefills``, ``decodes``: by instance number; ``by_id``: by worker id) and
    the shortlist over them."""

    def __init__(self, config: SimConfig, model: InstanceModel, usage: Usage,
                 recorder: Recorder) -> None:
        self._model = model
        self._usage = usage
        self._recorder = recorder
        cluster = config.cluster
        self._num_gpus = {WorkerRole.PREFILL: cluster.prefill_tp,
                          WorkerRole.DECODE: cluster.tp_size}
        self.prefills: list[PrefillInstance] = []
        self.decodes: list[DecodeInstance] = []
        self.by_id: dict[str, AnyInstance] = {}
        self.shortlist = Shortlist(self.prefills, self.decodes, model.block_size_tokens,
                                   config.is_shortlisted)

    def launch(self, role: WorkerRole, now: float) -> AnyInstance:
        self._usage.advance(now)
        inst: AnyInstance
        if role is WorkerRole.PREFILL:
            inst = PrefillInstance(len(self.prefills), now)
            self.prefills.append(inst)
        else:
            inst = DecodeInstance(len(self.decodes), now, self._model.num_blocks)
            self.decodes.append(inst)
        self.shortlist.add(inst)
        self.by_id[inst.wid] = inst
        self._usage.num_alive += 1
        self._usage.num_gpus_alive += self._num_gpus[inst.role]
        self._recorder.log(now, inst, "launched")
        return inst

    def make_ready(self, inst: AnyInstance, now: float) -> None:
        usage = self._usage
        usage.advance(now)
        inst.state = READY
        if isinstance(inst, DecodeInstance):
            usage.serving_blocks += inst.total
            self.shortlist.update_decode(inst)
        else:
            usage.num_prefill_ready += 1
            self.shortlist.update_prefill(inst)
        self._recorder.log(now, inst, "ready")

    def drain(self, inst: AnyInstance, now: float) -> None:
        """Stop giving ``inst`` work; it leaves once its work is done (at once if it is still
        starting)."""
        self._usage.advance(now)
        if inst.state == STARTING:
            inst.epoch += 1  # its ready event is void
            self._gone(inst, GONE, "left", now)
            return
        if inst.state != READY:
            return
        if isinstance(inst, PrefillInstance):
            self._usage.num_prefill_ready -= 1
        inst.state = DRAINING
        self.shortlist.update(inst)
        self._recorder.log(now, inst, "draining")
        self.maybe_leave(inst, now)

    def maybe_leave(self, inst: AnyInstance, now: float) -> None:
        """A draining ``inst`` leaves when nothing runs on it and nothing is assigned to it."""
        if inst.state != DRAINING or inst.busy or inst.assigned:
            return
        if isinstance(inst, PrefillInstance) and inst.queue:
            return
        self._usage.advance(now)
        self._gone(inst, GONE, "left", now)

    def fail(self, inst: AnyInstance, now: float) -> None:
        """``inst`` fails: what runs on it is void (the caller deals with its requests)."""
        self._usage.advance(now)
        inst.epoch += 1
        inst.busy = False
        self._gone(inst, FAILED, "failed", now)

    def _gone(self, inst: AnyInstance, state: InstanceState, event: str,
              now: float) -> None:
        usage = self._usage
        was_serving = inst.state in (READY, DRAINING)
        if isinstance(inst, DecodeInstance) and was_serving:
            usage.serving_blocks -= inst.total
        if isinstance(inst, PrefillInstance) and inst.state == READY:
            usage.num_prefill_ready -= 1
        inst.state = state
        usage.num_alive -= 1
        usage.num_gpus_alive -= self._num_gpus[inst.role]
        self.shortlist.update(inst)
        self._recorder.log(now, inst, event)

    def counts(self) -> tuple[int, int, int, int, int, int]:
        """Ready, starting and draining instances of the prefill pool, then the decode pool."""
        p_states = [inst.state for inst in self.prefills]
        d_states = [inst.state for inst in self.decodes]
        return (p_states.count(READY), p_states.count(STARTING), p_states.count(DRAINING),
                d_states.count(READY), d_states.count(STARTING), d_states.count(DRAINING))

    def has_live_decode(self) -> bool:
        """Some decode instance serves or will (ready or starting)."""
        return any(d.state in (STARTING, READY) for d in self.decodes)

    def serving_decodes(self) -> list[DecodeInstance]:
        return [d for d in self.decodes if d.state in (READY, DRAINING)]
