"""The settings of the capacity governor (``pdserve serve governor``).

Every field has an environment variable ``PDSERVE_<NAME>`` and a flag ``--name`` (the flag wins);
``pdserve serve governor --help`` lists them with their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.settings import CommonSettings
from pdserve.common.settings_fields import setting
from pdserve.common.settings_parsers import ADDRESS, DURATION_S, float_range, int_range, optional
from pdserve.perf.catalog import DEFAULT_GPU


@dataclass(frozen=True, slots=True, kw_only=True)
class GovernorSettings(CommonSettings):
    """The capacity governor."""

    service_name: str = setting("governor", help="Service name in logs, traces and metrics.")
    # Expert placement (EPLB) of MoE pools: pdserve.governor.expert_loop.
    expert_half_life_s: float = setting(
        300.0, parser=float_range(0.001, 1e9),
        help="Half-life of the decayed per-expert load estimate, seconds.")
    expert_replan_period_s: float = setting(
        600.0, parser=float_range(0.001, 1e9),
        help="Re-plan expert placement at least this often, seconds.")
    expert_min_balancedness: float = setting(
        0.85, parser=float_range(0.0, 1.0),
        help="Re-plan early when the placement's mean GPU balancedness (mean/max load) falls "
             "under this.")
    expert_min_replan_interval_s: float = setting(
        60.0, parser=DURATION_S,
        help="Least time between two re-plans triggered by imbalance, seconds.")
    expert_min_tokens_per_layer: float = setting(
        10_000.0, parser=float_range(0.0, 1e15),
        help="Decayed tokens per MoE layer needed before planning.")
    expert_balance_tolerance: float = setting(
        0.01, parser=float_range(0.0, 0.99),
        help="Migration-aware re-plans stop within this balancedness of a plan from scratch.")
    expert_slots_per_gpu: int = setting(
        0, parser=int_range(0, 4096),
        help="Expert slots per GPU per layer; 0 = fewest that hold every expert, plus one if none "
             "is left redundant.")
    expert_gpus_per_node: int = setting(
        8, parser=int_range(1, 1024),
        help="GPUs per node of an expert-parallel instance.")
    expert_num_groups: int = setting(
        1, parser=int_range(1, 4096),
        help="Expert groups kept on one node in prefill pools (DeepSeek-V3: 8); 1 = global "
             "placement.")
    expert_tick_s: float = setting(
        1.0, parser=float_range(0.01, 3600.0),
        help="Period of the expert-placement loop (drain reports, decide, roll out), seconds.")
    expert_rollout_timeout_s: float = setting(
        5.0, parser=float_range(0.01, 3600.0),
        help="Deadline of one worker's ApplyExpertPlacement call, seconds.")
    # Autoscaler (pdserve.governor.autoscaling): deployments sized, the look-ahead, actuation.
    autoscale_deployments: tuple[str, ...] = setting(
        (),
        help="Deployments the autoscaler sizes (model, GPU and TP from their durable records, "
             "else the settings below); empty = none.")
    autoscale_gpu: str = setting(DEFAULT_GPU, help="GPU of a deployment without a durable record.")
    autoscale_tp_size: int = setting(
        1, parser=int_range(1, 1024),
        help="Tensor-parallel degree of a deployment without a durable record.")
    autoscale_interval_s: float = setting(
        30.0, parser=float_range(0.01, 86400.0),
        help="Seconds between autoscaling decisions.")
    autoscale_cold_start_s: float = setting(
        600.0, parser=DURATION_S,
        help="Launch-to-serving time of a new instance: how far ahead the autoscaler looks.")
    autoscale_speedup: float = setting(
        1.0, parser=float_range(1e-3, 1e12),
        help="Simulated seconds per wall second of the instances (sim workers); 1 on GPUs.")
    autoscale_max_num_blocks: int = setting(
        0, parser=int_range(0, 10_000_000),
        help="Cap on KV blocks per decode instance, as sim workers apply (0 = none).")
    autoscale_slo_tpot_ms: float = setting(
        100.0, parser=float_range(0.001, 1e9),
        help="TPOT SLO that bounds the decode batch, ms.")
    autoscale_slo_ttft_ms: float = setting(
        2000.0, parser=float_range(0.001, 1e9),
        help="TTFT SLO the local-prefill threshold is derived against, ms (with "
             "autoscale_slo_tpot_ms).")
    autoscale_slo_percentile: float = setting(
        90.0, parser=float_range(0.001, 99.999),
        help="Percentile of requests the governor's plans by replay must meet both SLOs at.")
    live_plan_interval_s: float = setting(
        300.0, parser=float_range(0.0, 86400.0),
        help="Seconds between the governor's plans by replay of its observed window (each "
             "simulates for up to live_plan_budget_s of CPU, in a thread); 0 = none.")
    live_plan_window_s: float = setting(
        600.0, parser=float_range(1.0, 86400.0),
        help="Observed window a plan by replay is made from, seconds (the hot store keeps a "
             "finished request's ticket 600 s: a longer window sees no more).")
    live_plan_budget_s: float = setting(
        30.0, parser=float_range(0.1, 3600.0),
        help="Replay time a plan by replay may take per deployment, seconds.")
    is_threshold_dry_run: bool = setting(
        False,
        help="Record the local-prefill threshold the governor computes, never publish it to the "
             "routers (operators' pins are published all the same).")
    autoscale_max_gpus: int = setting(
        0, parser=int_range(0, 10_000_000),
        help="GPU budget over both pools of a deployment (0 = none); operators change it with "
             "SetAutoscalerControls.")
    leader_lease_s: float = setting(
        5.0, parser=float_range(0.1, 3600.0),
        help="Lease of the active governor replica (active/standby): a standby takes over about "
             "this long after the active one dies.")
    is_autoscaler_dry_run: bool = setting(
        False,
        help="Recommend only: record decisions, never set pool targets.")
    prefill_pool_address: str | None = setting(
        None, parser=optional(ADDRESS),
        help="host:port of the prefill pool manager (targets are set there); empty = recommend "
             "only.")
    decode_pool_address: str | None = setting(
        None, parser=optional(ADDRESS),
        help="host:port of the decode pool manager; empty = recommend only.")
