"""Declaring settings fields and filling a settings object from flags and the environment.

A settings class is a frozen, slotted, keyword-only dataclass whose fields are declared with
``setting(...)``. Each field gets an environment variable ``PDSERVE_<FIELD_NAME_UPPER>`` and a
flag ``--field-name``; the flag wins over the variable, the variable over the default. A malformed
value raises ``ConfigError`` with one line naming the variable (or flag) and the expected form::

    PDSERVE_GRPC_PORT: expected an integer port 0-65535, got 'abc'

A field's parser is inferred from its type or given with ``setting(parser=...)``
(``pdserve.common.settings_parsers``). A process parses its settings once with
``parse_settings``; the CLI, which has subcommands, uses ``add_settings_arguments`` on a
subparser and ``settings_from_namespace`` on what argparse returns. Settings hold connection URLs
that may carry passwords; log them only through ``redacted``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pdserve.common.errors import ConfigError
from pdserve.common.settings_parsers import BOOL, Parser, parser_for_type

S = TypeVar("S")

ENV_PREFIX = "PDSERVE_"
_META_KEY = "pdserve_setting"


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


_FIELDS_BY_CLASS: dict[type, tuple[SettingSpec, ...]] = {}


def settings_fields(cls: type) -> tuple[SettingSpec, ...]:
    """The settings fields of ``cls`` in declaration order (worked out once per class). Raises
    TypeError for a field that is not declared with ``setting`` or whose parser cannot be
    inferred (a programming error)."""
    specs = _FIELDS_BY_CLASS.get(cls)
    if specs is None:
        specs = _FIELDS_BY_CLASS[cls] = _declared_fields(cls)
    return specs


def _declared_fields(cls: type) -> tuple[SettingSpec, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = typing.get_type_hints(cls)
    specs = []
    for fld in dataclasses.fields(cls):
        meta = fld.metadata.get(_META_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{fld.name} is not declared with setting(...)")
        parser = meta.parser or parser_for_type(hints[fld.name])
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
