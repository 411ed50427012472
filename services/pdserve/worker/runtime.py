"""The engine seam: what a worker agent drives (``PrefillRuntime``, ``DecodeRuntime``), and the
values that cross it.

A worker agent (``PrefillAgent``, ``DecodeAgent``) is pdserve's ticket model on one engine
instance: it checks what a ticket asks for, keeps each ticket's phase, renews the lease of a prompt
that waits, reports progress, DONE and release to the coordinator, drops tickets, drains, and
answers status and heartbeats. It never schedules. Which blocks a sequence gets, when a prompt is
computed and how sequences are batched belong to the *runtime*, and so does the KV data path,
because KV must be moved where its memory is:

- The in-house runtime (``pdserve.worker.scheduler``) is pdserve's own scheduler over a host-memory
  ``KvCache``, for the ``sim`` and ``tiny`` engines: a block allocator, a FIFO prefill queue, a
  continuous decode batch. It lands and pushes KV itself, with the shared data-path parts
  (``worker.kv_landing.KvLanding``: block owner table and receiver; the transports' senders).
- A self-scheduling engine (vLLM) implements the same protocols over its own scheduler: it
  allocates blocks itself, learns a request's block ids only when it schedules the request, and
  moves KV in its own worker processes through pdserve's KV connector, which uses the same
  data-path parts there. The agent is then a sidecar: it submits, streams and aborts.

Who owns what:

- Blocks belong to the runtime. The agent sees counts only (the ``num_blocks`` a ticket reserved at
  the coordinator, free and total blocks in ``load()``), plus, on the decode side, where a ticket's
  prompt lands (``KvPlacement``), to put in the destination it hands out.
- The fencing token (``FencingToken``: ticket id and attempt, never reused) enters the runtime with
  every call. A decode runtime makes the token the owner of the blocks it picks for the ticket
  (``BlockOwnerTable``) before anything can be written into them, lands only frames whose token owns
  every target block, and revokes the ownership (so that nothing late lands) before the blocks serve
  anyone else. A prefill runtime sends every layer under the ticket's token.
- Leases belong to the agent, and the waiting side renews (workers are handed durations, never
  deadlines). A prefill runtime shows that a prompt still waits through ``PrefillTicket.phase``
  (``QUEUED``); the agent renews its lease on the heartbeat cadence until the phase moves on. The
  decode side's wait for KV is bounded (``DecodeRequest.kv_wait_timeout_s``) and renews nothing.
- The destination becomes known in ``DecodeRuntime.admit`` when the runtime picks the blocks at once
  (in-house): the agent answers ``AdmitTicket`` with it. A self-scheduling engine returns None
  there and publishes the destination once it has scheduled the request (``decode`` submitted it),
  through the coordinator's rendezvous (``PublishDestination``, where the prefill side waits with
  ``AwaitDestination``); for vLLM, the connector does so where it learns the block ids.

Everything here runs on the agent's event loop; no method may block it.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pdserve.api.v1 import common_pb2 as pb
from pdserve.common.types import FencingToken, WorkerLoad
from pdserve.worker.engine import KvLayout
from pdserve.worker.experts import ExpertParallelEngine
from pdserve.worker.kv_checksums import KvChecksum
from pdserve.worker.transports.base import KvReceiver
from pdserve.worker.transports.registry import TransportBackend
from pdserve.worker.transports.values import KvDestinationSpec

# ---- phases ---------------------------------------------------------------------------------


class PrefillPhase(enum.StrEnum):
    """Where a prompt stands on a prefill worker (``GetStatus`` shows it per ticket)."""

    QUEUED = "queued"  # waiting for the engine; the agent renews its lease
    PREFILLING = "prefilling"  # computing; nothing sent yet
    SENDING = "sending"  # at least one layer offered to the destination


class DecodePhase(enum.StrEnum):
    """Where a ticket stands on a decode worker (``GetStatus`` shows it per ticket)."""

    ADMITTED = "admitted"  # blocks reserved, the Decode call has not come yet
    PREFILLING = "prefilling"  # local prefill: the prompt is computed here
    RECEIVING = "receiving"  # waiting for the prompt's KV to land
    DECODING = "decoding"  # the first token is out; the sequence is decoding


class EngineReadiness(enum.StrEnum):
    """Whether a runtime that loads its engine in the background can serve (``Readiness``)."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Readiness:
    """What a runtime that loads in the background (vLLM) reports through ``readiness``: the
    worker stays LOADING until READY, and turns FAILED (then exits) when the engine does. The
    in-house runtimes have no such property: they are ready when ``start`` returns."""

    state: EngineReadiness
    error: str = ""


