"""The router's OpenAI HTTP API terminates TLS itself: it serves HTTPS with the configured
certificate (checked against the certificate the client is handed, byte for byte), refuses
plain HTTP on that port, and a certificate/key pair that does not fit is one error naming the
setting."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers.tokenizers import OneTokenizer

from pdserve.common.certs import make_dev_certs
from pdserve.common.errors import ConfigError
from pdserve.common.tokenizer import ByteTokenizer
from pdserve.router.http_api import create_app, server_ssl_context, start_http_server
from pdserve.router.settings import RouterSettings
from pdserve.router.types import FinishReason, GenerationChunk, GenerationRequest, ModelCard


class OneTokenBackend:
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk(token_ids=(65,), finish_reason=FinishReason.LENGTH)

    async def cancel(self, request_id: str) -> bool:
        return False

    def list_models(self) -> list[ModelCard]:
        return [ModelCard("m", max_context_tokens=128)]


async def test_https_serves_with_the_configured_certificate(tmp_path: Path) -> None:
    import aiohttp

    router, other = make_dev_certs(tmp_path, ["router", "governor"])
    app = create_app(OneTokenBackend(), OneTokenizer(ByteTokenizer()))
    runner, port = await start_http_server(
        app, "127.0.0.1", 0, server_ssl_context(router.cert_path, router.key_path))
    client_context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    try:
        # The handshake hands the client exactly the configured certificate.
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context, server_hostname="localhost")
        ssl_object = writer.get_extra_info("ssl_object")
        served = ssl_object.getpeercert(binary_form=True)
        writer.close()
        await writer.wait_closed()
        assert served == ssl.PEM_cert_to_DER_cert(router.cert_path.read_text())
        assert served != ssl.PEM_cert_to_DER_cert(other.cert_path.read_text())
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            async with session.post(f"https://localhost:{port}/v1/completions", json=body,
                                    ssl=client_context) as response:
                assert response.status == 200
                assert (await response.json())["choices"][0]["text"] == "A"
            with pytest.raises(aiohttp.ClientError):  # plain HTTP gets no answer there
                async with session.get(f"http://127.0.0.1:{port}/health") as response:
                    await response.read()
    finally:
        await runner.cleanup()


def test_a_certificate_and_key_that_do_not_fit_name_the_setting(tmp_path: Path) -> None:
    router, other = make_dev_certs(tmp_path, ["router", "governor"])
    with pytest.raises(ConfigError) as caught:
        server_ssl_context(router.cert_path, other.key_path)
    assert caught.value.field == "http_tls_cert_path"
    with pytest.raises(ConfigError) as caught:
        RouterSettings(coordinator_address="127.0.0.1:1",
                       http_tls_cert_path=router.cert_path).check()
    assert caught.value.field == "http_tls_cert_path"
    RouterSettings(coordinator_address="127.0.0.1:1", http_tls_cert_path=router.cert_path,
                   http_tls_key_path=router.key_path).check()
