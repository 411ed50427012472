"""How the text of a settings variable or flag becomes a value: ``Parser`` and the parsers of
every kind a setting can be (numbers in a range, ports, durations, hosts, addresses, URLs, enums,
lists, optionals).

``parser_for_type`` picks the parser a field's type implies (``str``, ``int``, ``float``,
``bool``, ``Path``, a ``StrEnum``, ``tuple[X, ...]`` as a comma-separated list, ``X | None`` where
empty means None); the kinds a type cannot say (ports, durations, ratios, URLs, addresses) are
named explicitly with ``setting(parser=...)`` (``pdserve.common.settings_fields``).
"""

from __future__ import annotations

import enum
import ipaddress
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from pdserve.common.errors import ConfigError
from pdserve.common.redis_url import parse_endpoint

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


@dataclass(frozen=True, slots=True)
class Parser(Generic[T]):
    """Turns the raw text of a variable or flag into a value.

    ``expected`` completes the sentence "expected ..." in the error message; ``parse`` raises
    ``ValueError`` (any message, it is not shown) when the text is malformed.
    """

    expected: str
    parse: Callable[[str], T]

    def __call__(self, raw: str) -> T:
        return self.parse(raw)


def _parse_str(raw: str) -> str:
    return raw.strip()


def _parse_int(raw: str) -> int:
    text = raw.strip()
    if not re.fullmatch(r"[-+]?\d+", text):
        raise ValueError(raw)
    return int(text)


def _parse_float(raw: str) -> float:
    value = float(raw.strip())
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


def _parse_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(raw)


def _parse_path(raw: str) -> Path:
    text = raw.strip()
    if not text or "\x00" in text:
        raise ValueError(raw)
    return Path(text).expanduser()


STR: Parser[str] = Parser("a string", _parse_str)
INT: Parser[int] = Parser("an integer", _parse_int)
FLOAT: Parser[float] = Parser("a finite number", _parse_float)
BOOL: Parser[bool] = Parser("one of true/false/1/0/yes/no", _parse_bool)
PATH: Parser[Path] = Parser("a file system path", _parse_path)


def int_range(low: int, high: int, expected: str | None = None) -> Parser[int]:
    """An integer in ``[low, high]``."""

    def parse(raw: str) -> int:
        value = _parse_int(raw)
        if not low <= value <= high:
            raise ValueError(raw)
        return value

    return Parser(expected or f"an integer {low}-{high}", parse)


def float_range(low: float, high: float, expected: str | None = None) -> Parser[float]:
    """A finite number in ``[low, high]``."""

    def parse(raw: str) -> float:
        value = _parse_float(raw)
        if not low <= value <= high:
            raise ValueError(raw)
        return value

    return Parser(expected or f"a number between {low:g} and {high:g}", parse)


PORT: Parser[int] = int_range(0, 65535, "an integer port 0-65535")
"""A TCP port; 0 means any free port (the process prints the one it bound)."""

PORT_OR_OFF: Parser[int] = int_range(-1, 65535, "an integer port 0-65535, or -1 for off")
"""A TCP port, 0 for any free port, or -1 to not listen at all."""

RATIO: Parser[float] = float_range(0.0, 1.0)

_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?\s*(ms|s|m|h)?")
_DURATION_UNIT_S = {None: 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "h": 3600.0}


def _parse_duration_s(raw: str) -> float:
    text = raw.strip()
    match = _DURATION_RE.fullmatch(text)
    if match is None:
        raise ValueError(raw)
    unit = match.group(2)
    number = text[: match.start(2)] if unit else text
    value = float(number) * _DURATION_UNIT_S[unit]
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


DURATION_S: Parser[float] = Parser(
    "a duration in seconds >= 0 (e.g. 2.5, 500ms, 30s, 5m, 1h)", _parse_duration_s
)
"""A non-negative duration, returned in seconds. Bare numbers are seconds."""


def _parse_host(host: str) -> str:
    """A DNS name or an IP address (IPv6 without brackets)."""
    if not host:
        raise ValueError(host)
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?", host):
        raise ValueError(host)
    return host


def _parse_bind_host(raw: str) -> str:
    text = raw.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return _parse_host(text)


HOST: Parser[str] = Parser(
    "a host name or IP address (e.g. 127.0.0.1, 0.0.0.0, ::)", _parse_bind_host
)
"""A host to bind or dial, returned without IPv6 brackets."""


def _parse_address(raw: str) -> str:
    """One ``host:port``, or several separated by commas (replicas of one service)."""
    parts = [part.strip() for part in raw.split(",")]
    if len(parts) > 1:
        return ",".join(_parse_one_address(part) for part in parts)
    return _parse_one_address(raw)


def _parse_one_address(raw: str) -> str:
    text = raw.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(raw)
    if host.startswith("[") and host.endswith("]"):
        ipaddress.IPv6Address(host[1:-1])
    elif ":" in host:
        raise ValueError(raw)  # a bare IPv6 address must be bracketed
    else:
        _parse_host(host)
    port = _parse_int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(raw)
    return text


