"""The live autoscaler in a simulation (``pdserve simulate --autoscale``).

``autoscaler_for`` builds the policy the governor runs for a deployment
(``pdserve.capacity.autoscaler.Autoscaler`` over an ``InstanceProfile`` from the catalog, sized
for the TPOT SLO); the simulator calls it every ``scaling_interval_s`` with its observation, and
the instances it adds serve only ``cold_start_s`` after they are launched. ``scale_ups`` and
``pool_capacity_per_s`` read the run back: when each pool's target rose, and the request rate a
pool of a given size serves by the autoscaler's own sizing arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.capacity.autoscaler import Autoscaler
from pdserve.capacity.controls import AutoscalerConfig
from pdserve.capacity.sizing import (
    InstanceProfile,
    LengthMoments,
    SizingConfig,
    decode_rate_per_instance,
    prefill_rate_per_instance,
)
from pdserve.sim.config import ClusterSpec
from pdserve.sim.result import SimResult


def profile_for(cluster: ClusterSpec) -> InstanceProfile:
    """The capacity profile of the cluster's instances (each pool at its own TP)."""
    return InstanceProfile.from_catalog(
        cluster.model, cluster.gpu, prefill_tp_size=cluster.prefill_tp,
        decode_tp_size=cluster.tp_size, block_size_tokens=cluster.block_size_tokens,
        max_batch_size=cluster.max_batch_size,
        gpu_memory_utilization=cluster.gpu_memory_utilization)


def autoscaler_for(cluster: ClusterSpec, tpot_slo_s: float) -> Autoscaler:
    """The governor's autoscaler for a deployment of ``cluster``'s instances (default tunables,
    sizing for ``tpot_slo_s``)."""
    return Autoscaler(profile_for(cluster),
                      AutoscalerConfig(sizing=SizingConfig(tpot_slo_s=tpot_slo_s)))


def pool_capacity_per_s(cluster: ClusterSpec, sizing: SizingConfig, num_prefill: int,
                        num_decode: int, mean_prompt_tokens: float, mean_output_tokens: float,
                        moments: LengthMoments | None = None) -> float:
    """Requests per second ``num_prefill`` + ``num_decode`` instances serve at ``sizing``'s
    target utilisations (the autoscaler's own arithmetic; targets of 1: where they saturate).
    ``moments``: the lengths' higher moments, as the autoscaler sees them (None: every request
    of the mean lengths)."""
    profile = profile_for(cluster)
    prefill = prefill_rate_per_instance(profile, sizing, mean_prompt_tokens,
                                        moments.prompt_squared if moments else 0.0)
    decode, _, _ = decode_rate_per_instance(profile, sizing, mean_prompt_tokens,
                                            mean_output_tokens, moments)
    return min(num_prefill * prefill, num_decode * decode)


@dataclass(frozen=True, slots=True)
class ScaleUp:
    """A decision that raised a pool's target: when, from what to what (both pools)."""

    time_s: float
    num_prefill_before: int
    num_decode_before: int
    num_prefill: int
    num_decode: int


def scale_ups(result: SimResult) -> tuple[ScaleUp, ...]:
    """Every scaling decision that raised either pool's target above the one before (the
    starting pools count as the first target)."""
    cluster = result.config.cluster
    prefill, decode = cluster.num_prefill, cluster.num_decode
    ups = []
    for record in result.scaling:
        if record.num_prefill > prefill or record.num_decode > decode:
            ups.append(ScaleUp(record.time_s, prefill, decode, record.num_prefill,
                               record.num_decode))
        prefill, decode = record.num_prefill, record.num_decode
    return tuple(ups)
