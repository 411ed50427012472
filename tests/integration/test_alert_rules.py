"""The shipped Prometheus configuration and alert rules: ``promtool check`` accepts them and
``promtool test rules`` runs their unit tests (infra/prometheus/tests)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers.requirements import require_tool

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "infra" / "prometheus"


def _promtool(*args: str) -> str:
    promtool = require_tool("promtool", "apt-get install prometheus")
    result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_rules_check() -> None:
    for rules in sorted((PROMETHEUS / "rules").glob("*.yml")):
        assert "SUCCESS" in _promtool("check", "rules", str(rules))


def test_config_checks() -> None:
    assert "SUCCESS" in _promtool("check", "config", "--syntax-only",
                                  str(PROMETHEUS / "prometheus.yml"))


@pytest.mark.parametrize("tests", sorted((PROMETHEUS / "tests").glob("*.yml")),
                         ids=lambda p: p.name)
def test_rule_unit_tests_pass(tests: Path) -> None:
    assert "SUCCESS" in _promtool("test", "rules", str(tests))
