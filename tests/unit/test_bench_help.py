"""Every benchmark script answers ``--help``: it imports, parses its arguments and exits 0 in the
README's environment (no optional package assumed), so a change elsewhere cannot break one
silently. Scripts whose names start with ``_`` are the benchmarks' shared modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 10, [p.name for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_help(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=BENCH.parent)
    assert done.returncode == 0, f"{script.name} --help exited {done.returncode}:\n{done.stderr}"
    assert "usage:" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
