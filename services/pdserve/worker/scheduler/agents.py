"""Agents over the in-house runtime, built by role: what ``pdserve serve worker`` runs for the
``sim`` and ``tiny`` engines.

``create_agent`` pairs the agent of the configured role with its in-house scheduler. The agents
it returns also expose that runtime's parts (the engine, its block allocator, the decode side's
block owner table), which tests and benches inspect; an agent over a self-scheduling engine has
none of these in this process.
"""

from __future__ import annotations

from pdserve.common.types import WorkerRole
from pdserve.worker.agent import AgentConfig, WorkerAgent
from pdserve.worker.decode_agent import DecodeAgent
from pdserve.worker.engine import BlockAllocator, Engine
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.prefill_agent import PrefillAgent
from pdserve.worker.reports import ControlPlane
from pdserve.worker.scheduler.decode import DecodeScheduler
from pdserve.worker.scheduler.engine_thread import EngineScheduler
from pdserve.worker.scheduler.prefill import PrefillScheduler
from pdserve.worker.transports.registry import TransportBackend


class _SchedulerParts:
    """The in-house runtime's engine and block allocator, in reach from its agent."""

    runtime: EngineScheduler

    @property
    def engine(self) -> Engine:
        return self.runtime.engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        """Replace the engine from the next prompt or step on (same KV layout and cache)."""
        self.runtime.engine = engine

    @property
    def allocator(self) -> BlockAllocator:
        return self.runtime.allocator


class ScheduledPrefillAgent(_SchedulerParts, PrefillAgent):
    """A ``PrefillAgent`` over the in-house ``PrefillScheduler``."""

    runtime: PrefillScheduler


class ScheduledDecodeAgent(_SchedulerParts, DecodeAgent):
    """A ``DecodeAgent`` over the in-house ``DecodeScheduler``."""

    runtime: DecodeScheduler

    @property
    def owners(self) -> BlockOwnerTable:
        return self.runtime.landing.owners


def create_agent(config: AgentConfig, engine: Engine, transport: TransportBackend,
                 control: ControlPlane | None = None) -> WorkerAgent:
    """The agent of ``config.role`` over the in-house scheduler of ``engine``."""
    if config.role is WorkerRole.DECODE:
        decode = DecodeScheduler(engine, max_batch_size=config.max_batch_size,
                                 step_pause_s=config.decode_step_pause_s)
        return ScheduledDecodeAgent(config, decode, transport, control)
    prefill = PrefillScheduler(engine, prefix_cache_blocks=config.prefix_cache_blocks,
                               is_prefix_cache_simulated=config.is_prefix_cache_simulated)
    return ScheduledPrefillAgent(config, prefill, transport, control)