def format_address(host: str, port: int) -> str:
    """``host:port`` as gRPC dials and binds it: an IPv6 host bracketed (``[::1]:50051``)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


ADDRESS: Parser[str] = Parser(
    "host:port with port 0-65535 (e.g. 127.0.0.1:50051 or [::1]:50051), or several "
    "separated by commas for the replicas of one service", _parse_address
)
"""A ``host:port`` address, returned unchanged (the form grpc takes), or a comma-separated list
of them: the replicas of one service, which clients balance round-robin and fail over between
(``pdserve.common.grpc_client.open_channel``)."""


def url(*schemes: str, needs_host: Sequence[str] = ()) -> Parser[str]:
    """A URL whose scheme is one of ``schemes``; those in ``needs_host`` must name a host.

    The URL is returned unchanged: drivers (redis-py, SQLAlchemy) parse it themselves; this only
    catches the malformed ones before a driver fails with a less helpful message.
    """
    allowed = tuple(s.lower() for s in schemes)
    must_have_host = frozenset(s.lower() for s in needs_host)

    def parse(raw: str) -> str:
        text = raw.strip()
        parts = urlsplit(text)
        scheme = parts.scheme.lower()
        if scheme not in allowed or not text.lower().startswith(f"{scheme}://"):
            raise ValueError(raw)
        _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
        if scheme in must_have_host and not parts.hostname:
            raise ValueError(raw)
        return text

    listed = ", ".join(f"{s}://" for s in allowed)
    return Parser(f"a URL starting with one of {listed}", parse)


_SINGLE_REDIS_URL = url("redis", "rediss", "memory", needs_host=("redis", "rediss"))


def _parse_redis_url(raw: str) -> str:
    text = raw.strip()
    scheme = text.partition("://")[0].lower()
    if scheme in ("redis+cluster", "redis+sentinel"):
        try:
            parse_endpoint(text)
        except ConfigError as exc:
            raise ValueError(raw) from exc
        return text
    return _SINGLE_REDIS_URL.parse(text)


REDIS_URL: Parser[str] = Parser(
    "a URL starting with one of redis://, rediss://, memory://, "
    "redis+cluster://host:port[,host:port...], "
    "redis+sentinel://host:port[,host:port...]/<master_name>[/db]", _parse_redis_url)
"""Hot-state store: ``redis://``/``rediss://`` (TLS), a Redis Cluster
(``redis+cluster://``), a master behind Sentinel (``redis+sentinel://``), or ``memory://`` for the
in-process store (``pdserve.common.redis_url``)."""

DATABASE_URL: Parser[str] = url("postgresql+psycopg", "postgresql", "sqlite")
"""Durable store as a SQLAlchemy URL: Postgres through psycopg 3, or SQLite for one machine."""


def _parse_otlp_endpoint(raw: str) -> str:
    text = raw.strip()
    if not text:
        return ""
    if "://" in text:
        return url("http", "https", needs_host=("http", "https")).parse(text)
    return _parse_address(text)


OTLP_ENDPOINT: Parser[str] = Parser(
    "an OTLP gRPC endpoint (http://host:port, https://host:port or host:port), or empty for none",
    _parse_otlp_endpoint,
)


def enum_of(enum_cls: type[E]) -> Parser[E]:
    """A member of ``enum_cls`` by value, case-insensitive."""
    by_text = {str(member.value).lower(): member for member in enum_cls}

    def parse(raw: str) -> E:
        return by_text[raw.strip().lower()]  # a KeyError reads as malformed text, as ValueError

    return Parser("one of " + "|".join(str(m.value) for m in enum_cls), parse)


def list_of(item: Parser[T]) -> Parser[tuple[T, ...]]:
    """Comma-separated items, blanks around items ignored, empty items dropped; a tuple."""

    def parse(raw: str) -> tuple[T, ...]:
        return tuple(item.parse(part) for part in raw.split(",") if part.strip())

    return Parser(f"a comma-separated list, each {item.expected}", parse)


def optional(inner: Parser[T]) -> Parser[T | None]:
    """Empty text means None; anything else goes to ``inner``."""

    def parse(raw: str) -> T | None:
        return None if not raw.strip() else inner.parse(raw)

    return Parser(f"{inner.expected}, or empty for none", parse)


def parser_for_type(hint: Any) -> Parser[Any] | None:
    """The parser that the type hint of a field implies, or None when it implies none."""
    if hint is str:
        return STR
    if hint is bool:
        return BOOL
    if hint is int:
        return INT
    if hint is float:
        return FLOAT
    if isinstance(hint, type) and issubclass(hint, Path):
        return PATH
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return enum_of(hint)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = parser_for_type(args[0])
        return list_of(item) if item else None
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        item = parser_for_type(inner)
        return optional(item) if item else None
    return None
