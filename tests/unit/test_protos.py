"""The committed generated code matches the protos, and the protos follow the API rules."""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos" / "pdserve" / "api" / "v1"
GENERATED_DIR = ROOT / "services" / "pdserve" / "api" / "v1"


def test_regenerating_protos_changes_nothing(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True, env=env, capture_output=True,
    )
    fresh = tmp_path / "pdserve" / "api" / "v1"
    fresh_names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    committed_names = sorted(
        p.name for p in GENERATED_DIR.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")
    )
    assert fresh_names == committed_names
    _, mismatch, errors = filecmp.cmpfiles(fresh, GENERATED_DIR, fresh_names, shallow=False)
    assert mismatch == [] and errors == [], f"regenerate with scripts/gen_protos.sh: {mismatch}"


def _proto_files() -> list[Path]:
    files = sorted(PROTO_DIR.glob("*.proto"))
    assert files, "no protos found"
    return files


@pytest.mark.parametrize("path", _proto_files(), ids=lambda p: p.name)
def test_every_message_field_and_enum_value_has_a_comment(path: Path) -> None:
    lines = path.read_text().splitlines()
    declaration = re.compile(
        r"^\s*(message|enum|service|rpc)\s+\w+|^\s*(repeated\s+|optional\s+)?[\w.]+\s+\w+\s*=\s*\d+\s*;"
    )
    missing = []
    for index, line in enumerate(lines):
        if declaration.match(line) and not line.lstrip().startswith("//"):
            previous = lines[index - 1].strip() if index else ""
            if not previous.startswith("//"):
                missing.append(f"{path.name}:{index + 1}: {line.strip()}")
    assert missing == []


@pytest.mark.parametrize("path", _proto_files(), ids=lambda p: p.name)
def test_enums_start_with_unspecified_zero(path: Path) -> None:
    text = path.read_text()
    for name, body in re.findall(r"enum\s+(\w+)\s*\{(.*?)\}", text, flags=re.S):
        first = re.search(r"(\w+)\s*=\s*(\d+)\s*;", body)
        assert first is not None
        assert first.group(1).endswith("_UNSPECIFIED") and first.group(2) == "0", name
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper() + "_"
        for value in re.findall(r"(\w+)\s*=\s*\d+\s*;", body):
            assert value.startswith(prefix), f"{name}.{value} must start with {prefix}"


def test_package_is_versioned_and_services_are_named() -> None:
    services = []
    for path in _proto_files():
        text = path.read_text()
        assert "package pdserve.api.v1;" in text
        services += re.findall(r"service\s+(\w+)", text)
    assert set(services) == {
        "RouterService", "PoolService", "KvTransferService",
        "CapacityGovernorService", "WorkerAgentService",
    }


def test_each_rpc_has_its_own_request_and_response() -> None:
    for path in _proto_files():
        for rpc, request, response in re.findall(
            r"rpc\s+(\w+)\((\w+)\)\s+returns\s+\((?:stream\s+)?(\w+)\)", path.read_text()
        ):
            assert request == f"{rpc}Request", (path.name, rpc)
            assert response == f"{rpc}Response", (path.name, rpc)
