"""The client commands against a stack that requires API keys: refused without a key, served
with one given as a flag or in the environment. Without mutual TLS the internal and operator
methods are locked too (``pdserve up`` wires a generated service token and worker
credentials); tests/integration/test_tls_e2e.py covers the mTLS stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ServiceProcess

CLIENT_KEY = "sk-client-0123456789abcdef"
ADMIN_KEY = "sk-admin-0123456789abcdef"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True,
                          text=True, env={**base, **(env or {})}, timeout=60)


@pytest.mark.timeout(180)
def test_generate_and_status_carry_api_keys(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text(f"{CLIENT_KEY} tenant-a\n")
    (tmp_path / "admin").write_text(f"{ADMIN_KEY} operator\n")
    stack = ServiceProcess("up", [
        "up", "--grpc-port", "0", "--http-port", "-1", "--speedup", "100",
        "--num-prefill", "1", "--num-decode", "1",
        "--api-keys-path", str(tmp_path / "keys"), "--admin-keys-path", str(tmp_path / "admin"),
    ], {})
    stack.start().wait_ready()
    try:
        address = stack.grpc_address
        generate = ["generate", "a prompt long enough", "--address", address,
                    "--model", "llama-3.1-8b", "--max-tokens", "3"]
        refused = _run(*generate)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        # No open doors without mTLS: an unauthenticated SetTargetSize of the decode pool to 0
        # (once accepted, it drained every decode worker) and a client key on it are refused.
        import grpc

        from pdserve.api.v1 import common_pb2, pool_pb2, pool_pb2_grpc
        from pdserve.common.credentials import bearer_metadata

        with grpc.insecure_channel(address) as channel:
            pool = pool_pb2_grpc.PoolServiceStub(channel)
            request = pool_pb2.SetTargetSizeRequest(
                deployment="llama-3.1-8b", role=common_pb2.WORKER_ROLE_DECODE, num_workers=0)
            for metadata, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                                   (bearer_metadata(CLIENT_KEY),
                                    grpc.StatusCode.PERMISSION_DENIED)):
                with pytest.raises(grpc.RpcError) as caught:
                    pool.SetTargetSize(request, metadata=metadata, timeout=10)
                assert caught.value.code() is code
        served = _run(*generate, "--api-key", CLIENT_KEY)
        assert served.returncode == 0, served.stderr
        assert "3 tokens" in served.stderr
        as_admin = _run("status", "--address", address, env={"PDSERVE_API_KEY": ADMIN_KEY})
        assert as_admin.returncode == 0, as_admin.stderr
        assert "decode" in as_admin.stdout and "prefill" in as_admin.stdout
    finally:
        stack.stop()
