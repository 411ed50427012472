"""Every metric the shipped Grafana dashboard and Prometheus alert rules query is one the services
export, and the dashboard has a panel for each thing an operator of the stack must see.

The exported names are read from the code, not listed here: every call of
``pdserve.common.metrics.counter/gauge/histogram`` with literal ``(area, noun, unit)`` in the
package gives ``pdserve_<area>_<noun>_<unit>``, with the series the client library exposes
(``_total`` for counters, ``_bucket``/``_sum``/``_count`` for histograms).
"""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest
import yaml

from pdserve.common.metrics import metric_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "pdserve"
DASHBOARDS = sorted((ROOT / "infra" / "grafana" / "dashboards").glob("*.json"))
RULES = sorted((ROOT / "infra" / "prometheus" / "rules").glob("*.yml"))
_METRIC_RE = re.compile(r"\bpdserve_[a-z0-9_]+\b")
_SERIES_SUFFIXES = {"counter": ("_total",), "gauge": ("",),
                    "histogram": ("_bucket", "_sum", "_count")}


def _metrics_factories(tree: ast.Module) -> dict[str, str]:
    """Local names bound to pdserve.common.metrics' factories in one module."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "pdserve.common.metrics":
            for alias in node.names:
                if alias.name in _SERIES_SUFFIXES:
                    names[alias.asname or alias.name] = alias.name
    return names


@functools.cache
def exported_series() -> dict[str, Path]:
    """Series name -> the module that defines it, over the whole package."""
    series: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        if "api" in path.relative_to(PACKAGE).parts[:1]:
            continue
        tree = ast.parse(path.read_text(), str(path))
        factories = _metrics_factories(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in factories):
                continue
            words = [w.value for w in node.args[:3]
                     if isinstance(w, ast.Constant) and isinstance(w.value, str)]
            assert len(words) == 3, (
                f"{path}:{node.lineno}: metric name parts must be literals for this test")
            name = metric_name(*words)
            for suffix in _SERIES_SUFFIXES[factories[node.func.id]]:
                series[name + suffix] = path
    return series


def _dashboard_exprs(path: Path) -> list[tuple[str, str]]:
    dashboard = json.loads(path.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append((panel["title"], target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        exprs.append((f"variable {variable['name']}",
                      query["query"] if isinstance(query, dict) else str(query)))
    return exprs


def _rule_exprs(path: Path) -> list[tuple[str, str]]:
    groups = yaml.safe_load(path.read_text())["groups"]
    return [(rule.get("alert") or rule["record"], rule["expr"])
            for group in groups for rule in group["rules"]]


def test_the_code_exports_the_metrics_this_test_reads() -> None:
    series = exported_series()
    assert "pdserve_router_time_to_first_token_seconds_bucket" in series
    assert "pdserve_pool_size_workers" in series
    assert "pdserve_transfer_moved_bytes_total" in series


@pytest.mark.parametrize("path", DASHBOARDS + RULES, ids=lambda p: p.name)
def test_every_query_names_an_exported_metric(path: Path) -> None:
    series = exported_series()
    exprs = _dashboard_exprs(path) if path.suffix == ".json" else _rule_exprs(path)
    assert exprs
    recorded = {name for name, _ in exprs if ":" in name}
    for where, expr in exprs:
        names = set(_METRIC_RE.findall(expr))
        uses_recorded = any(name in expr for name in recorded)
        assert names or uses_recorded, f"{path.name} {where}: no pdserve metric in {expr!r}"
        unknown = sorted(names - set(series))
        assert not unknown, f"{path.name} {where}: {unknown} are not exported by any service"


def test_the_dashboard_has_a_panel_for_each_operator_question() -> None:
    (path,) = [p for p in DASHBOARDS if p.name == "pdserve.json"]
    panel_metrics: dict[str, set[str]] = {}
    for title, expr in _dashboard_exprs(path):
        panel_metrics.setdefault(title, set()).update(_METRIC_RE.findall(expr))
    required = {
        "TTFT percentiles": {"pdserve_router_time_to_first_token_seconds_bucket"},
        "TPOT percentiles": {"pdserve_router_time_per_output_token_seconds_bucket"},
        "goodput": {"pdserve_router_goodput_requests"},
        "SLO misses by reason": {"pdserve_router_slo_missed_requests_total"},
        "pool sizes by state": {"pdserve_pool_size_workers"},
        "KV blocks free/reserved/held": {"pdserve_pool_free_kv_blocks",
                                         "pdserve_pool_reserved_kv_blocks",
                                         "pdserve_pool_held_kv_blocks"},
        "transfer bandwidth": {"pdserve_transfer_moved_bytes_total"},
        "exposed transfer time": {"pdserve_transfer_exposed_seconds_bucket"},
        "admission refusals by tenant": {"pdserve_router_refused_requests_total"},
        "autoscaler decisions": {"pdserve_governor_scaling_decisions_total"},
    }
    for question, needed in required.items():
        assert any(needed <= names for names in panel_metrics.values()), (
            f"no panel answers {question!r} (one panel querying {sorted(needed)})")
    dashboard = json.loads(path.read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {"prometheus"}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
