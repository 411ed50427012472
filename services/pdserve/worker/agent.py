"""The worker agent: pdserve's ticket model on one engine instance, over a runtime that schedules.

One agent per engine instance, of one role: ``PrefillAgent`` (``worker.prefill_agent``) or
``DecodeAgent`` (``worker.decode_agent``), each driving the runtime of its role
(``worker.runtime``, the engine seam). This module holds what both share:

- lifecycle and drain (``state``: REGISTERING -> LOADING -> READY -> DRAINING -> DRAINED; only a
  READY worker takes new tickets),
- the coordinator calls of each ticket, in order and off the token path (``TicketReports``),
- the expert placement in force and the routing counts for the governor,
- what heartbeats and ``GetStatus`` read (load, profile, checksums, tickets),
- the answer to the other role's calls: a prefill worker refuses ``AdmitTicket`` and ``Decode``,
  a decode worker ``Prefill``, with ``InvalidArgumentError``.

The gRPC servicer and the membership loop (``worker.process``) are adapters around it.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pdserve.common.errors import InvalidArgumentError, UnavailableError
from pdserve.common.types import FencingToken, WorkerLoad, WorkerRole, WorkerState
from pdserve.worker.experts import ExpertPlacement, take_expert_token_counts
from pdserve.worker.kv_checksums import KvChecksum
from pdserve.worker.reports import ControlPlane, NullControlPlane, TicketReports
from pdserve.worker.runtime import (
    EngineRuntime,
    PrefillResult,
    ProfilePoint,
    Sampling,
    TransferTiming,
)
from pdserve.worker.transports.base import KvReceiver
from pdserve.worker.transports.registry import TransportBackend
from pdserve.worker.transports.values import KvDestinationSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """One worker agent's settings (``worker.process`` builds it from the worker's settings)."""

    worker_id: str
    deployment: str
    role: WorkerRole
    transport: str = "tcp"
    kv_wait_timeout_s: float = 30.0
    """Decode side: longest wait for a prompt's KV when the Decode call names none."""
    # The in-house scheduler's knobs (``worker.scheduler``); a self-scheduling engine has its own.
    max_batch_size: int = 256
    """Decode side: sequences in one decode step."""
    decode_step_pause_s: float = 0.0
    """Decode side, fault injection (tests only): a pause before each decode step."""
    prefix_cache_blocks: int = 4096
    """Prefill side: prefix hashes remembered (LRU) and reported for prefix-aware routing."""
    is_prefix_cache_simulated: bool = False
    """Sim engine: cached prefix tokens are not recomputed (timing only; KV is still sent)."""
    max_prefill_stall_s: float = 10.0
    """Prefill side: once the prompt loop has not advanced for this long, queued prompts'
    leases are no longer renewed (``PrefillRuntime.progress_stall_s``)."""


TicketRow = tuple[FencingToken, int, str]
"""``(token, blocks held, phase)``: one ticket of ``GetStatus``."""