# ---- values ---------------------------------------------------------------------------------


class MeasuredTransfer(Protocol):
    """A transfer as one side measured it (``transports.values.TransferResult`` is one)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def prefill_compute_s(self) -> float: ...

    @property
    def transfer_s(self) -> float: ...


def estimate_exposed_s(result: MeasuredTransfer) -> float:
    """Transfer time the request saw after prefill ended, from the receiver's own clock.

    Layer l of L finishes computing at ``(l + 1) / L`` of the prefill time, and the first layer
    lands one wire delay after it finished. So prefill ended about
    ``prefill_compute_s x (L - 1) / L`` after the first layer landed, and what lands after that
    is exposed. Clock-free (no comparison with the sender's clock); it slightly underestimates by
    the wire delay of the first layer. The sender measures the same quantity exactly
    (``PrefillResponse.stats.exposed_ms``).
    """
    num_layers = max(1, result.num_layers)
    hidden_s = result.prefill_compute_s * (num_layers - 1) / num_layers
    return max(0.0, result.transfer_s - hidden_s)


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """What one handoff cost, seconds, and how many bytes it moved."""

    num_bytes: int = 0
    num_layers: int = 0
    num_blocks: int = 0
    prefill_compute_s: float = 0.0
    transfer_s: float = 0.0
    exposed_s: float = 0.0

    def to_proto(self) -> pb.TransferStats:
        return pb.TransferStats(
            num_bytes=self.num_bytes, num_blocks=self.num_blocks, num_layers=self.num_layers,
            prefill_compute_ms=self.prefill_compute_s * 1000,
            transfer_ms=self.transfer_s * 1000, exposed_ms=self.exposed_s * 1000,
        )


class ProfilePoint(NamedTuple):
    """One measured forward pass, for the governor's calibration (``GetPerformanceProfile``)."""

    num_tokens: int  # prefill: prompt tokens; decode: tokens of context over the batch
    batch_size: int
    seconds: float
    is_prefill: bool


@dataclass(slots=True, eq=False)
class PrefillTicket:
    """One prompt to compute and ship, as the agent hands it to a ``PrefillRuntime``.

    The runtime moves ``phase`` forward (``QUEUED`` -> ``PREFILLING`` -> ``SENDING``, never back)
    and changes nothing else; the agent reads it to renew the lease while the prompt waits, to
    report progress, and for status.
    """

    token: FencingToken
    prompt_token_ids: list[int]
    destination: KvDestinationSpec | None
    """Where the KV goes; None only for a runtime that ``takes_late_destinations`` (it learns
    the destination from the coordinator's rendezvous)."""
    request_id: str = ""
    phase: PrefillPhase = PrefillPhase.QUEUED


class PrefillResult(NamedTuple):
    """A prompt computed and landed at its destination."""

    first_token_id: int
    timing: TransferTiming
    """As the sender measured it; ``exposed_s`` = transfer time after the compute ended."""
    num_cached_prompt_tokens: int
    """Prompt tokens served from the worker's prefix cache."""


@dataclass(frozen=True, slots=True)
class KvPlacement:
    """Where a ticket's prompt KV lands on a decode worker; the agent adds its KV address,
    transport, layout and worker id to make the ``KvDestinationSpec`` it hands out."""

    block_ids: tuple[int, ...]
    """The physical block of each logical prompt block, sequence order (same id every layer)."""
    transport_metadata: bytes = b""
    """What a sender needs beyond the address (``KvReceiver.metadata``; empty for push)."""
    frame_versions: tuple[int, ...] = ()
    """Frame format versions the receiver reads (``KvReceiver.frame_versions``)."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a decode runtime picks tokens. The in-house engines decode greedily and ignore it; a
    real engine (vLLM) samples with it. Zero values mean the engine's default."""

    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """One ticket's sequence to decode, as the agent hands it to a ``DecodeRuntime``."""

    token: FencingToken
    prompt_token_ids: list[int]
    max_tokens: int
    kv_wait_timeout_s: float
    """Longest wait for the prompt's KV to land (a transferred prompt)."""
    request_id: str = ""
    is_local_prefill: bool = False
    """Compute the prompt here instead of receiving it (then ``admit`` was not called)."""
    num_blocks: int = 0
    """Local prefill: the blocks the ticket reserved at the coordinator."""
    sampling: Sampling = Sampling()


class DecodeChunk(NamedTuple):
    """Tokens a decode stream produced; the first chunk says the prompt's KV is in place."""

    token_ids: list[int]
    timing: TransferTiming | None = None
    """First chunk of a transferred prompt: the transfer as the receiver measured it."""


@dataclass(frozen=True, slots=True)
class KvIntake:
    """Where a decode runtime receives KV: the address senders use, and the receiver, when it runs
    in this process (its refusal and fencing counters go into ``GetStatus``); None when it runs in
    the engine's own processes."""

    kv_address: str
    receiver: KvReceiver | None = None


# ---- the seam -------------------------------------------------------------------------------


class EngineRuntime(Protocol):
    """What runtimes of both roles offer the agent."""

    @property
    def layout(self) -> KvLayout:
        """The engine's KV shape: layers, blocks (its capacity), tokens and bytes per block."""
        ...

    @property
    def profile(self) -> Sequence[ProfilePoint]:
        """Recent measured forward passes (bounded), oldest first."""
        ...

    @property
    def kv_checksums(self) -> Sequence[KvChecksum]:
        """Checksums of recent handoffs' prompt KV as this side saw it (bounded), oldest first."""
        ...

    @property
    def expert_engine(self) -> ExpertParallelEngine | None:
        """The engine's expert parallelism, for placements and routing counts; None if dense."""
        ...

    def load(self) -> WorkerLoad:
        """Queued prefill tokens, running sequences, free and total blocks, now."""
        ...

    async def close(self) -> None:
        """Stop: work in flight fails, the KV data path closes, the engine is released."""
        ...


class PrefillRuntime(EngineRuntime, Protocol):
    """Computes prompts and ships their KV to the decode worker each ticket names."""

    @property
    def takes_late_destinations(self) -> bool:
        """Whether a ticket may come without a destination (then the runtime awaits it at the
        coordinator's rendezvous, where a self-scheduling decode engine publishes it)."""
        ...

    async def start(self, transport: TransportBackend) -> None:
        """Start taking prompts; their KV goes out over ``transport`` (the one the agent
        advertises and the destinations name)."""
        ...

    async def prefill(self, ticket: PrefillTicket) -> PrefillResult:
        """Compute ``ticket``'s prompt and land its KV at ``ticket.destination``.

        The agent has checked that the prompt is not empty, that the destination's layout has
        this runtime's layers, tokens and bytes per block, that it names
        ``layout.num_blocks_for(len(prompt))`` blocks, and that the token is not in flight here.

        Every layer of the prompt goes to the destination blocks under ``ticket.token``; a layer
        may leave as soon as it is computed (the next one computing meanwhile). Returns once the
        receiver holds every layer, with the first token; the runtime's own blocks for the prompt
        are free again when this returns or raises, and a ``KvChecksum`` of what was sent is kept.
        Raises ``StaleTokenError`` once ``abort`` ended the ticket, ``TransferFailedError`` if the
        receiver refused it or the link broke, ``CapacityError`` if no blocks are free for it.
        Cancelling the awaiting task abandons the prompt (dequeued, or its transfer aborted).
        """
        ...

    def abort(self, token: FencingToken, reason: str) -> None:
        """End ``token``'s prompt: a queued one leaves the queue (its ``prefill`` raises
        ``StaleTokenError`` at once), a running one stops before its next layer goes out and the
        receiver is told. No-op for a token it does not have."""
        ...

    def progress_stall_s(self) -> float:
        """Seconds the prompt loop has not advanced (no prompt taken, no layer computed or sent,
        no prompt finished) while prompts wait or run; 0.0 when it is idle. The agent stops
        renewing queued prompts' leases once this passes its bound (a loop that hangs must not
        keep its queue alive: the coordinator expires the tickets, the router retries them). A
        runtime that cannot tell (a self-scheduling engine) returns 0.0."""
        ...

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        """Prefix block hashes (``common.tokenizer.prefix_block_hashes`` over blocks of
        ``layout.block_size_tokens``) cached and evicted since the previous report."""
        ...

    def all_prefix_hashes(self) -> list[int]:
        """Every prefix block hash cached now (a full report; the delta starts over)."""
        ...


class DecodeRuntime(EngineRuntime, Protocol):
    """Receives prompts' KV (or computes it locally) and decodes the sequences."""

    async def start(self, kv_host: str, kv_port: int, transport: TransportBackend) -> KvIntake:
        """Start receiving KV over ``transport`` on ``kv_host:kv_port`` (port 0: any)."""
        ...

    def admit(self, token: FencingToken, num_prompt_tokens: int,
              num_blocks: int) -> KvPlacement | None:
        """Reserve ``num_blocks`` blocks for ``token``'s ticket, its prompt's KV to arrive.

        The agent has checked ``0 < num_prompt_tokens``,
        ``layout.num_blocks_for(num_prompt_tokens + 1) <= num_blocks <= layout.num_blocks`` and
        that the token is new here.

        Returns the placement when the blocks are picked now: ``token`` owns all of them, and the
        first ``layout.num_blocks_for(num_prompt_tokens)`` (the placement's) expect every layer of
        the prompt; only frames under ``token`` naming those blocks land. Returns None when the
        engine picks the blocks only once it schedules the request (after ``decode`` submitted
        it); the same fencing holds from then on, and the destination is published through the
        coordinator's rendezvous. Raises ``CapacityError`` if too few blocks are free now.
        """
        ...

    def decode(self, request: DecodeRequest) -> AsyncGenerator[DecodeChunk, None]:
        """The sequence's tokens, ``request.max_tokens`` in all.

        A transferred prompt (``admit`` came first): waits up to ``request.kv_wait_timeout_s`` for
        every layer to land, then yields the first token (computed by the prefill side) with the
        transfer's timing. A local prefill reserves ``request.num_blocks`` blocks (``token`` owns
        them), computes the prompt, and yields its first token without timing. The first chunk
        always means the prompt's KV is in place; one chunk per token follows.

        However the stream ends (finished, failed, or closed by the caller with ``aclose``), the
        ticket's blocks are free and its ownership revoked by then. Raises ``StaleTokenError``
        for a ticket not admitted here or ended by ``abort``, ``DeadlineError`` if the KV did
        not land in time, ``TransferFailedError`` if the transfer failed, ``CapacityError``
        (local prefill) if no blocks are free.
        """
        ...

    def abort(self, token: FencingToken, reason: str) -> int:
        """End ``token``'s ticket: refuse any frame of it from now on, and free its blocks, at once
        unless a stream is using them (then when it ends: a decoding stream ends by raising
        ``StaleTokenError``). Returns the blocks freed (now or by the stream), 0 if unknown."""
        ...

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        """Prefix block hashes cached and evicted since the previous report (an engine with a
        prefix cache of its own: the decode-local prefill decision reads them); ``([], [])``
        for one without."""
        ...

    def all_prefix_hashes(self) -> list[int]:
        """Every prefix block hash cached now (a full report; the delta starts over)."""
        ...
