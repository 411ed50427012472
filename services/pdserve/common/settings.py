"""Settings: one frozen object per service, parsed once at start-up, then passed down.

A settings class is a frozen, slotted, keyword-only dataclass whose fields are declared with
``setting(...)``. Each field gets an environment variable ``PDSERVE_<FIELD_NAME_UPPER>`` and a
flag ``--field-name``; the flag wins over the variable, the variable over the default. A malformed
value raises ``ConfigError`` with one line naming the variable (or flag) and the expected form::

    PDSERVE_GRPC_PORT: expected an integer port 0-65535, got 'abc'

The parser of a field is inferred from its type (``str``, ``int``, ``float``, ``bool``, ``Path``,
a ``StrEnum``, ``tuple[X, ...]`` as a comma-separated list, ``X | None`` where empty means None)
or given explicitly for the kinds a type cannot say (ports, durations, ratios, URLs, addresses).

A service composes ``CommonSettings`` by subclassing it, adding its own fields and, if it wants,
re-declaring a common field to change its default::

    @dataclass(frozen=True, slots=True, kw_only=True)
    class RouterSettings(CommonSettings):
        service_name: str = setting("router", help="Service name in logs, traces and metrics.")
        max_inflight_requests: int = setting(
            4096, parser=int_range(1, 1_000_000), help="Admission limit per router replica."
        )
        request_timeout_s: float = setting(
            600.0, parser=DURATION_S, help="Deadline of a whole Generate call."
        )

        def check(self) -> None:  # optional cross-field checks; call the parent's explicitly
            CommonSettings.check(self)

    settings = parse_settings(RouterSettings, sys.argv[1:], os.environ)

(``check`` calls the parent by name because zero-argument ``super()`` does not work in slotted
dataclasses on Python 3.11.) The CLI, which has subcommands, uses ``add_settings_arguments`` on a
subparser and ``settings_from_namespace`` on what argparse returns.

Settings hold connection URLs that may carry passwords; log them only through ``redacted``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import ipaddress
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pdserve.common.errors import ConfigError

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)

ENV_PREFIX = "PDSERVE_"
_META_KEY = "pdserve_setting"


# --------------------------------------------------------------------------------------- parsers


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


REDIS_URL: Parser[str] = url("redis", "rediss", "memory", needs_host=("redis", "rediss"))
"""Hot-state store: ``redis://``/``rediss://`` (TLS), or ``memory://`` for the in-process store."""

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
        return by_text[raw.strip().lower()]  # KeyError is a LookupError, see _parse_with

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


# ------------------------------------------------------------------------------ field metadata


@dataclass(frozen=True, slots=True)
class _SettingMeta:
    help: str
    parser: Parser[Any] | None
    env: str | None
    flag: str | None
    is_secret: bool


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 - reads like argparse
    parser: Parser[Any] | None = None,
    env: str | None = None,
    flag: str | None = None,
    is_secret: bool = False,
) -> Any:
    """Declare a settings field. No ``default`` makes the setting required.

    ``env`` and ``flag`` override the derived ``PDSERVE_<NAME>`` and ``--name``; ``is_secret``
    hides the value in ``redacted`` and in ``repr``. Defaults must be immutable (use tuples).
    """
    meta = _SettingMeta(help=help, parser=parser, env=env, flag=flag, is_secret=is_secret)
    return dataclasses.field(default=default, repr=not is_secret, metadata={_META_KEY: meta})


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """Everything known about one settings field: where its value comes from and how it parses."""

    name: str
    env: str
    flag: str
    help: str
    parser: Parser[Any]
    default: Any
    has_default: bool
    is_secret: bool


def _parser_for_type(hint: Any) -> Parser[Any] | None:
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
        item = _parser_for_type(args[0])
        return list_of(item) if item else None
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        item = _parser_for_type(inner)
        return optional(item) if item else None
    return None


