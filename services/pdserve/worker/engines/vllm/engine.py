"""The agent-facing adapter over one vLLM engine.

Choice: vLLM's in-process async engine (``vllm.v1.engine.async_llm.AsyncLLM``), not the bare
engine core client. It is the API vLLM's own OpenAI server is built on, so it is the most
stable surface; it does what a sidecar must not redo (tokenizer, detokenisation, stop strings,
per-request output streams, aborts that reach EngineCore); it runs EngineCore (scheduler, KV
blocks) and the model worker in processes of their own, so the agent's event loop never blocks
on a forward pass; and it hands every step's scheduler statistics to stat loggers, which is how
this adapter reads vLLM's own load and free blocks for heartbeats without polling.

The agent talks to vLLM only through this API; pdserve's connector (``connector``) runs inside
vLLM's processes and reports to the agent over a Unix datagram socket (``events``). The
connector makes both engine processes die with their parent (``PR_SET_PDEATHSIG``), so a
killed agent leaves no engine behind.

States: ``LOADING`` (engine starting) -> ``READY`` -> ``STOPPED``; ``FAILED`` when start-up
fails or the engine dies later (vLLM's ``EngineDeadError``; a watcher notices within
``watch_interval_s`` even with no request in flight).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pdserve.common.errors import InvalidArgumentError, UnavailableError
from pdserve.worker.engines.vllm import lifetime, runtime_check
from pdserve.worker.engines.vllm.model_folders import ModelFolderInfo, check_model_folder
from pdserve.worker.engines.vllm.protocol import ConnectorSettings, TicketParams, TicketRole

logger = logging.getLogger(__name__)

_STAT_LOGGERS_LOCK = threading.Lock()
"""Engines built at once in one process (the vllm_pd bench, an engine pair) must not make their
stat loggers at once: vLLM's Prometheus logger first unregisters every vllm: metric of the
process-wide registry, and two doing that together fail with a KeyError (seen in the bench)."""


def _serialize_stat_loggers() -> None:
    """Make vLLM's ``AsyncLLM`` build its ``StatLoggerManager`` under ``_STAT_LOGGERS_LOCK``."""
    import vllm.v1.engine.async_llm as async_llm

    base: Any = async_llm.StatLoggerManager
    if getattr(base, "is_serialized_by_pdserve", False):
        return

    class SerializedStatLoggerManager(base):
        is_serialized_by_pdserve = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with _STAT_LOGGERS_LOCK:
                super().__init__(*args, **kwargs)

    setattr(async_llm, "StatLoggerManager", SerializedStatLoggerManager)  # noqa: B010


CONNECTOR_MODULE = "pdserve.worker.engines.vllm.connector"
CONNECTOR_CLASS = "PdserveConnector"


class EngineState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class VllmEngineSettings:
    """One engine. ``connector`` None = a plain colocated engine (no pdserve connector).

    ``num_blocks`` caps vLLM's KV cache (``num_gpu_blocks_override``); None lets vLLM size it
    (on CPU from ``VLLM_CPU_KVCACHE_SPACE``, GiB). ``max_model_len`` None = the model's own.
    """

    model_path: Path
    connector: ConnectorSettings | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size_tokens: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    is_eager: bool = True
    is_prefix_caching_enabled: bool = True
    seed: int = 0
    watch_interval_s: float = 0.5
    environment: dict[str, str] = field(default_factory=dict)
    """Set in this process before vLLM starts (its processes inherit it), if not set already."""
    vllm_connector: VllmConnectorSpec | None = None
    """vLLM's own connector instead of pdserve's (``connector`` must then be None)."""
    kv_events_endpoint: str = ""
    """ZMQ endpoint vLLM publishes its KV cache events on (``prefix_events``); empty = none.
    Needs prefix caching (vLLM emits no events without it)."""


