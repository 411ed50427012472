"""A whole stack in this process, locked without mutual TLS: admin keys and a service token file
on the control plane, a verify-only (``sha256:``) copy on the workers' own servers, workers
that join by the join token alone and use the credential their pool hands them. Real gRPC
between every part. It serves requests; a worker credential acts only on tickets that name its
worker."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.common.credentials import bearer_metadata, token_digest_line, worker_credential

MODEL = "llama-3.1-8b"
JOIN_TOKEN = "join-" + "j" * 27
SERVICE_TOKEN = "st-" + "s" * 29
ADMIN_KEY = "ak-" + "c" * 29


async def test_a_locked_stack_serves_and_binds_worker_credentials_to_their_tickets(
        tmp_path: Path) -> None:
    import aiohttp
    from helpers.local_stack import local_stack

    (tmp_path / "tokens").write_text(f"{SERVICE_TOKEN}\n")
    (tmp_path / "digests").write_text(token_digest_line(SERVICE_TOKEN) + "\n")
    (tmp_path / "admin").write_text(f"{ADMIN_KEY} ops\n")
    locked = {"service_tokens_path": tmp_path / "tokens", "admin_keys_path": tmp_path / "admin"}
    async with local_stack(MODEL, JOIN_TOKEN, local_prefill_threshold_tokens=8, locked=locked,
                           worker_settings={"service_tokens_path": tmp_path / "digests"}
                           ) as stack:
        workers = list(stack.workers.values())  # the prefill worker first
        for worker in workers:
            assert worker.credential == worker_credential(SERVICE_TOKEN,
                                                          worker.agent.config.worker_id)
        address = stack.address

        # Served end to end: router -> workers (service token, checked by digest), workers ->
        # pool and coordinator (their credentials), a remote prefill with a KV handoff.
        body = {"model": MODEL, "prompt": "a prompt long enough to prefill remotely",
                "max_tokens": 4}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{stack.http_url}/v1/completions",
                                    json=body) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["usage"]["completion_tokens"] == 4

        async with grpc.aio.insecure_channel(address) as channel:
            kv = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
            opened = await kv.OpenTicket(kv_transfer_pb2.OpenTicketRequest(
                deployment=MODEL, decode_worker_id="d-1", prefill_worker_id="p-1",
                num_blocks=4, lease_ms=5000, num_prompt_tokens=40),
                metadata=bearer_metadata(SERVICE_TOKEN), timeout=5)
            renew = kv_transfer_pb2.RenewLeaseRequest(token=opened.ticket.token, lease_ms=5000)
            for credential, code in (
                    (None, grpc.StatusCode.UNAUTHENTICATED),
                    (worker_credential(SERVICE_TOKEN, "intruder"),
                     grpc.StatusCode.PERMISSION_DENIED),
                    (worker_credential("another-token-0123456789", "p-1"),
                     grpc.StatusCode.UNAUTHENTICATED)):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await kv.RenewLease(renew, timeout=5, metadata=(
                        bearer_metadata(credential) if credential else None))
                assert caught.value.code() is code, credential
            await kv.RenewLease(renew, timeout=5, metadata=bearer_metadata(workers[0].credential))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await kv.AbortTicket(kv_transfer_pb2.AbortTicketRequest(
                    token=opened.ticket.token, reason="not mine"), timeout=5,
                    metadata=bearer_metadata(worker_credential(SERVICE_TOKEN, "p-2")))
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            await kv.AbortTicket(kv_transfer_pb2.AbortTicketRequest(
                token=opened.ticket.token, reason="test done"), timeout=5,
                metadata=bearer_metadata(ADMIN_KEY))
