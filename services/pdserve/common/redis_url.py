"""The hot-state URL forms (``PDSERVE_REDIS_URL``), parsed once here so that settings and the
store factory agree on them (the clients are made in ``pdserve.state.redis.clients``)::

    redis://host:port/db                        one node (also rediss://, unix://)
    redis+cluster://host:port[,host:port...]    Redis Cluster; the nodes are seeds, the client
                                                learns the rest (database 0 only)
    redis+sentinel://host:port[,host:port...]/<master_name>[/db]
                                                the master that these sentinels name, followed
                                                across failovers

A ``user:password@`` before the hosts is the Redis servers' credentials (not the sentinels').
A Sentinel URL may end in ``?replica_acks=N``: every script is acknowledged only once N replicas
have it (``WAIT``; ``pdserve.state.shared.StateOptions.replica_acks``), so a failover loses no
acknowledged ticket.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

from pdserve.common.errors import ConfigError

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEME = "redis+cluster"
SENTINEL_SCHEME = "redis+sentinel"
REDIS_SCHEMES = (*SINGLE_SCHEMES, CLUSTER_SCHEME, SENTINEL_SCHEME)


@dataclass(frozen=True, slots=True)
class RedisEndpoint:
    """A parsed ``redis+cluster://`` or ``redis+sentinel://`` URL."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    master_name: str = ""
    """Sentinel only: the monitored master's name."""
    db: int = 0
    replica_acks: int = 0
    """Sentinel only: replicas that must have a write before it is acknowledged."""


def _bad(url: str, why: str) -> ConfigError:
    return ConfigError(f"redis_url (PDSERVE_REDIS_URL): {why}, got {url!r}")


def _host_port(url: str, text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad(url, f"{text!r} is not host:port")
    return host, int(port)


def parse_endpoint(url: str) -> RedisEndpoint:
    """The hosts, credentials, master name and database of a cluster or sentinel URL; raises
    ``ConfigError`` naming the setting for anything malformed."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in (CLUSTER_SCHEME, SENTINEL_SCHEME):
        raise _bad(url, f"expected {CLUSTER_SCHEME}:// or {SENTINEL_SCHEME}://")
    rest, _, query = rest.partition("?")
    if "#" in rest or (query and scheme == CLUSTER_SCHEME):
        raise _bad(url, "a cluster URL takes no query parameters")
    replica_acks = 0
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name != "replica_acks" or not value.isdigit():
            raise _bad(url, "the only query parameter is replica_acks=<number of replicas>")
        replica_acks = int(value)
    netloc, _, path = rest.partition("/")
    credentials, at, hosts_text = netloc.rpartition("@")
    username = password = None
    if at:
        user, has_password, secret = credentials.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    hosts = tuple(_host_port(url, part) for part in hosts_text.split(",") if part)
    if not hosts:
        raise _bad(url, "at least one host:port")
    segments = [s for s in path.split("/") if s]
    if scheme == CLUSTER_SCHEME:
        if segments not in ([], ["0"]):
            raise _bad(url, "a cluster has database 0 only (no path)")
        return RedisEndpoint(scheme, hosts, username, password)
    if not 1 <= len(segments) <= 2:
        raise _bad(url, "redis+sentinel://host:port[,host:port...]/<master_name>[/db]")
    db_text = segments[1] if len(segments) == 2 else "0"
    if not db_text.isdigit():
        raise _bad(url, f"database {db_text!r} is not a number")
    return RedisEndpoint(scheme, hosts, username, password, unquote(segments[0]), int(db_text),
                         replica_acks)
