#!/usr/bin/env bash
# Regenerate the committed Python code for protos/pdserve/api/v1 into services/pdserve/api/v1.
# Uses grpcio-tools as pinned in pyproject.toml; the output import path equals the proto path,
# so no import is rewritten. tests/unit/test_protos_generated.py fails if this would change anything.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$here/services}"
python="${PYTHON:-python}"
"$python" - <<'PY'
import importlib.metadata as m, sys
want = "1.85.1"
have = m.version("grpcio-tools")
if have != want:
    sys.exit(f"gen_protos: grpcio-tools {want} is required (pyproject pin), found {have}")
PY
mkdir -p "$out/pdserve/api/v1"
cd "$here/protos"
"$python" -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  pdserve/api/v1/*.proto
touch "$out/pdserve/api/__init__.py" "$out/pdserve/api/v1/__init__.py"
