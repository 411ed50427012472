"""The settings object of each deployable service (``pdserve serve <service>``).

Each class adds what its service needs to ``CommonSettings``; every field has an environment
variable ``PDSERVE_<NAME>`` and a flag ``--name`` (the flag wins).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import ConfigError
from pdserve.common.settings import CommonSettings
from pdserve.common.settings_fields import setting
from pdserve.common.settings_parsers import (
    ADDRESS,
    DURATION_S,
    PORT,
    PORT_OR_OFF,
    Parser,
    float_range,
    int_range,
    optional,
)
from pdserve.common.types import WorkerRole

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_GPU = "h100-sxm-80gb"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings(CommonSettings):
    """A worker agent beside one engine instance."""

    service_name: str = setting("worker", help="Service name in logs, traces and metrics.")
    role: WorkerRole = setting(help="prefill or decode.")
    deployment: str = setting(DEFAULT_MODEL, help="Deployment (model name clients use).")
    worker_id: str = setting("", help="Stable worker id; empty = assigned by the pool manager.")
    pool_address: str = setting(parser=ADDRESS, help="host:port of this role's pool manager.")
    coordinator_address: str = setting(parser=ADDRESS, help="host:port of the KV-transfer coordinator.")
    join_token: str = setting(help="Secret that admits this worker to its pool.", is_secret=True)
    advertise_host: str = setting("127.0.0.1", help="Host other processes use to reach this worker.")
    advertise_host_from_hostname: bool = setting(False, help="Advertise this machine's host name instead of advertise_host (containers).")
    engine: str = setting("sim", help="Engine backend: sim or tiny.")
    model: str = setting(DEFAULT_MODEL, help="Model from the catalog (sim engine).")
    gpu: str = setting(DEFAULT_GPU, help="GPU from the catalog (sim engine).")
    tp_size: int = setting(1, parser=int_range(1, 1024), help="Tensor-parallel degree.")
    block_size_tokens: int = setting(16, parser=int_range(1, 1024), help="Tokens per KV block.")
    speedup: float = setting(1.0, parser=float_range(1e-3, 1e12), help="Sim speed-up (simulated s per wall s).")
    cold_start_s: float = setting(0.0, parser=DURATION_S, help="Simulated weight loading before READY (wall time = cold_start_s / speedup_cold_start).")
    cold_start_speedup: float = setting(1.0, parser=float_range(1e-3, 1e9), help="Divides cold_start_s.")
    kv_scale: float = setting(1.0 / 64, parser=float_range(1e-6, 1.0), help="Sim KV bytes per block relative to the real model's.")
    max_num_blocks: int = setting(8192, parser=int_range(0, 10_000_000), help="KV blocks: cap for the sim engine, cache size of the tiny engine (0 = no cap / the engine's default).")
    tiny_num_layers: int = setting(8, parser=int_range(1, 1000), help="Tiny engine: decoder layers.")
    tiny_hidden_size: int = setting(256, parser=int_range(2, 65536), help="Tiny engine: hidden size (a multiple of tiny_num_heads, head size even).")
    tiny_num_heads: int = setting(8, parser=int_range(1, 1024), help="Tiny engine: query heads.")
    tiny_num_kv_heads: int = setting(2, parser=int_range(1, 1024), help="Tiny engine: KV heads (divides tiny_num_heads; fewer = grouped-query attention).")
    tiny_seed: int = setting(0, parser=int_range(0, 2**31 - 1), help="Tiny engine: weight seed (equal seeds and shapes, equal weights on every worker).")
    num_kv_layers: int = setting(0, parser=int_range(0, 1000), help="KV layers the sim engine moves (0 = the model's).")
    num_moe_layers: int = setting(0, parser=int_range(0, 1000), help="MoE layers whose expert routing the sim engine simulates (0 = the model's).")
    expert_skew: float = setting(0.9, parser=float_range(0.0, 10.0), help="Sim engine: Zipf exponent of expert popularity (0 = uniform routing).")
    expert_seed: int = setting(0, parser=int_range(0, 2**31 - 1), help="Sim engine: seed of the expert-popularity profile and routing draws.")
    expert_report_interval_s: float = setting(10.0, parser=DURATION_S, help="MoE engines: how often heartbeats carry per-expert token counts.")
    transport: str = setting("tcp", help="KV transport: tcp, nixl or inproc.")
    kv_host: str = setting("127.0.0.1", help="Interface the KV data path listens on.")
    kv_port: int = setting(0, parser=PORT, help="KV data path port; 0 = any.")
    max_batch_size: int = setting(256, parser=int_range(1, 100_000), help="Decode batch limit.")
    metrics_port: int = setting(-1, parser=PORT_OR_OFF, help="Prometheus port; -1 = off.")
    test_clock_offset_s: float = setting(0.0, parser=float_range(-1e9, 1e9), help="Fault injection (tests only): shift this process's wall clock by this many seconds, as on a host whose clock is skewed. Leases are the coordinator's clock; workers only ever get durations.")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSettings(CommonSettings):
    """A pool manager (one per role)."""

    service_name: str = setting("pool", help="Service name in logs, traces and metrics.")
    role: WorkerRole = setting(help="Pool this manager serves: prefill or decode.")
    join_token: str = setting("", help="Secret workers present to join (or join_token_path).", is_secret=True)
    join_token_path: Path | None = setting(None, help="File of join tokens, one per line, all valid; re-read when it changes (rotation without a restart). Replaces join_token.")
    deployments: tuple[str, ...] = setting((), help="Deployments whose size this manager actuates.")
    heartbeat_interval_s: float = setting(1.0, parser=DURATION_S, help="Worker heartbeat period.")
    heartbeat_timeout_s: float = setting(5.0, parser=DURATION_S, help="No heartbeat this long = FAILED.")
    is_provisioning: bool = setting(False, help="Start and stop local worker processes to meet the target size.")
    worker_args: str = setting("", help="Extra arguments for provisioned workers (shell words).")
    initial_target_size: int = setting(-1, parser=int_range(-1, 100_000), help="Target size set at start (-1 = leave).")

    def check(self) -> None:
        CommonSettings.check(self)
        if not self.join_token and self.join_token_path is None:
            raise ConfigError("PDSERVE_JOIN_TOKEN: required, set it or PDSERVE_JOIN_TOKEN_PATH",
                              field="join_token")


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorSettings(CommonSettings):
    """The KV-transfer coordinator."""

    service_name: str = setting("kv-transfer", help="Service name in logs, traces and metrics.")
    default_lease_s: float = setting(10.0, parser=DURATION_S, help="Lease of a ticket unless the caller asks.")
    max_lease_s: float = setting(300.0, parser=DURATION_S, help="Longest lease granted.")
    reap_interval_s: float = setting(0.5, parser=DURATION_S, help="How often lapsed leases are reaped.")


def _tenant_values(parse_value: type[int | float]) -> Parser[tuple[tuple[str, float], ...]]:
    """``tenant=value,tenant=value``; an empty tenant name (``=4``) is the default tenant."""

    def parse(raw: str) -> tuple[tuple[str, float], ...]:
        pairs = []
        for part in raw.split(","):
            if not part.strip():
                continue
            tenant, sep, value = part.partition("=")
            number = parse_value(value.strip())
            if not sep or not number > 0:
                raise ValueError(raw)
            pairs.append((tenant.strip(), number))
        return tuple(pairs)

    kind = "integers" if parse_value is int else "numbers"
    return Parser(f"comma-separated tenant=value pairs (positive {kind})", parse)


TENANT_INTS = _tenant_values(int)
TENANT_FLOATS = _tenant_values(float)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings(CommonSettings):
    """A router replica."""

    service_name: str = setting("router", help="Service name in logs, traces and metrics.")
    http_host: str = setting("127.0.0.1", help="Interface of the OpenAI-compatible HTTP API.")
    http_port: int = setting(0, parser=PORT_OR_OFF, help="HTTP port; 0 = any, -1 = off.")
    coordinator_address: str = setting(parser=ADDRESS, help="host:port of the KV-transfer coordinator.")
    max_attempts: int = setting(3, parser=int_range(1, 10), help="Attempts per request before the first token.")
    max_in_flight: int = setting(4096, parser=int_range(1, 1_000_000), help="Requests admitted at once.")
    max_tokens_limit: int = setting(32768, parser=int_range(1, 10_000_000), help="Largest max_tokens accepted.")
    local_prefill_threshold_tokens: int = setting(64, parser=int_range(0, 10_000_000), help="Uncached prompt tokens at or below which decode prefills itself.")
    prefill_saturation_tokens: int = setting(65536, parser=int_range(0, 10**9), help="Queued prefill tokens beyond which prompts prefill locally.")
    lease_s: float = setting(10.0, parser=DURATION_S, help="Lease asked for each ticket.")
    stream_idle_timeout_s: float = setting(20.0, parser=DURATION_S, help="Longest silence of a decode stream after its first token (before it, plus the KV wait) before the request ends with DEADLINE_EXCEEDED.")
    transport: str = setting("tcp", help="KV transport workers use.")
    slo_ttft_ms: float = setting(2000.0, parser=float_range(0.001, 1e9), help="TTFT SLO for goodput, ms.")
    slo_tpot_ms: float = setting(100.0, parser=float_range(0.001, 1e9), help="TPOT SLO for goodput, ms.")
    outcome_window_s: float = setting(10.0, parser=DURATION_S, help="Window of the durable request-outcome aggregates.")
    # Admission and load shedding: pdserve.router.admission.
    is_shedding_enabled: bool = setting(True, help="Shed requests whose predicted TTFT misses the SLO, and tenants over their share of a saturated queue.")
    shed_ttft_fraction: float = setting(0.8, parser=float_range(0.01, 100.0), help="Shed when the predicted TTFT exceeds this fraction of slo_ttft_ms.")
    fair_share_onset: float = setting(0.5, parser=float_range(0.01, 1.0), help="Queue saturation (fraction of the TTFT budget or of max_pending_requests) beyond which tenants over their share are shed.")
    max_pending_requests: int = setting(1024, parser=int_range(1, 1_000_000), help="Router queue bound: admitted requests whose prefill has not finished.")
    tenant_share: float = setting(0.5, parser=float_range(0.001, 1.0), help="Default in-flight cap of a tenant, as a fraction of max_in_flight.")
    tenant_max_in_flight: tuple[tuple[str, int], ...] = setting((), parser=TENANT_INTS, help="Per-tenant in-flight caps, tenant=N pairs (=N for the default tenant).")
    tenant_weights: tuple[tuple[str, float], ...] = setting((), parser=TENANT_FLOATS, help="Fair-share weights, tenant=W pairs; others weigh 1.")
    max_retry_after_s: float = setting(10.0, parser=DURATION_S, help="Longest retry hint given to a shed request.")


@dataclass(frozen=True, slots=True, kw_only=True)
class GovernorSettings(CommonSettings):
    """The capacity governor."""

    service_name: str = setting("governor", help="Service name in logs, traces and metrics.")
    # Expert placement (EPLB) of MoE pools: pdserve.governor.experts.
    expert_half_life_s: float = setting(300.0, parser=float_range(0.001, 1e9), help="Half-life of the decayed per-expert load estimate, seconds.")
    expert_replan_period_s: float = setting(600.0, parser=float_range(0.001, 1e9), help="Re-plan expert placement at least this often, seconds.")
    expert_min_balancedness: float = setting(0.85, parser=float_range(0.0, 1.0), help="Re-plan early when the placement's mean GPU balancedness (mean/max load) falls under this.")
    expert_min_replan_interval_s: float = setting(60.0, parser=DURATION_S, help="Least time between two re-plans triggered by imbalance, seconds.")
    expert_min_tokens_per_layer: float = setting(10_000.0, parser=float_range(0.0, 1e15), help="Decayed tokens per MoE layer needed before planning.")
    expert_balance_tolerance: float = setting(0.01, parser=float_range(0.0, 0.99), help="Migration-aware re-plans stop within this balancedness of a plan from scratch.")
    expert_slots_per_gpu: int = setting(0, parser=int_range(0, 4096), help="Expert slots per GPU per layer; 0 = fewest that hold every expert, plus one if none is left redundant.")
    expert_gpus_per_node: int = setting(8, parser=int_range(1, 1024), help="GPUs per node of an expert-parallel instance.")
    expert_num_groups: int = setting(1, parser=int_range(1, 4096), help="Expert groups kept on one node in prefill pools (DeepSeek-V3: 8); 1 = global placement.")
    expert_tick_s: float = setting(1.0, parser=float_range(0.01, 3600.0), help="Period of the expert-placement loop (drain reports, decide, roll out), seconds.")
    expert_rollout_timeout_s: float = setting(5.0, parser=float_range(0.01, 3600.0), help="Deadline of one worker's ApplyExpertPlacement call, seconds.")
    # Autoscaler (pdserve.governor.autoscaling): deployments sized, the look-ahead, actuation.
    autoscale_deployments: tuple[str, ...] = setting((), help="Deployments the autoscaler sizes (model, GPU and TP from their durable records, else the settings below); empty = none.")
    autoscale_gpu: str = setting(DEFAULT_GPU, help="GPU of a deployment without a durable record.")
    autoscale_tp_size: int = setting(1, parser=int_range(1, 1024), help="Tensor-parallel degree of a deployment without a durable record.")
    autoscale_interval_s: float = setting(30.0, parser=float_range(0.01, 86400.0), help="Seconds between autoscaling decisions.")
    autoscale_cold_start_s: float = setting(600.0, parser=DURATION_S, help="Launch-to-serving time of a new instance: how far ahead the autoscaler looks.")
    autoscale_speedup: float = setting(1.0, parser=float_range(1e-3, 1e12), help="Simulated seconds per wall second of the instances (sim workers); 1 on GPUs.")
    autoscale_max_num_blocks: int = setting(0, parser=int_range(0, 10_000_000), help="Cap on KV blocks per decode instance, as sim workers apply (0 = none).")
    autoscale_slo_tpot_ms: float = setting(100.0, parser=float_range(0.001, 1e9), help="TPOT SLO that bounds the decode batch, ms.")
    autoscale_max_gpus: int = setting(0, parser=int_range(0, 10_000_000), help="GPU budget over both pools of a deployment (0 = none); operators change it with SetAutoscalerControls.")
    leader_lease_s: float = setting(5.0, parser=float_range(0.1, 3600.0), help="Lease of the active governor replica (active/standby): a standby takes over about this long after the active one dies.")
    is_autoscaler_dry_run: bool = setting(False, help="Recommend only: record decisions, never set pool targets.")
    prefill_pool_address: str | None = setting(None, parser=optional(ADDRESS), help="host:port of the prefill pool manager (targets are set there); empty = recommend only.")
    decode_pool_address: str | None = setting(None, parser=optional(ADDRESS), help="host:port of the decode pool manager; empty = recommend only.")
