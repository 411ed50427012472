"""The decode side's agent: admits tickets, streams their tokens, reports DONE and release.

``admit`` checks a ticket's reservation against the engine's KV shape and has the runtime reserve
the blocks; the runtime makes the ticket's fencing token their owner and expects the prompt's
layers there (``DecodeRuntime.admit``), and the agent hands out the destination (or, for an engine
that picks blocks only when it schedules, none: it is published through the coordinator's
rendezvous). ``decode`` streams the runtime's tokens; the first one means the prompt's KV is in
place, so the agent reports DONE then (with the transfer's timing), and releases the ticket at
the coordinator when the stream ends. When a stream ends its blocks are free again (the ledger is
told by the release, off the token path).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.common.errors import InvalidArgumentError, StaleTokenError
from pdserve.common.types import FencingToken, TicketState, WorkerRole
from pdserve.worker.agent import AgentConfig, TicketRow, WorkerAgent
from pdserve.worker.reports import ControlPlane
from pdserve.worker.runtime import (
    DecodePhase,
    DecodeRequest,
    DecodeRuntime,
    KvPlacement,
    Sampling,
    TransferTiming,
)
from pdserve.worker.transports.base import KvReceiver
from pdserve.worker.transports.registry import TransportBackend
from pdserve.worker.transports.values import KvDestinationSpec


@dataclass(slots=True, eq=False)
class _DecodeTicket:
    token: FencingToken
    num_prompt_tokens: int
    num_blocks: int
    phase: DecodePhase = DecodePhase.ADMITTED


class DecodeAgent(WorkerAgent):
    """Decode worker: owns the blocks its tickets reserved, receives KV, streams tokens."""

    role = WorkerRole.DECODE
    runtime: DecodeRuntime

    def __init__(self, config: AgentConfig, runtime: DecodeRuntime, transport: TransportBackend,
                 control: ControlPlane | None = None) -> None:
        super().__init__(config, runtime, transport, control)
        self._tickets: dict[str, _DecodeTicket] = {}
        self._receiver: KvReceiver | None = None

    async def start(self, kv_host: str = "127.0.0.1", kv_port: int = 0) -> None:
        intake = await self.runtime.start(kv_host, kv_port, self.transport)
        self.kv_address, self._receiver = intake.kv_address, intake.receiver

    @property
    def receiver(self) -> KvReceiver | None:
        """The KV receiver (its refusal and fencing counters), when it runs in this process."""
        return self._receiver

    def tickets(self) -> list[TicketRow]:
        return [(t.token, t.num_blocks, t.phase) for t in self._tickets.values()]

    def held_blocks(self) -> dict[str, int]:
        """Blocks held per fencing token, for ledger reconciliation."""
        return {str(t.token): t.num_blocks for t in self._tickets.values()}

    # -- admission ----------------------------------------------------------------------------

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        return self.runtime.take_prefix_delta()

    def all_prefix_hashes(self) -> list[int]:
        return self.runtime.all_prefix_hashes()

    def admit(self, token: FencingToken, num_prompt_tokens: int,
              num_blocks: int) -> KvDestinationSpec | None:
        """Reserve the ticket's blocks under its token and expect the prompt's layers; returns
        the destination, or None when the engine publishes it once it has picked the blocks."""
        self._check_accepting()
        self._validate_blocks(num_prompt_tokens, num_blocks)
        key = str(token)
        if key in self._tickets:
            raise InvalidArgumentError(f"token: ticket {key} already admitted", field="token")
        placement = self.runtime.admit(token, num_prompt_tokens, num_blocks)
        self._tickets[key] = _DecodeTicket(token, num_prompt_tokens, num_blocks)
        return None if placement is None else self._destination(placement)

    def _destination(self, placement: KvPlacement) -> KvDestinationSpec:
        return KvDestinationSpec(
            kv_address=self.kv_address,
            block_ids=placement.block_ids,
            transport=self.transport.name,
            layout=self.runtime.layout,
            metadata=placement.transport_metadata,
            decode_worker_id=self.config.worker_id,
            frame_versions=placement.frame_versions,
        )

    def _validate_blocks(self, num_prompt_tokens: int, num_blocks: int) -> None:
        layout = self.runtime.layout
        if num_prompt_tokens <= 0:
            raise InvalidArgumentError("num_prompt_tokens: must be > 0", field="num_prompt_tokens")
        if num_blocks < layout.num_blocks_for(num_prompt_tokens + 1):
            raise InvalidArgumentError(
                f"num_blocks: {num_blocks} cannot hold {num_prompt_tokens} prompt tokens and one "
                f"more", field="num_blocks")
        if num_blocks > layout.num_blocks:
            raise InvalidArgumentError(
                f"num_blocks: {num_blocks} exceeds the worker's {layout.num_blocks}",
                field="num_blocks")

    # -- decoding -----------------------------------------------------------------------------

    async def decode(
        self, token: FencingToken, prompt_token_ids: list[int], max_tokens: int, *,
        is_local_prefill: bool = False, num_blocks: int = 0,
        kv_wait_timeout_s: float | None = None, request_id: str = "",
        sampling: Sampling | None = None,
    ) -> AsyncIterator[tuple[list[int], TransferTiming | None]]:
        """Yield (new tokens, timing-on-first-chunk); ends after ``max_tokens`` tokens, or
        earlier where the engine stops the sequence (end of sequence, a stop string)."""
        if max_tokens <= 0:
            raise InvalidArgumentError("sampling.max_tokens: must be > 0",
                                       field="sampling.max_tokens")
        if not prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids: empty", field="prompt_token_ids")
        ticket = (self._register_local(token, len(prompt_token_ids), num_blocks)
                  if is_local_prefill else self._admitted(token, len(prompt_token_ids)))
        request = DecodeRequest(
            token, list(prompt_token_ids), max_tokens,
            kv_wait_timeout_s=kv_wait_timeout_s or self.config.kv_wait_timeout_s,
            request_id=request_id, is_local_prefill=is_local_prefill, num_blocks=num_blocks,
            sampling=sampling or Sampling())
        is_decoding = False
        try:
            async with contextlib.aclosing(self.runtime.decode(request)) as stream:
                async for token_ids, timing in stream:
                    if not is_decoding:  # the prompt's KV is in place
                        self._reports.send(token, self.control.report(token, TicketState.DONE,
                                                                      timing))
                        ticket.phase = DecodePhase.DECODING
                        is_decoding = True
                    yield token_ids, timing
        finally:
            if self._tickets.get(str(token)) is ticket:
                del self._tickets[str(token)]
            if is_decoding:
                self._reports.send(token, self.control.release(token))

    def _register_local(self, token: FencingToken, num_prompt_tokens: int,
                        num_blocks: int) -> _DecodeTicket:
        """A ticket prefilled here: admitted by its Decode call (no ``admit`` before)."""
        self._check_accepting()
        self._validate_blocks(num_prompt_tokens, num_blocks)
        key = str(token)
        if key in self._tickets:
            raise InvalidArgumentError(f"token: ticket {key} already admitted", field="token")
        ticket = _DecodeTicket(token, num_prompt_tokens, num_blocks, DecodePhase.PREFILLING)
        self._tickets[key] = ticket
        return ticket

    def _admitted(self, token: FencingToken, num_prompt_tokens: int) -> _DecodeTicket:
        key = str(token)
        ticket = self._tickets.get(key)
        if ticket is None:
            raise StaleTokenError(f"token: ticket {key} is not admitted here (or was dropped)")
        if num_prompt_tokens != ticket.num_prompt_tokens:
            raise InvalidArgumentError(
                f"prompt_token_ids: {num_prompt_tokens} tokens, ticket admitted "
                f"{ticket.num_prompt_tokens}", field="prompt_token_ids")
        ticket.phase = DecodePhase.RECEIVING
        return ticket

    def drop(self, token: FencingToken, reason: str) -> int:
        """Drop the ticket: nothing more of it lands, and its blocks are freed (by its stream,
        if one is decoding); returns the blocks freed."""
        key = str(token)
        ticket = self._tickets.get(key)
        if ticket is None:
            return 0
        num_freed = self.runtime.abort(token, reason)
        if ticket.phase is not DecodePhase.DECODING:  # a decoding stream forgets it as it ends
            del self._tickets[key]
        return num_freed
