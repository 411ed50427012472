"""Connection options shared by the client commands (generate, status, audit, experts): TLS
files and an API key, each with a flag and a ``PDSERVE_`` variable, for a locked-down stack."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection (flag > environment)")
    group.add_argument("--api-key", default=None,
                       help="client or admin API key, sent as a bearer token [PDSERVE_API_KEY]")
    group.add_argument("--tls-ca-path", default=None,
                       help="PEM CA that signed the servers; turns on TLS [PDSERVE_TLS_CA_PATH]")
    group.add_argument("--tls-cert-path", default=None,
                       help="PEM client certificate for mutual TLS [PDSERVE_TLS_CERT_PATH]")
    group.add_argument("--tls-key-path", default=None,
                       help="PEM key of --tls-cert-path [PDSERVE_TLS_KEY_PATH]")


def _value(args: argparse.Namespace, name: str) -> str | None:
    return getattr(args, name, None) or os.environ.get(f"PDSERVE_{name.upper()}") or None


def client_channel(address: str, args: argparse.Namespace) -> grpc.aio.Channel:
    """A channel to ``address`` with TLS when a CA is given, and the API key on every call."""
    interceptors = []
    api_key = _value(args, "api_key")
    if api_key:
        # grpc.aio files each interceptor under one call shape only: one object per shape.
        interceptors += [_BearerUnaryUnary(api_key), _BearerUnaryStream(api_key)]
    ca = _value(args, "tls_ca_path")
    if ca is None:
        return grpc.aio.insecure_channel(address, interceptors=interceptors or None)
    cert, key = _value(args, "tls_cert_path"), _value(args, "tls_key_path")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )
    return grpc.aio.secure_channel(address, credentials, interceptors=interceptors or None)


class _Bearer:
    def __init__(self, api_key: str) -> None:
        self.header = ("authorization", f"Bearer {api_key}")

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.header)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _BearerUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, api_key: str) -> None:
        self._bearer = _Bearer(api_key)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._bearer.details(details), request)


class _BearerUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, api_key: str) -> None:
        self._bearer = _Bearer(api_key)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._bearer.details(details), request)
