"""Discrete-event simulation of a disaggregated prefill/decode cluster, driven by the same
pure policies the live services run (routing, ticket transitions, admission, autoscaling)."""

from pdserve.sim.config import ClusterSpec, Failure, SimConfig, SloSpec
from pdserve.sim.result import MissReason, RequestStatus, SimResult
from pdserve.sim.simulator import Simulator, simulate

__all__ = [
    "ClusterSpec",
    "Failure",
    "MissReason",
    "RequestStatus",
    "SimConfig",
    "SimResult",
    "Simulator",
    "SloSpec",
    "simulate",
]