class WorkerAgent(abc.ABC):
    """What agents of both roles share. Lives on one event loop."""

    role: ClassVar[WorkerRole]

    def __init__(self, config: AgentConfig, runtime: EngineRuntime, transport: TransportBackend,
                 control: ControlPlane | None = None) -> None:
        if config.role is not self.role:
            raise InvalidArgumentError(f"a {type(self).__name__} cannot serve as a "
                                       f"{config.role} worker", field="role")
        self.config = config
        self.runtime = runtime
        self.transport = transport
        """The KV transport this worker speaks (the runtime gets it at ``start``)."""
        self.control: ControlPlane = control or NullControlPlane()
        self.state = WorkerState.REGISTERING
        self.kv_address = ""
        self._reports = TicketReports()
        self._experts = ExpertPlacement()

    # -- lifecycle ----------------------------------------------------------------------------

    @abc.abstractmethod
    async def start(self, kv_host: str = "127.0.0.1", kv_port: int = 0) -> None:
        """Start the runtime (and, on a decode worker, its KV intake on ``kv_host:kv_port``)."""

    async def close(self) -> None:
        await self._reports.close()
        await self.runtime.close()

    def begin_drain(self, reason: str = "") -> None:
        """Take no new work; the membership loop reports DRAINED once nothing is in flight."""
        if self.state in (WorkerState.REGISTERING, WorkerState.LOADING, WorkerState.READY):
            logger.info("worker %s draining: %s", self.config.worker_id, reason or "requested")
            self.state = WorkerState.DRAINING

    def _check_accepting(self) -> None:
        if self.state is not WorkerState.READY:
            raise UnavailableError(f"worker {self.config.worker_id} is {self.state}")

    # -- tickets ------------------------------------------------------------------------------

    @abc.abstractmethod
    def tickets(self) -> list[TicketRow]:
        """Every ticket this worker has work for."""

    @property
    def num_in_flight(self) -> int:
        return len(self.tickets())

    @abc.abstractmethod
    def drop(self, token: FencingToken, reason: str) -> int:
        """Drop whatever this worker has for the ticket; returns the blocks freed."""

    def admit(self, token: FencingToken, num_prompt_tokens: int,
              num_blocks: int) -> KvDestinationSpec | None:
        """Decode workers admit tickets; others refuse."""
        raise self._wrong_role()

    async def prefill(self, token: FencingToken, prompt_token_ids: list[int],
                      destination: KvDestinationSpec | None, lease_s: float,
                      request_id: str = "") -> PrefillResult:
        """Prefill workers compute prompts; others refuse."""
        raise self._wrong_role()

    async def decode(
        self, token: FencingToken, prompt_token_ids: list[int], max_tokens: int, *,
        is_local_prefill: bool = False, num_blocks: int = 0,
        kv_wait_timeout_s: float | None = None, request_id: str = "",
        sampling: Sampling | None = None,
    ) -> AsyncIterator[tuple[list[int], TransferTiming | None]]:
        """Decode workers decode; others refuse."""
        raise self._wrong_role()
        yield  # an async generator, like the decode side's

    def _wrong_role(self) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"worker {self.config.worker_id} is a {self.config.role} worker", field="worker")

    # -- reports ------------------------------------------------------------------------------

    def load(self) -> WorkerLoad:
        return self.runtime.load()

    @property
    def profile(self) -> Sequence[ProfilePoint]:
        return self.runtime.profile

    @property
    def kv_checksums(self) -> Sequence[KvChecksum]:
        return self.runtime.kv_checksums

    @property
    def receiver(self) -> KvReceiver | None:
        """The KV receiver in this process (decode workers), for its refusal counters."""
        return None

    @property
    def num_refused_frames(self) -> int:
        """KV frames the receiver refused (a late or unowned write), wherever it runs."""
        if self.receiver is not None:
            return self.receiver.num_rejections
        return int(getattr(self.runtime, "num_rejections", 0))

    def prompt_tokens_by_source(self) -> dict[str, int]:
        """Prompt tokens by where their KV came from, when the engine counts them (vLLM)."""
        counts = getattr(self.runtime, "prompt_tokens_by_source", None)
        return dict(counts()) if callable(counts) else {}

    def held_blocks(self) -> dict[str, int]:
        """Blocks held per fencing token (``str(token)``), for the ledger's reconciliation;
        only decode workers hold ledger blocks."""
        return {}

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        """Prefix hashes cached and evicted since the previous report (engines with a prefix
        cache: every prefill worker, and decode workers whose engine keeps one)."""
        return [], []

    def all_prefix_hashes(self) -> list[int]:
        """Every prefix hash cached now."""
        return []

    async def renew_queued_leases(self) -> None:
        """Called on the heartbeat cadence: renew the leases of what waits here and report
        progress. Only prompts queue for an engine (prefill workers); by default, nothing."""
        return None

    # -- experts ------------------------------------------------------------------------------

    @property
    def expert_placement_version(self) -> int:
        return self._experts.version

    def apply_expert_placement(self, version: int, num_layers: int, num_slots: int,
                               slot_to_expert: list[int]) -> int:
        """``ExpertPlacement.apply`` on this worker's engine; returns the experts moved."""
        return self._experts.apply(self.runtime.expert_engine, version, num_layers, num_slots,
                                   slot_to_expert)

    def take_expert_token_counts(self) -> tuple[int, list[int]]:
        """``(num_moe_layers, flattened [layers, experts] counts)`` since the previous call."""
        return take_expert_token_counts(self.runtime.expert_engine)
