"""KV data-path addresses: ``host:port``, with IPv6 hosts in brackets."""

from __future__ import annotations

from pdserve.common.errors import InvalidArgumentError


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6host]:port`` -> (host, port); ``InvalidArgumentError`` otherwise."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidArgumentError(f"KV address {address!r} is not host:port", field="kv_address")
    return host.removeprefix("[").removesuffix("]"), int(port_text)

