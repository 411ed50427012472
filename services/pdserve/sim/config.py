"""Settings of one simulation: the cluster, the policies' knobs, SLOs and injected events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.common.errors import InvalidArgumentError
from pdserve.router.admission import AdmissionConfig
from pdserve.router.policy import RoutingConfig


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """One deployment: ``num_prefill`` + ``num_decode`` instances of ``tp_size`` GPUs each
    (prefill instances of ``prefill_tp_size`` GPUs when that is set: 0 = ``tp_size``).

    ``max_batch_size``: decode batch slots per instance (the worker agent's ``max_batch_size``);
    sequences beyond it wait, holding their KV reservation. ``prefill_batch_tokens``: a prefill
    batch takes queued prompts first come first served while their uncached tokens fit in this
    budget (always at least one prompt; 1 = one prompt per batch, as the worker agent does).
    ``prefix_cache_blocks``: prefix-cache LRU size per prefill instance, in engine blocks
    (0 = the instance's whole KV budget). ``chunked_prefill_tokens``: how a decode instance runs
    the prompts it prefills itself (local prefill): 0, as a step of their own between decode
    steps (the batch stalls); > 0, chunked into its decode steps, each step carrying the batch's
    decode tokens plus up to ``chunked_prefill_tokens - batch`` prompt tokens (vLLM's
    ``max_num_batched_tokens``). A colocated deployment is ``num_prefill=0`` with chunking on:
    every instance prefills and decodes in the same steps.
    """

    num_prefill: int
    num_decode: int
    model: str = "llama-3.1-70b"
    gpu: str = "h100-sxm-80gb"
    tp_size: int = 8
    block_size_tokens: int = 16
    gpu_memory_utilization: float = 0.9
    max_batch_size: int = 256
    prefill_batch_tokens: int = 8192
    prefix_cache_blocks: int = 0
    chunked_prefill_tokens: int = 0
    prefill_tp_size: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0:
            raise InvalidArgumentError("instance counts must be >= 0", field="num_prefill")
        if self.tp_size < 1 or self.prefill_tp_size < 0:
            raise InvalidArgumentError("tp_size must be >= 1 and prefill_tp_size >= 0",
                                       field="prefill_tp_size")
        if self.chunked_prefill_tokens < 0:
            raise InvalidArgumentError("chunked_prefill_tokens must be >= 0",
                                       field="chunked_prefill_tokens")
        if self.max_batch_size < 1 or self.prefill_batch_tokens < 1:
            raise InvalidArgumentError("max_batch_size and prefill_batch_tokens must be >= 1",
                                       field="max_batch_size")

    @property
    def prefill_tp(self) -> int:
        """GPUs per prefill instance."""
        return self.prefill_tp_size or self.tp_size


def colocated_cluster(num_instances: int, token_budget: int, **kwargs: Any) -> ClusterSpec:
    """``num_instances`` colocated instances (no prefill pool; each instance prefills its own
    prompts in chunks within a per-step budget of ``token_budget`` tokens)."""
    return ClusterSpec(0, num_instances, chunked_prefill_tokens=token_budget, **kwargs)


@dataclass(frozen=True, slots=True)
class SloSpec:
    """Per-request targets: time to first token and mean time per output token after it."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0


@dataclass(frozen=True, slots=True)
class Failure:
    """Instance ``instance_id`` (e.g. ``p3``, ``d0``) fails at simulated time ``time_s``."""

    time_s: float
    instance_id: str

    @staticmethod
    def parse(text: str) -> Failure:
        """``"<seconds>:<instance id>"``, e.g. ``"120:d3"``."""
        when, _, instance_id = text.partition(":")
        try:
            time_s = float(when)
        except ValueError:
            time_s = -1.0
        if time_s < 0 or not instance_id:
            raise InvalidArgumentError(
                f"failure {text!r}: expected <seconds>:<instance id>, e.g. 120:d3",
                field="fail_at")
        return Failure(time_s, instance_id)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything but the trace and the scaling policy.

    ``routing`` is handed unchanged to ``pdserve.router.policy.route``. ``max_queued_requests``
    bounds the router's admission queue (requests waiting for decode KV room); beyond it a
    request is rejected (RESOURCE_EXHAUSTED); 0 rejects at once, as the live router does today.
    ``max_attempts`` counts routing attempts per request (retries after a failure before the
    first token). ``max_tokens`` is what each request asks for (0: its own output length, as a
    client with ``ignore_eos`` would); the reservation covers prompt plus ``max_tokens``.
    ``scaling_interval_s``: how often a scaling policy is asked; ``scaling_history`` how many
    past intervals of arrival rate it sees. ``is_shortlisted``: give ``route`` only candidates no
    other candidate dominates (see ``pdserve.sim.shortlist``); False passes every ready instance.
    ``admission``: the live router's admission policy (``pdserve.router.admission``) decides
    every request's first attempt after routing, as the live router does, and a request no decode
    instance has room for is refused at once (RESOURCE_EXHAUSTED, as live) instead of waiting in
    the simulator's queue; None keeps the simulator's own queue (``max_queued_requests``).
    """

    cluster: ClusterSpec
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    slo: SloSpec = field(default_factory=SloSpec)
    max_queued_requests: int = 4096
    max_attempts: int = 3
    max_tokens: int = 0
    cold_start_s: float = 600.0
    scaling_interval_s: float = 60.0
    scaling_history: int = 1440
    failures: tuple[Failure, ...] = ()
    sample_interval_s: float = 10.0
    deployment: str = "sim"
    is_shortlisted: bool = True
    admission: AdmissionConfig | None = None

    def __post_init__(self) -> None:
        if not self.routing.growth_policy_max_tokens:
            raise InvalidArgumentError(
                "the simulator reserves for the worst case only (growth_policy_max_tokens=True):"
                " it does not model preemption of sequences that outgrow their reservation",
                field="growth_policy_max_tokens")
        if self.max_attempts < 1 or self.max_queued_requests < 0:
            raise InvalidArgumentError("max_attempts must be >= 1, max_queued_requests >= 0",
                                       field="max_attempts")
        if self.scaling_interval_s <= 0 or self.sample_interval_s <= 0 or self.cold_start_s < 0:
            raise InvalidArgumentError(
                "scaling_interval_s and sample_interval_s must be > 0, cold_start_s >= 0",
                field="scaling_interval_s")
