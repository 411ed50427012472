"""Metrics of the governor's autoscaling loop: every decision by action, and the target it set."""

from __future__ import annotations

from pdserve.common.metrics import counter, gauge

DECISIONS = counter(
    "governor", "scaling", "decisions",
    "Autoscaler decisions per pool by action (scale_up, scale_down, hold), dry runs included.",
    ["deployment", "role", "action", "is_dry_run"])
TARGETS = gauge(
    "governor", "target", "instances",
    "Instances the autoscaler's latest decision wants in a pool.", ["deployment", "role"])
