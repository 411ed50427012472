"""The engine seam (``worker.runtime``) over one vLLM engine: ``VllmPrefillRuntime`` and
``VllmDecodeRuntime``, what ``pdserve serve worker --engine vllm`` drives.

vLLM schedules, batches and owns its blocks; these runtimes only submit, stream and abort
(``engine.VllmEngine``), and learn what happened to each handoff from the connector's events
(``events``): the connector runs inside vLLM's processes, where the KV is.

- Decode: ``admit`` reserves nothing here (vLLM picks the blocks when it schedules the request,
  after ``decode`` submitted it) and returns None; the connector then makes the ticket's token
  the owner of those blocks and publishes the destination through the coordinator's
  rendezvous. ``decode`` streams vLLM's tokens; the first one comes once every layer landed.
- Prefill: ``prefill`` submits the prompt with ``max_tokens`` 1 and the ticket; the connector
  pushes each layer as it is computed, to the destination the ticket carries or, when the
  router had none (a vLLM decode worker), the one the rendezvous hands over. It returns when the
  connector reports the handoff landed (``SENT``), or raises when it reports it failed.
- Aborts (cancel, drain, DropTicket, lease lapse) become vLLM aborts; vLLM frees the blocks and
  the connector refuses late frames and never caches half-written blocks.
- Start-up: ``start`` returns at once and the engine loads in the background: the worker
  registers and stays LOADING meanwhile (``readiness``), READY once vLLM serves, FAILED if it
  never does or dies later.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import tempfile
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.common.errors import (
    DeadlineError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    StaleTokenError,
    UnavailableError,
)
from pdserve.common.types import FencingToken, WorkerLoad
from pdserve.worker.engine import KvLayout
from pdserve.worker.engines.vllm.engine import (
    EngineState,
    GenerationParams,
    VllmEngine,
    VllmEngineSettings,
)
from pdserve.worker.engines.vllm.events import ConnectorEvent, EventKind, EventListener
from pdserve.worker.engines.vllm.exchange import DestinationExchange, destination_of
from pdserve.worker.engines.vllm.model_folders import check_model_folder
from pdserve.worker.engines.vllm.prefix_events import KvEventSubscriber, PrefixEventIndex
from pdserve.worker.engines.vllm.protocol import (
    CONNECTOR_TRANSPORTS,
    ConnectorSettings,
    RendezvousKind,
    TicketParams,
    TicketRole,
)
from pdserve.worker.experts import ExpertParallelEngine
from pdserve.worker.kv_checksums import KvChecksum
from pdserve.worker.runtime import (
    DecodeChunk,
    DecodeRequest,
    EngineReadiness,
    KvIntake,
    KvPlacement,
    PrefillPhase,
    PrefillResult,
    PrefillTicket,
    ProfilePoint,
    Readiness,
    TransferTiming,
)
from pdserve.worker.transports.registry import TransportBackend
from pdserve.worker.transports.values import TransferFailedError

logger = logging.getLogger(__name__)

_HISTORY = 256
"""Checksums and profile points kept (bounded, oldest dropped)."""
_DTYPE_NBYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
_RECEIVED_GRACE_S = 1.0
"""How long the first token waits for the connector's RECEIVED event (sent before vLLM may
schedule the request, so it is normally there already)."""


@dataclass(frozen=True, slots=True)
class VllmRuntimeSettings:
    """One vLLM worker's runtime: its engine, and the handoff's connector settings."""

    engine: VllmEngineSettings
    worker_id: str = ""
    handoff_timeout_s: float = 30.0
    """Longest a prefill waits for its destination and the receiver's answer."""
    decode_output_pause_s: float = 0.0
    """Fault injection (tests only): a pause before each decode output is handed on, so a test
    that saw token k can act before the client gets token k + 1 (vLLM decodes on meanwhile;
    what it made comes with the next output)."""