@dataclass(frozen=True, slots=True)
class VllmConnectorSpec:
    """One of vLLM's own KV connectors instead of pdserve's (side-by-side benchmarks):
    ``name`` as vLLM registers it (``ExampleConnector``, ...), ``role`` ``kv_producer``,
    ``kv_consumer`` or ``kv_both``, and its ``kv_connector_extra_config``."""

    name: str
    role: Literal["kv_producer", "kv_consumer", "kv_both"]
    extra_config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Sampling parameters that reach vLLM (temperature 0 = greedy)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidArgumentError("max_tokens must be >= 1", field="max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidArgumentError("temperature must be in [0, 100]", field="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError("top_p must be in (0, 1]", field="top_p")


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one request since the previous delta (vLLM's DELTA output kind)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class KvCapacity:
    """vLLM's own KV cache: what ledger, admission and routing must count in."""

    num_blocks: int
    block_size_tokens: int


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """vLLM's scheduler as of its last step."""

    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0


class _StatCollector:
    """A vLLM stat logger (one per engine): keeps the last scheduler stats and the running sum
    of prompt tokens by source (computed, local_cache_hit, external_kv_transfer)."""

    def __init__(self) -> None:
        self.load = EngineLoad()
        self.num_total_blocks = 0
        self.prompt_tokens_by_source: dict[str, int] = {}

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        collector = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                collector.num_total_blocks = int(vllm_config.cache_config.num_gpu_blocks or 0)

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                collector.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                return None

        return _Logger(vllm_config, engine_index)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            usable = max(0, self.num_total_blocks - 1)  # vLLM keeps one null block
            self.load = EngineLoad(
                num_running_seqs=int(scheduler_stats.num_running_reqs),
                num_waiting_seqs=int(scheduler_stats.num_waiting_reqs),
                num_free_blocks=round((1.0 - scheduler_stats.kv_cache_usage) * usable),
                num_total_blocks=usable,
            )
        if iteration_stats is not None:
            stats = iteration_stats.prompt_token_stats
            for source in stats.ALL_SOURCES:
                self.prompt_tokens_by_source[source] = (
                    self.prompt_tokens_by_source.get(source, 0) + stats.get_by_source(source))


class VllmEngine:
    """One vLLM engine driven from the agent's event loop."""

    def __init__(self, settings: VllmEngineSettings) -> None:
        self.settings = settings
        self.state = EngineState.LOADING
        self.error = ""
        self.model: ModelFolderInfo | None = None
        self._engine: Any = None  # AsyncLLM
        self._stats = _StatCollector()
        self._watcher: asyncio.Task[None] | None = None
        self._capacity: KvCapacity | None = None

    # -- lifecycle --

    async def start(self) -> None:
        """Start vLLM; READY when it can serve. Raises (and turns FAILED) on a bad model folder,
        a broken install or an engine that does not come up."""
        try:
            self.model = check_model_folder(self.settings.model_path)
            broken = await asyncio.to_thread(runtime_check.broken_media_packages)
            if broken:
                raise UnavailableError(runtime_check.describe_broken(broken))
            for name, value in self.settings.environment.items():
                os.environ.setdefault(name, value)
            if self.settings.connector is None or self.settings.connector.die_with_parent:
                lifetime.children_die_with_this_process()
            started_s = time.monotonic()
            # Building the engine blocks for as long as vLLM loads (tens of seconds): off the
            # event loop, which keeps heartbeating meanwhile (the worker is LOADING). vLLM starts
            # its output handler lazily when built off a loop: start it here, on the loop, so
            # that an engine that dies before any request is noticed.
            self._engine = await asyncio.to_thread(self._build)
            start_output_handler = getattr(self._engine, "_run_output_handler", None)
            if callable(start_output_handler):
                start_output_handler()
            cache_config = self._engine.vllm_config.cache_config
            self._capacity = KvCapacity(num_blocks=int(cache_config.num_gpu_blocks) - 1,
                                        block_size_tokens=int(cache_config.block_size))
            self._stats.num_total_blocks = int(cache_config.num_gpu_blocks)
            self._stats.record(_IdleStats(), None)
            logger.info("vllm engine ready in %.1f s: %s, %d KV blocks of %d tokens",
                        time.monotonic() - started_s, self.model.path,
                        self._capacity.num_blocks, self._capacity.block_size_tokens)
        except BaseException as exc:
            self.state = EngineState.FAILED
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        self.state = EngineState.READY
        self._watcher = asyncio.create_task(self._watch(), name="vllm-engine-watch")

    def _build(self) -> Any:
        """Import vLLM and build the engine (seconds of imports, then the engine's load)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self._engine_kwargs())
        with _STAT_LOGGERS_LOCK:
            _serialize_stat_loggers()
        return AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.factory])

    def _engine_kwargs(self) -> dict[str, Any]:
        settings = self.settings
        kwargs: dict[str, Any] = {
            "model": str(settings.model_path), "dtype": settings.dtype,
            "enforce_eager": settings.is_eager, "seed": settings.seed,
            "max_num_seqs": settings.max_num_seqs,
            "enable_prefix_caching": settings.is_prefix_caching_enabled,
        }
        for name, value in (("max_model_len", settings.max_model_len),
                            ("block_size", settings.block_size_tokens),
                            ("num_gpu_blocks_override", settings.num_blocks),
                            ("max_num_batched_tokens", settings.max_num_batched_tokens)):
            if value is not None:
                kwargs[name] = value
        if settings.kv_events_endpoint and settings.is_prefix_caching_enabled:
            from vllm.config import KVEventsConfig

            from pdserve.worker.engines.vllm.prefix_events import TOPIC

            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq",
                endpoint=settings.kv_events_endpoint, topic=TOPIC)
        if settings.connector is not None and settings.vllm_connector is not None:
            raise InvalidArgumentError("pdserve's connector or one of vLLM's, not both",
                                       field="vllm_connector")
        if settings.connector is not None:
            from vllm.config import KVTransferConfig

            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both", kv_connector_extra_config=settings.connector.to_extra_config())
        elif settings.vllm_connector is not None:
            from vllm.config import KVTransferConfig

            spec = settings.vllm_connector
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector=spec.name, kv_role=spec.role,
                kv_connector_extra_config=dict(spec.extra_config))
        return kwargs

    async def _watch(self) -> None:
        while self.state is EngineState.READY:
            await asyncio.sleep(self.settings.watch_interval_s)
            if self._engine is not None and self._engine.errored:
                self._fail(f"engine died: {self._engine.dead_error}")

    def _fail(self, error: str) -> None:
        if self.state is EngineState.READY:
            logger.error("vllm engine failed: %s", error)
            self.state = EngineState.FAILED
            self.error = error

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)
            self._engine = None
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED

    # -- requests --

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: GenerationParams, ticket: TicketParams | None = None
                       ) -> AsyncIterator[TokenDelta]:
        """Stream a request's tokens. A prefill-side ticket forces ``max_tokens`` 1: the prefill
        engine only computes the prompt (decode computes the first token from the KV).

        Raises ``InvalidArgumentError`` for a prompt past the context (naming the field),
        ``UnavailableError`` if the engine is not READY or dies meanwhile.
        """
        if self.state is not EngineState.READY:
            raise UnavailableError(f"vllm engine is {self.state}: {self.error}".rstrip(": "))
        if not prompt_token_ids:
            raise InvalidArgumentError("prompt is empty", field="prompt")
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        max_len = self._engine.model_config.max_model_len
        if ticket is not None and ticket.role is TicketRole.PREFILL:
            params = replace(params, max_tokens=1, stop=())
        if len(prompt_token_ids) + params.max_tokens > max_len:
            raise InvalidArgumentError(
                f"prompt of {len(prompt_token_ids)} tokens plus max_tokens {params.max_tokens} "
                f"exceeds the model's context of {max_len}", field="prompt")
        extra_args = {"kv_transfer_params": ticket.to_kv_transfer_params()} if ticket else None
        sampling = SamplingParams(
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            seed=params.seed, stop=list(params.stop) or None, ignore_eos=params.ignore_eos,
            output_kind=RequestOutputKind.DELTA, extra_args=extra_args)
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            async for output in self._engine.generate(
                    {"prompt_token_ids": list(prompt_token_ids)}, sampling, request_id):
                completion = output.outputs[0]
                yield TokenDelta(
                    token_ids=tuple(completion.token_ids), text=completion.text,
                    finish_reason=completion.finish_reason if output.finished else None,
                    num_prompt_tokens=len(output.prompt_token_ids or ()),
                    num_cached_tokens=int(output.num_cached_tokens or 0))
        except EngineDeadError as exc:
            self._fail(f"engine died: {exc}")
            raise UnavailableError(f"vllm engine died: {exc}") from None

    async def abort(self, request_id: str) -> None:
        """Cancel, drain or DropTicket: vLLM frees the request (its connector fails a load in
        flight and never caches its blocks). No-op for unknown or finished requests."""
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block not held by a running request (True if vLLM did)."""
        if self._engine is None:
            return False
        return bool(await self._engine.reset_prefix_cache())

    # -- what heartbeats report --

    @property
    def capacity(self) -> KvCapacity:
        if self._capacity is None:
            raise UnavailableError("vllm engine not started")
        return self._capacity

    def load(self) -> EngineLoad:
        return self._stats.load

    @property
    def max_model_len(self) -> int:
        """vLLM's context limit, prompt and output together."""
        if self._engine is None:
            raise UnavailableError("vllm engine not started")
        return int(self._engine.model_config.max_model_len)

    def prompt_tokens_by_source(self) -> dict[str, int]:
        """Prompt tokens since start by where their KV came from (vLLM's own accounting)."""
        return dict(self._stats.prompt_tokens_by_source)

    @property
    def tokenizer_path(self) -> Path:
        return self.settings.model_path / "tokenizer.json"


@dataclass(frozen=True, slots=True)
class _IdleStats:
    """Scheduler stats of an engine that has not stepped yet."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