@functools.cache
def settings_fields(cls: type) -> tuple[SettingSpec, ...]:
    """The settings fields of ``cls`` in declaration order. Raises TypeError for a field that is
    not declared with ``setting`` or whose parser cannot be inferred (a programming error)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = typing.get_type_hints(cls)
    specs = []
    for fld in dataclasses.fields(cls):
        meta = fld.metadata.get(_META_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{fld.name} is not declared with setting(...)")
        parser = meta.parser or _parser_for_type(hints[fld.name])
        if parser is None:
            raise TypeError(f"{cls.__name__}.{fld.name}: cannot infer a parser, pass parser=")
        specs.append(
            SettingSpec(
                name=fld.name,
                env=meta.env or ENV_PREFIX + fld.name.upper(),
                flag=meta.flag or "--" + fld.name.replace("_", "-"),
                help=meta.help,
                parser=parser,
                default=fld.default,
                has_default=fld.default is not dataclasses.MISSING,
                is_secret=meta.is_secret,
            )
        )
    return tuple(specs)


def _parse_with(spec: SettingSpec, raw: str, source: str) -> Any:
    try:
        return spec.parser.parse(raw)
    except (ValueError, LookupError, OverflowError):
        shown = "<secret>" if spec.is_secret else repr(raw)
        raise ConfigError(f"{source}: expected {spec.parser.expected}, got {shown}",
                          field=spec.name) from None


# ------------------------------------------------------------------------------ entry points


S = TypeVar("S")


def add_settings_arguments(
    parser: argparse.ArgumentParser, cls: type, *, title: str | None = None
) -> None:
    """Add one flag per field of ``cls`` to ``parser`` (e.g. a CLI subcommand's parser).

    Flags are kept as raw text (default None) so that ``settings_from_namespace`` can tell "not
    given" from "given", and parse errors name the flag. Boolean flags may be given bare.
    """
    group = parser.add_argument_group(title or f"{cls.__name__} (flag > environment > default)")
    for spec in settings_fields(cls):
        default = "required" if not spec.has_default else f"default {_show_default(spec)}"
        kwargs: dict[str, Any] = {
            "dest": spec.name,
            "default": None,
            "metavar": spec.name.upper(),
            "help": f"{spec.help} [{spec.env}; {default}]".replace("%", "%%"),
        }
        if spec.parser is BOOL:
            kwargs.update(nargs="?", const="true")
        group.add_argument(spec.flag, **kwargs)


def settings_from_namespace(
    cls: type[S], namespace: argparse.Namespace | None, environ: Mapping[str, str]
) -> S:
    """Build ``cls`` from parsed flags (raw text, as added by ``add_settings_arguments``) and the
    environment. Raises ``ConfigError`` (one line) for a malformed or missing value."""
    values: dict[str, Any] = {}
    for spec in settings_fields(cls):
        raw_flag = getattr(namespace, spec.name, None) if namespace is not None else None
        if raw_flag is not None:
            values[spec.name] = _parse_with(spec, raw_flag, spec.flag)
        elif spec.env in environ:
            values[spec.name] = _parse_with(spec, environ[spec.env], spec.env)
        elif not spec.has_default:
            raise ConfigError(f"{spec.env}: required, set it or pass {spec.flag}", field=spec.name)
    settings = cls(**values)
    check = getattr(settings, "check", None)
    if callable(check):
        check()
    return settings


def parse_settings(
    cls: type[S],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    prog: str | None = None,
) -> S:
    """Parse ``argv`` (default ``sys.argv[1:]``) and ``environ`` (default ``os.environ``) into
    ``cls``. ``--help`` prints the flags with their variables and defaults and exits 0; every
    other problem raises ``ConfigError`` with a one-line message (the CLI prints it, exits 2)."""
    doc = (cls.__doc__ or "").strip().splitlines()
    parser = argparse.ArgumentParser(
        prog=prog, description=doc[0] if doc else None, exit_on_error=False
    )
    add_settings_arguments(parser, cls, title="settings (flag > environment > default)")
    try:
        namespace, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(str(exc)) from None
    if extra:
        raise ConfigError(f"unrecognized arguments: {' '.join(extra)}")
    return settings_from_namespace(cls, namespace, os.environ if environ is None else environ)


def _mask_url_password(text: str) -> str:
    try:
        parts = urlsplit(text)
        if parts.password is None:
            return text
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
    except ValueError:
        return text


def redacted(settings: object) -> dict[str, Any]:
    """The settings as a dict safe to log: secrets hidden, URL passwords masked."""
    out: dict[str, Any] = {}
    for spec in settings_fields(type(settings)):
        value = getattr(settings, spec.name)
        if spec.is_secret:
            out[spec.name] = "***" if value else value
        elif isinstance(value, str) and "://" in value:
            out[spec.name] = _mask_url_password(value)
        elif isinstance(value, enum.Enum):
            out[spec.name] = value.value
        elif isinstance(value, Path):
            out[spec.name] = str(value)
        else:
            out[spec.name] = value
    return out


def _show_default(spec: SettingSpec) -> str:
    if spec.is_secret:
        return "<secret>"
    value = spec.default
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "''"
    if value is None or value == "":
        return "none"
    return str(value)


# --------------------------------------------------------------------------- common settings


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(enum.StrEnum):
    JSON = "json"
    TEXT = "text"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Paths of PEM files for gRPC TLS. Server: ``cert_path``/``key_path`` are its identity and
    ``ca_path``, when set, turns on mutual TLS (clients must present a cert signed by it).
    Client: ``ca_path`` verifies the server; ``cert_path``/``key_path`` are its mTLS identity."""

    cert_path: Path | None = None
    key_path: Path | None = None
    ca_path: Path | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommonSettings:
    """Settings every pdserve service has. Subclass to add a service's own."""

    service_name: str = setting(
        "pdserve", help="Service name in logs, traces (service.name) and metrics."
    )
    log_level: LogLevel = setting(LogLevel.INFO, help="Lowest level logged.")
    log_format: LogFormat = setting(
        LogFormat.JSON, help="json: one JSON object per line with the trace id; text: for humans."
    )
    otel_endpoint: str = setting(
        "",
        parser=OTLP_ENDPOINT,
        help="OTLP gRPC collector to send traces to. Empty: no tracing at all (no interceptors).",
    )
    # Why 0.01: what costs CPU is having the gRPC interceptors installed (+~40% CPU on a trivial
    # unary call in our measurement), not the ratio (sampling 100% instead of 0% added ~15% more).
    # Tracing is therefore switched on and off by the endpoint; the ratio only picks which root
    # requests are traced (ParentBased: services downstream follow the caller's decision), and 1%
    # gives a steady sample of end-to-end traces at negligible export volume.
    otel_sampling_ratio: float = setting(
        0.01,
        parser=RATIO,
        help="Share of root requests traced (0..1), honoured only where a trace starts; "
        "0 turns tracing off even with an endpoint.",
    )
    grpc_host: str = setting(
        "127.0.0.1",
        parser=HOST,
        help="Interface the gRPC and metrics servers listen on (0.0.0.0 or :: for all).",
    )
    grpc_port: int = setting(0, parser=PORT, help="gRPC port; 0 = any free port (printed).")
    grpc_max_message_bytes: int = setting(
        64 * 1024 * 1024,
        parser=int_range(1024, 2**31 - 1),
        help="Largest gRPC message sent or received, in bytes.",
    )
    metrics_port: int = setting(
        0, parser=PORT_OR_OFF, help="Prometheus /metrics port; 0 = any free port, -1 = off."
    )
    grace_period_s: float = setting(
        15.0,
        parser=DURATION_S,
        help="On SIGTERM, how long in-flight calls may run before they are cancelled.",
    )
    redis_url: str = setting(
        "memory://",
        parser=REDIS_URL,
        help="Hot-state store (control-plane services only); memory:// = in-process.",
    )
    database_url: str = setting(
        "sqlite:///pdserve.db",
        parser=DATABASE_URL,
        help="Durable store, a SQLAlchemy URL (control-plane services only).",
    )
    durable_spool_dir: Path | None = setting(
        None,
        help="Folder of the spool of durable records that wait for the database (kept across "
        "restarts; records of a dead process are adopted by the next one). Empty: a "
        "pdserve-spool folder in the system's temporary folder.",
    )
    tls_cert_path: Path | None = setting(None, help="PEM certificate of this process (TLS).")
    tls_key_path: Path | None = setting(None, help="PEM private key of tls_cert_path.")
    tls_ca_path: Path | None = setting(
        None, help="PEM CA bundle: verifies peers; on a server it requires client certs (mTLS)."
    )
    api_keys_path: Path | None = setting(
        None,
        help="File of '<key> <tenant>' lines: client API keys (gRPC and HTTP), reloaded on "
        "change. Unset: the client API is open.",
    )
    admin_keys_path: Path | None = setting(
        None,
        help="File of '<key> <operator>' lines: keys of the operator API (drain, target "
        "sizes, autoscaler controls), reloaded on change. Unset: the operator API is open.",
    )
    kv_tls: bool = setting(
        False,
        help="Run the tcp KV data path over mutual TLS with this process's TLS files "
        "(default: clear, for a trusted fabric).",
    )

    def check(self) -> None:
        """Cross-field checks; raises ``ConfigError``."""
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ConfigError(
                "PDSERVE_TLS_CERT_PATH and PDSERVE_TLS_KEY_PATH: expected both set or both empty",
                field="tls_cert_path",
            )
        if self.kv_tls and (self.tls_cert_path is None or self.tls_ca_path is None):
            raise ConfigError(
                "PDSERVE_KV_TLS: expected PDSERVE_TLS_CERT_PATH, PDSERVE_TLS_KEY_PATH and "
                "PDSERVE_TLS_CA_PATH to be set (the KV path is mutual TLS)",
                field="kv_tls",
            )
        if self.grpc_port != 0 and self.metrics_port == self.grpc_port:
            raise ConfigError(
                f"PDSERVE_METRICS_PORT: expected a port other than PDSERVE_GRPC_PORT, "
                f"got {self.metrics_port}",
                field="metrics_port",
            )

    @property
    def tls(self) -> TlsConfig | None:
        """The TLS files, or None when this process speaks plaintext gRPC."""
        if self.tls_cert_path is None and self.tls_ca_path is None:
            return None
        return TlsConfig(self.tls_cert_path, self.tls_key_path, self.tls_ca_path)

    @property
    def grpc_address(self) -> str:
        """``host:port`` to bind, IPv6 hosts bracketed."""
        host = self.grpc_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.grpc_port}"