def expected_layout(engine: VllmEngineSettings) -> KvLayout:
    """The KV shape vLLM will have, from the model folder and the settings, before it loads
    (registration needs it; the connector's READY event replaces it with vLLM's own)."""
    info = check_model_folder(engine.model_path)
    dtype = info.dtype if engine.dtype == "auto" else engine.dtype
    nbytes = _DTYPE_NBYTES.get(str(dtype).removeprefix("torch."), 2)
    block_size = engine.block_size_tokens or 128  # vLLM's default on CPU
    return KvLayout(num_layers=info.num_layers, num_blocks=max(1, (engine.num_blocks or 2) - 1),
                    block_size_tokens=block_size,
                    block_nbytes=2 * info.num_kv_heads * info.head_dim * block_size * nbytes)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class _VllmRuntime:
    """What both roles share: the engine, the connector's events, checksums, load."""

    _ticket_role: TicketRole

    def __init__(self, settings: VllmRuntimeSettings, exchange: DestinationExchange) -> None:
        self.settings = settings
        self._exchange = exchange
        """The coordinator's rendezvous, from this process (vLLM's processes speak no gRPC)."""
        self._scratch = tempfile.TemporaryDirectory(prefix="pdserve-vllm-")
        self._events_path = str(Path(self._scratch.name) / "events.sock")
        self._listener = EventListener(self._events_path, self._on_event)
        self._layout = expected_layout(settings.engine)
        # vLLM's KV cache events feed the prefix index the router reads (prefix_events).
        self._kv_events = KvEventSubscriber(
            f"ipc://{Path(self._scratch.name) / 'kv-events.sock'}",
            PrefixEventIndex(self._layout.block_size_tokens))
        self._model_max_len = check_model_folder(settings.engine.model_path).max_position_embeddings
        self.engine: VllmEngine | None = None
        self._loading: asyncio.Task[None] | None = None
        self._checksums: collections.deque[KvChecksum] = collections.deque(maxlen=_HISTORY)
        self._profile: collections.deque[ProfilePoint] = collections.deque(maxlen=_HISTORY)
        self._waiters: dict[str, asyncio.Future[ConnectorEvent]] = {}
        self._request_ids: dict[str, str] = {}
        """``str(token)`` -> vLLM request id, for aborts."""
        self._aborted: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_rejections = 0
        self.kv_address = ""

    # -- EngineRuntime --

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def profile(self) -> Sequence[ProfilePoint]:
        return self._profile

    @property
    def kv_checksums(self) -> Sequence[KvChecksum]:
        return self._checksums

    @property
    def expert_engine(self) -> ExpertParallelEngine | None:
        return None

    @property
    def max_model_len(self) -> int:
        """vLLM's context limit (prompt and output) once loaded; the settings' or the model's
        until then."""
        if self.engine is not None and self.engine.state is EngineState.READY:
            return self.engine.max_model_len
        return self.settings.engine.max_model_len or self._model_max_len

    def prompt_tokens_by_source(self) -> dict[str, int]:
        """vLLM's own count of prompt tokens by source (computed, cached, transferred)."""
        return self.engine.prompt_tokens_by_source() if self.engine is not None else {}

    @property
    def readiness(self) -> Readiness:
        if self.engine is None or self.engine.state is EngineState.LOADING:
            return Readiness(EngineReadiness.LOADING)
        if self.engine.state is EngineState.READY:
            return Readiness(EngineReadiness.READY)
        return Readiness(EngineReadiness.FAILED, self.engine.error or f"engine {self.engine.state}")

    def load(self) -> WorkerLoad:
        if self.engine is None or self.engine.state is not EngineState.READY:
            return WorkerLoad(num_total_blocks=self._layout.num_blocks,
                              num_free_blocks=self._layout.num_blocks)
        load = self.engine.load()
        return WorkerLoad(num_queued_prefill_tokens=0, num_running_seqs=load.num_running_seqs,
                          num_waiting_seqs=load.num_waiting_seqs,
                          num_free_blocks=load.num_free_blocks,
                          num_total_blocks=load.num_total_blocks)

    async def close(self) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
            with contextlib.suppress(BaseException):
                await self._loading
        if self.engine is not None:
            await self.engine.close()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(UnavailableError("vllm engine closed"))
        self._listener.close()
        await self._kv_events.close()
        for task in list(self._tasks):
            task.cancel()
        await self._exchange.close()
        self._scratch.cleanup()

    # -- prefix cache, from vLLM's KV events --

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        """Prefix hashes vLLM cached and evicted since the previous report."""
        return self._kv_events.index.take_delta()

    def all_prefix_hashes(self) -> list[int]:
        return self._kv_events.index.all_hashes()

    # -- start-up --

    async def _start_engine(self, connector: ConnectorSettings) -> None:
        await self._listener.start()
        engine_settings = replace(self.settings.engine, connector=connector)
        if engine_settings.is_prefix_caching_enabled:
            self._kv_events.start()  # before vLLM binds: no event is missed
            engine_settings = replace(engine_settings,
                                      kv_events_endpoint=self._kv_events.endpoint)
        self.engine = VllmEngine(engine_settings)
        self._loading = asyncio.create_task(self._load(), name="vllm-engine-start")

    async def _load(self) -> None:
        assert self.engine is not None
        try:
            await self.engine.start()
        except Exception:  # noqa: BLE001 - the engine is FAILED and says why; the worker reports it
            logger.exception("vllm engine did not start")
            return
        capacity = self.engine.capacity
        self._layout = replace(self._layout, num_blocks=capacity.num_blocks,
                               block_size_tokens=capacity.block_size_tokens)
        self._kv_events.index.block_size_tokens = capacity.block_size_tokens  # vLLM's own

    def _connector(self, transport: TransportBackend, kv_host: str = "127.0.0.1",
                   kv_port: int = 0) -> ConnectorSettings:
        """The connector's settings; an unknown or unusable transport fails here, naming it."""
        if transport.name not in CONNECTOR_TRANSPORTS:
            raise InvalidArgumentError(
                f"the vllm engine moves KV over {' or '.join(CONNECTOR_TRANSPORTS)}, not "
                f"{transport.name}", field="transport")
        return ConnectorSettings(rendezvous=RendezvousKind.AGENT,
                                 kv_host=kv_host, kv_port=kv_port,
                                 events_path=self._events_path,
                                 worker_id=self.settings.worker_id,
                                 rpc_timeout_s=min(5.0, self.settings.handoff_timeout_s),
                                 transport=transport.name)

    def _engine(self) -> VllmEngine:
        if self.engine is None or self.engine.state is not EngineState.READY:
            state = self.engine.state if self.engine else EngineState.LOADING
            raise UnavailableError(f"vllm engine is {state}")
        return self.engine

    # -- connector events --

    def _on_event(self, event: ConnectorEvent) -> None:
        if event.kind is EventKind.READY:
            if event.num_layers and event.block_nbytes:
                self._layout = KvLayout(
                    num_layers=event.num_layers,
                    num_blocks=max(1, event.num_total_blocks - 1),
                    block_size_tokens=event.block_size_tokens, block_nbytes=event.block_nbytes)
            if event.kv_address:
                self.kv_address = event.kv_address
            return
        if event.kind is EventKind.REJECTED:
            self.num_rejections = max(self.num_rejections, event.num_rejections)
            return
        if event.kind in (EventKind.SENT, EventKind.RECEIVED):
            token = FencingToken.parse(event.token)
            self._checksums.append(KvChecksum(token, event.crc32, event.num_blocks,
                                              event.num_layers, tuple(event.block_crc32s)))
        if event.kind is EventKind.DESTINATION:
            self._publish(event)
            return
        waiter = self._waiters.get(event.token)
        if waiter is not None and not waiter.done():
            waiter.set_result(event)

    def _publish(self, event: ConnectorEvent) -> None:
        """The decode side placed a ticket's prompt: publish where it lands, for the prefill
        side; a ticket that ended meanwhile aborts its request (its blocks are freed)."""
        token = FencingToken.parse(event.token)

        async def publish() -> None:
            try:
                await self._exchange.publish(token, destination_of(event))
            except NotFoundError as exc:
                logger.info("destination of %s not published (%s): aborting", token,
                            exc.message)
                self._abort_request(token)
            except PdserveError as exc:
                logger.warning("destination of %s not published: %s", token, exc.message)
                self._abort_request(token)

        task = asyncio.get_running_loop().create_task(publish(), name=f"publish-{token}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _expect(self, token: FencingToken) -> asyncio.Future[ConnectorEvent]:
        waiter: asyncio.Future[ConnectorEvent] = asyncio.get_running_loop().create_future()
        self._waiters[str(token)] = waiter
        return waiter

    def _forget(self, token: FencingToken) -> None:
        key = str(token)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        self._request_ids.pop(key, None)
        self._aborted.discard(key)

    def _abort_request(self, token: FencingToken) -> bool:
        key = str(token)
        request_id = self._request_ids.get(key)
        if request_id is None or self.engine is None:
            return False
        self._aborted.add(key)
        engine = self.engine
        task = asyncio.get_running_loop().create_task(engine.abort(request_id))
        task.add_done_callback(_log_failure)
        return True


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("vllm abort failed: %s", task.exception())


class VllmPrefillRuntime(_VllmRuntime):
    """Computes prompts in vLLM; the connector pushes each layer's KV as it is computed."""

    _ticket_role = TicketRole.PREFILL
    takes_late_destinations = True
    """A prefill may come without a destination: this runtime awaits it at the coordinator's
    rendezvous (where the decode worker's agent publishes it) before it submits the prompt."""

    async def start(self, transport: TransportBackend) -> None:
        await self._start_engine(self._connector(transport))

    async def prefill(self, ticket: PrefillTicket) -> PrefillResult:
        engine = self._engine()
        token = ticket.token
        key = str(token)
        request_id = f"prefill-{token.ticket_id}-{token.attempt}"
        self._request_ids[key] = request_id
        landed = self._expect(token)
        is_alone = len(self._request_ids) == 1
        started_s = time.perf_counter()
        first_token_id = -1
        num_cached = 0
        is_done = False
        try:
            destination = ticket.destination
            if destination is None:  # the decode engine publishes it once it placed the prompt
                destination = await self._exchange.wait(token, self.settings.handoff_timeout_s)
                if destination is None:
                    raise DeadlineError(f"{key}: no destination within "
                                        f"{self.settings.handoff_timeout_s} s (the decode side "
                                        "did not place the prompt, or the ticket ended)")
            params = TicketParams(TicketRole.PREFILL, token, self.settings.handoff_timeout_s,
                                  destination)
            # vLLM does not say when a request leaves its own queue: from here the prompt counts
            # as computing, and its lease is the router's to size (no renewals while it queues).
            ticket.phase = PrefillPhase.PREFILLING
            async for delta in engine.generate(request_id, ticket.prompt_token_ids,
                                               GenerationParams(max_tokens=1), params):
                if delta.token_ids:
                    first_token_id = delta.token_ids[0]
                    num_cached = delta.num_cached_tokens
                    ticket.phase = PrefillPhase.SENDING
                if delta.finish_reason == "abort" or key in self._aborted:
                    raise StaleTokenError(f"token: ticket {key} was aborted")
            if key in self._aborted:  # vLLM ended the stream of an aborted request
                raise StaleTokenError(f"token: ticket {key} was aborted")
            compute_s = time.perf_counter() - started_s
            num_computed = len(ticket.prompt_token_ids) - num_cached
            if is_alone and len(self._request_ids) == 1:
                # A prompt computed alone measures the engine; one batched with others would
                # count their work as its own (the router's TTFT prediction reads these).
                self._profile.append(ProfilePoint(num_computed, 1, compute_s, True))
            event = await asyncio.wait_for(landed, self.settings.handoff_timeout_s)
            if event.kind is EventKind.FAILED:
                raise TransferFailedError(f"KV handoff of {key} failed: {event.reason}")
            is_done = True
            return PrefillResult(
                first_token_id=first_token_id,
                timing=TransferTiming(num_bytes=event.num_bytes, num_layers=event.num_layers,
                                      num_blocks=event.num_blocks, prefill_compute_s=compute_s,
                                      transfer_s=event.transfer_s,
                                      exposed_s=max(0.0, time.perf_counter() - started_s
                                                    - compute_s)),
                num_cached_prompt_tokens=num_cached)
        except TimeoutError:
            raise TransferFailedError(f"KV handoff of {key}: no answer within "
                                      f"{self.settings.handoff_timeout_s} s") from None
        finally:
            if not is_done:
                self._abort_request(token)
            self._forget(token)

    def abort(self, token: FencingToken, reason: str) -> None:
        if self._abort_request(token):
            logger.info("prefill %s aborted: %s", token, reason)

    def progress_stall_s(self) -> float:
        """vLLM schedules its own loop and the agent cannot see it advance: never stalled here
        (a hung engine is found by its engine-core health, not by this watermark)."""
        return 0.0


class VllmDecodeRuntime(_VllmRuntime):
    """Decodes in vLLM; the connector receives each ticket's prompt KV into vLLM's blocks."""

    _ticket_role = TicketRole.DECODE

    def __init__(self, settings: VllmRuntimeSettings, exchange: DestinationExchange) -> None:
        super().__init__(settings, exchange)
        self._admitted: dict[str, int] = {}
        """``str(token)`` -> blocks the ticket reserved at the coordinator."""

    async def start(self, kv_host: str, kv_port: int, transport: TransportBackend) -> KvIntake:
        # The receiver binds inside vLLM's worker process: pick the port now so that the
        # address is known before the engine has loaded.
        connector = self._connector(transport, kv_host, kv_port or _free_port(kv_host))
        self.kv_address = f"{kv_host}:{connector.kv_port}"
        await self._start_engine(connector)
        return KvIntake(kv_address=self.kv_address)

    def admit(self, token: FencingToken, num_prompt_tokens: int,
              num_blocks: int) -> KvPlacement | None:
        self._engine()  # READY, or UnavailableError
        # The coordinator's ledger reserved the blocks against vLLM's reported capacity; vLLM
        # queues the request if they are not free the moment it is submitted.
        self._admitted[str(token)] = num_blocks
        return None  # vLLM picks the blocks when it schedules; the connector publishes them

    async def decode(self, request: DecodeRequest) -> AsyncGenerator[DecodeChunk, None]:
        engine = self._engine()
        token = request.token
        key = str(token)
        if not request.is_local_prefill and key not in self._admitted:
            raise StaleTokenError(f"token: ticket {key} is not admitted here (or was dropped)")
        request_id = f"decode-{token.ticket_id}-{token.attempt}"
        self._request_ids[key] = request_id
        landed = None if request.is_local_prefill else self._expect(token)
        ticket = (None if request.is_local_prefill else
                  TicketParams(TicketRole.DECODE, token, request.kv_wait_timeout_s))
        sampling = request.sampling
        params = GenerationParams(
            max_tokens=request.max_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0, seed=sampling.seed or None, stop=sampling.stop,
            ignore_eos=sampling.ignore_eos)
        is_first = True
        is_finished = False
        try:
            async for delta in engine.generate(request_id, request.prompt_token_ids, params,
                                               ticket):
                if key in self._aborted or delta.finish_reason == "abort":
                    raise StaleTokenError(f"token: ticket {key} was aborted")
                is_finished = delta.is_finished
                if not delta.token_ids:
                    continue
                timing = None
                if is_first and landed is not None:
                    timing = await self._received_timing(key, landed)
                is_first = False
                if self.settings.decode_output_pause_s > 0:
                    await asyncio.sleep(self.settings.decode_output_pause_s)
                yield DecodeChunk(list(delta.token_ids), timing)
            if key in self._aborted:
                raise StaleTokenError(f"token: ticket {key} was aborted")
            if is_first and landed is not None and landed.done() and not landed.cancelled():
                event = landed.result()
                if event.kind is EventKind.FAILED:
                    raise TransferFailedError(f"KV handoff of {key} failed: {event.reason}")
        finally:
            if not is_finished:
                self._abort_request(token)
            self._admitted.pop(key, None)
            self._forget(token)

    async def _received_timing(self, key: str,
                               landed: asyncio.Future[ConnectorEvent]) -> TransferTiming | None:
        try:
            event = await asyncio.wait_for(asyncio.shield(landed), _RECEIVED_GRACE_S)
        except (TimeoutError, asyncio.CancelledError):
            return None
        if event.kind is not EventKind.RECEIVED:
            return None
        return TransferTiming(num_bytes=event.num_bytes, num_layers=event.num_layers,
                              num_blocks=event.num_blocks, transfer_s=event.transfer_s)

    def abort(self, token: FencingToken, reason: str) -> int:
        key = str(token)
        num_blocks = self._admitted.pop(key, 0)
        if self._abort_request(token):
            logger.info("decode %s aborted: %s", token, reason)
        return num_blocks


