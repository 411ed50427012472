"""The prefill side's agent: takes a ticket's prompt, hands it to the runtime, keeps its lease.

``prefill`` checks the prompt against the destination (shape, block count), registers the ticket
and awaits the runtime, which queues the prompt, computes it and ships each layer to the
destination as it is ready (``PrefillRuntime.prefill``). While the prompt waits (``QUEUED``) this
side renews the ticket's lease on the heartbeat cadence; once it runs, the same cadence reports
PREFILLING and TRANSFERRING to the coordinator (``renew_queued_leases``). The decode side reports
DONE when the KV has landed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import FencingToken, TicketState, WorkerRole
from pdserve.worker.agent import AgentConfig, TicketRow, WorkerAgent
from pdserve.worker.reports import ControlPlane
from pdserve.worker.runtime import PrefillPhase, PrefillResult, PrefillRuntime, PrefillTicket
from pdserve.worker.transports.registry import TransportBackend
from pdserve.worker.transports.values import KvDestinationSpec

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _PromptInFlight:
    ticket: PrefillTicket
    lease_s: float
    reported_state: TicketState | None = None
    """The progress last reported to the coordinator (each state is reported once)."""


class PrefillAgent(WorkerAgent):
    """Prefill worker: computes prompts and sends their KV to the decode side."""

    role = WorkerRole.PREFILL
    runtime: PrefillRuntime

    def __init__(self, config: AgentConfig, runtime: PrefillRuntime, transport: TransportBackend,
                 control: ControlPlane | None = None) -> None:
        super().__init__(config, runtime, transport, control)
        self._prompts: dict[str, _PromptInFlight] = {}
        self._is_stalled = False

    async def start(self, kv_host: str = "127.0.0.1", kv_port: int = 0) -> None:
        """Start the runtime; a prefill worker receives no KV (``kv_address`` stays empty)."""
        await self.runtime.start(self.transport)

    async def prefill(self, token: FencingToken, prompt_token_ids: list[int],
                      destination: KvDestinationSpec | None, lease_s: float,
                      request_id: str = "") -> PrefillResult:
        """Queue, compute and ship a prompt; returns (first token, timing, cached prompt tokens).
        ``destination`` None: the decode side publishes it later at the coordinator's
        rendezvous (only a runtime that ``takes_late_destinations`` accepts that)."""
        self._check_accepting()
        if not prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids: empty", field="prompt_token_ids")
        if destination is None:
            if not self.runtime.takes_late_destinations:
                raise InvalidArgumentError(
                    "destination: required (this worker's engine does not use the rendezvous)",
                    field="destination")
        else:
            self._check_destination(destination, len(prompt_token_ids))
        key = str(token)
        if key in self._prompts:
            raise InvalidArgumentError(f"token: ticket {key} is already queued", field="token")
        ticket = PrefillTicket(token, list(prompt_token_ids), destination, request_id)
        prompt = _PromptInFlight(ticket, lease_s)
        self._prompts[key] = prompt
        try:
            return await self.runtime.prefill(ticket)
        finally:
            if self._prompts.get(key) is prompt:
                del self._prompts[key]

    def _check_destination(self, destination: KvDestinationSpec, num_prompt_tokens: int) -> None:
        layout = self.runtime.layout
        if destination.layout.num_layers != layout.num_layers or (
            destination.layout.block_size_tokens != layout.block_size_tokens
            or destination.layout.block_nbytes != layout.block_nbytes
        ):
            raise InvalidArgumentError(
                f"destination.kv_layout: {destination.layout} does not match this worker's "
                f"{layout}", field="destination.kv_layout")
        if self.runtime.takes_late_destinations:
            return  # the engine's connector checks the blocks against its own placement
        if len(destination.block_ids) != layout.num_blocks_for(num_prompt_tokens):
            raise InvalidArgumentError(
                f"destination.block_ids: {len(destination.block_ids)} blocks for "
                f"{num_prompt_tokens} tokens", field="destination.block_ids")

    async def renew_queued_leases(self) -> None:
        """Called periodically (the heartbeat cadence): renew the leases of queued prompts (the
        waiting side renews) and report the progress of prompts in flight. While the prompt
        loop has not advanced for ``max_prefill_stall_s`` nothing is renewed: the heartbeat
        runs on its own task and would otherwise keep a hung loop's queue alive forever, where
        the lapsed leases let the coordinator expire the tickets and the router retry them.

        Progress is reported here rather than as it happens, so a prompt that goes from queue to
        landed between two calls costs the coordinator nothing but the decode side's DONE; only
        long prefills and transfers show PREFILLING / TRANSFERRING in the ticket's history.
        """
        stall_s = self.runtime.progress_stall_s()
        is_stalled = stall_s > self.config.max_prefill_stall_s
        if is_stalled != self._is_stalled:
            self._is_stalled = is_stalled
            num_queued = sum(p.ticket.phase is PrefillPhase.QUEUED
                             for p in self._prompts.values())
            if is_stalled:
                logger.warning("prefill loop stalled for %.1f s (bound %.1f s): the leases of "
                               "%d queued prompts are no longer renewed", stall_s,
                               self.config.max_prefill_stall_s, num_queued)
            else:
                logger.warning("prefill loop advances again; renewing queued leases")
        for prompt in list(self._prompts.values()):
            ticket = prompt.ticket
            if ticket.phase is PrefillPhase.QUEUED:
                if not is_stalled:  # a hung loop must not keep its queue's tickets alive
                    self._reports.send(ticket.token,
                                       self.control.renew(ticket.token, prompt.lease_s))
                continue
            state = (TicketState.PREFILLING if ticket.phase is PrefillPhase.PREFILLING
                     else TicketState.TRANSFERRING)
            if prompt.reported_state is not state:
                prompt.reported_state = state
                self._reports.send(ticket.token, self.control.report(ticket.token, state, None))

    def drop(self, token: FencingToken, reason: str) -> int:
        """Stop the ticket's prompt (dequeued, or stopped before its next layer); frees no
        ledger blocks (those are the decode side's), so returns 0."""
        key = str(token)
        prompt = self._prompts.get(key)
        if prompt is None:
            return 0
        if prompt.ticket.phase is PrefillPhase.QUEUED:
            del self._prompts[key]
        self.runtime.abort(token, reason)
        return 0

    def tickets(self) -> list[TicketRow]:
        return [(p.ticket.token, 0, p.ticket.phase) for p in self._prompts.values()]

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        return self.runtime.take_prefix_delta()

    def all_prefix_hashes(self) -> list[int]:
        return self.runtime.all_prefix_hashes()
