"""Scheduler side of pdserve's connector: runs in vLLM's EngineCore process, next to vLLM's
scheduler, and decides per request what the worker side does with its blocks.

Decode (``TicketRole.DECODE``): ``get_num_new_matched_tokens`` answers "every prompt token past
the local prefix hit arrives asynchronously"; vLLM then allocates the blocks, parks the request in
WAITING_FOR_REMOTE_KVS (no zeroing, no caching of those blocks yet) and calls
``update_state_after_alloc`` with them; the next ``build_connector_meta`` hands them to the worker
side as a ``LoadSpec``. A parked request is not among the step's scheduled requests, so pending
loads are kept here until the next metadata is built. vLLM recomputes the last prompt token
itself when the load covers the whole prompt, so decode computes the first output token.
``update_state_after_alloc`` is called again with 0 external tokens after the load: nothing
starts twice, and a request (preempted, say) never loads twice.

Prefill (``TicketRole.PREFILL``): every step that computes part of the prompt becomes a
``SendSpec`` naming the blocks whose KV is final after that step; the worker side pushes them
layer by layer. ``request_finished`` keeps the blocks (returns True) of every request the worker
side was told about, until the worker side reports the send ended.

Pure bookkeeping, no I/O: everything here is called on vLLM's scheduler thread.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import InvalidArgumentError
from pdserve.worker.engines.vllm.protocol import (
    ConnectorSettings,
    LoadSpec,
    PdserveConnectorMetadataFields,
    SendSpec,
    TicketParams,
    TicketRole,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Send:
    request: Any  # vllm.v1.request.Request
    params: TicketParams


class SchedulerSide:
    """One per EngineCore. ``block_ids_of(req_id)`` reads vLLM's KV cache manager (group 0)."""

    def __init__(self, settings: ConnectorSettings, block_size_tokens: int) -> None:
        self._settings = settings
        self._block_size = block_size_tokens
        self._pending_loads: dict[str, LoadSpec] = {}
        self._loading_req_ids: set[str] = set()
        """Requests whose load was handed to the worker side (never load one twice)."""
        self._sends: dict[str, _Send] = {}
        self._announced_send_req_ids: set[str] = set()
        self._aborted_send_req_ids: list[str] = []
        self._params: dict[str, TicketParams | None] = {}
        self.block_ids_of: Any = None
        """``req_id -> list[int]`` (bound by the connector to vLLM's KV cache manager)."""

    def _ticket(self, request: Any) -> TicketParams | None:
        req_id = request.request_id
        if req_id not in self._params:
            try:
                self._params[req_id] = TicketParams.from_kv_transfer_params(
                    request.kv_transfer_params)
            except InvalidArgumentError as exc:
                # The agent validates before submitting; here a bad ticket must not kill the
                # engine: the request runs without one (decode then computes the prompt).
                logger.error("request %s: ignoring malformed pdserve ticket: %s", req_id, exc)
                self._params[req_id] = None
        return self._params[req_id]

    # -- vLLM's scheduler-side hooks --

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        ticket = self._ticket(request)
        if ticket is None or ticket.role is not TicketRole.DECODE:
            return 0, False
        if request.request_id in self._loading_req_ids:
            return 0, False
        num_external = request.num_prompt_tokens - num_computed_tokens
        if num_external < self._settings.min_load_tokens:
            return 0, False
        return num_external, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        ticket = self._ticket(request)
        if ticket is None:
            return
        req_id = request.request_id
        if ticket.role is TicketRole.PREFILL:
            self._sends.setdefault(req_id, _Send(request, ticket))
            return
        if num_external_tokens <= 0 or req_id in self._loading_req_ids:
            return
        num_prompt_tokens = request.num_prompt_tokens
        num_local_tokens = num_prompt_tokens - num_external_tokens
        if num_local_tokens % self._block_size:
            # vLLM presents block-aligned local hits; anything else would mean writing into a
            # block shared with the prefix cache.
            raise AssertionError(f"{req_id}: local hit of {num_local_tokens} tokens is not "
                                 f"block-aligned ({self._block_size})")
        first_block = num_local_tokens // self._block_size
        num_blocks = math.ceil(num_prompt_tokens / self._block_size)
        dst = tuple(block_ids[first_block:num_blocks])
        assert len(dst) == num_blocks - first_block, (req_id, len(block_ids), first_block)
        self._pending_loads[req_id] = LoadSpec(
            req_id=req_id, token=ticket.token, dst_block_ids=dst, first_block=first_block,
            num_prompt_tokens=num_prompt_tokens, timeout_s=ticket.timeout_s)
        self._loading_req_ids.add(req_id)

    def build_connector_meta(self, num_scheduled_tokens: dict[str, int]
                             ) -> PdserveConnectorMetadataFields:
        fields = PdserveConnectorMetadataFields(loads=list(self._pending_loads.values()),
                                                aborted_send_req_ids=self._aborted_send_req_ids)
        self._pending_loads.clear()
        self._aborted_send_req_ids = []
        for req_id, num_tokens in num_scheduled_tokens.items():
            send = self._sends.get(req_id)
            if send is None:
                continue
            spec = self._send_spec(send, num_tokens)
            if spec is not None:
                fields.sends.append(spec)
                self._announced_send_req_ids.add(req_id)
        return fields

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._params.pop(req_id, None)
        # A load still pending stays pending: the worker side must hear of it to report it
        # (vLLM holds the blocks of an aborted WAITING_FOR_REMOTE_KVS request until then); it
        # sees the request among the finished ones in the same step and fails it at once.
        self._loading_req_ids.discard(req_id)
        self._sends.pop(req_id, None)
        if req_id in self._announced_send_req_ids:
            self._announced_send_req_ids.discard(req_id)
            if getattr(request.status, "name", "") == "FINISHED_ABORTED":
                self._aborted_send_req_ids.append(req_id)
            return True, None  # the worker side reports it in finished_sending
        return False, None

    # -- internals --

    def _send_spec(self, send: _Send, num_scheduled_tokens: int) -> SendSpec | None:
        request = send.request
        num_prompt_tokens = request.num_prompt_tokens
        num_computed_before = request.num_computed_tokens  # not yet advanced for this step
        if num_computed_before >= num_prompt_tokens:
            return None  # a decode step of a prefill request: its KV is not sent
        num_computed_after = min(num_prompt_tokens, num_computed_before + num_scheduled_tokens)
        is_last = num_computed_after >= num_prompt_tokens
        num_ready = (math.ceil(num_prompt_tokens / self._block_size) if is_last
                     else num_computed_after // self._block_size)
        block_ids = tuple(self.block_ids_of(request.request_id)[:num_ready])
        return SendSpec(
            req_id=request.request_id, token=send.params.token, block_ids=block_ids,
            num_ready_blocks=num_ready, num_prompt_tokens=num_prompt_tokens, is_last=is_last,
            timeout_s=send.params.timeout_s, destination=send.params.destination)
