"""Credentials, as files and as call metadata: the API and admin key files, the service token
file, worker credentials, and the ``authorization: Bearer`` entries that carry them, on both sides
of a call. Who may call what with them is ``pdserve.common.auth``'s.

Key files hold one ``<key> <name>`` pair per line; a service token file one token (or the
``sha256:<hex>`` digest of one, to check without presenting) per line, the last one presented;
both are re-read without a restart when they change, and a token removed from its file stays
accepted for a grace period. A worker credential is ``pdw1.<worker_id>.<hex HMAC-SHA256(service
token, worker_id)>``: only a service token's holder can make one, and it names the only worker id
its holder may act as. The module docstring of ``pdserve.common.auth`` says which role each
gives.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import re
import time
from collections.abc import Callable, ItemsView, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.common.errors import ConfigError, UnauthenticatedError
from pdserve.common.settings import CommonSettings
from pdserve.common.watched_file import WatchedFile

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
AUTHORIZATION_KEY = "authorization"
_NAME_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


# ------------------------------------------------------------------------------- key files


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse_key_file(text: str, source: str) -> dict[str, str]:
    """``key -> name`` from the text of a key file. Raises ``ConfigError`` naming ``source`` and
    the line (never the key) on a malformed line, a short key or a repeated key."""
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        if len(fields) != 2:
            raise ConfigError(f"{source}:{number}: expected '<key> <name>'")
        key, name = fields
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{source}:{number}: key shorter than {MIN_KEY_CHARS} characters")
        if not _NAME_RE.fullmatch(name):
            raise ConfigError(f"{source}:{number}: name must be 1-128 of A-Z a-z 0-9 _ . : @ -")
        if key in keys:
            raise ConfigError(f"{source}:{number}: key repeated (first seen earlier)")
        keys[key] = name
    return keys


class KeyTable(Mapping[str, str]):
    """Keys and their names (``key -> name``), looked up by SHA-256 digest so that the time a
    lookup takes does not depend on how much of a key matched.

    ``lookup`` is the call to use; the ``Mapping`` interface lets a table stand where a plain
    dict is expected. ``KeyFile`` is a table that follows its file; a table built from a dict
    serves keys given in code (tests, an application embedding the router).
    """

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._install(dict(keys))

    def _install(self, keys: dict[str, str]) -> None:
        self._keys = keys
        self._by_digest = {_digest(k): name for k, name in keys.items()}

    def lookup(self, key: str) -> str | None:
        """The name (tenant or operator) of ``key``, or None."""
        return self._by_digest.get(_digest(key))

    def __getitem__(self, key: str) -> str:
        name = self.lookup(key)
        if name is None:
            raise KeyError("unknown key")  # never echo the key
        return name

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def items(self) -> ItemsView[str, str]:
        """The ``(key, name)`` pairs now (a copy: a reload does not change it under the caller)."""
        return dict(self._keys).items()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._keys)} keys)"


class KeyFile(KeyTable):
    """A key file (``key -> name``) that follows edits to the file without a restart.

    Every read re-reads the file first if it changed (see ``refresh``). ``clock`` is monotonic
    seconds. Raises ``ConfigError`` at construction if the file is missing or bad.
    """

    def __init__(self, path: Path, *, poll_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._file = WatchedFile(path, parse_key_file, "key file",
                                 poll_interval_s=poll_interval_s, clock=clock)
        super().__init__(self._file.value)

    @property
    def num_reloads(self) -> int:
        return self._file.num_reloads

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the file if it changed (or ``force``); True when new keys were installed.
        A file that cannot be read or parsed leaves the current keys in place."""
        if not self._file.refresh(force=force):
            return False
        self._install(self._file.value)
        return True

    def lookup(self, key: str) -> str | None:
        self.refresh()
        return super().lookup(key)

    def __iter__(self) -> Iterator[str]:
        self.refresh()
        return super().__iter__()

    def __len__(self) -> int:
        self.refresh()
        return super().__len__()

    def items(self) -> ItemsView[str, str]:
        self.refresh()
        return super().items()

    def __repr__(self) -> str:
        return f"KeyFile({str(self.path)!r}, {len(self._keys)} keys)"


class TokenFile:
    """A file of secrets, one per line (``#`` comment lines and blank lines ignored), re-read
    when it changes, like ``KeyFile``. Several lines = several valid secrets, which is how a
    join token is rotated: add the new one, move the workers over, remove the old one."""

    def __init__(self, path: Path, *, poll_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._file = WatchedFile(path, _parse_token_lines, "token file",
                                 poll_interval_s=poll_interval_s, clock=clock)

    def tokens(self) -> tuple[str, ...]:
        """The valid tokens now (re-read at most every ``poll_interval_s``)."""
        self._file.refresh()
        return self._file.value


def _parse_token_lines(text: str, source: str) -> tuple[str, ...]:
    tokens = tuple(line.strip() for line in text.splitlines()
                   if line.strip() and not line.strip().startswith("#"))
    if not tokens:
        raise ConfigError(f"{source}: no token in the file")
    return tokens


# ------------------------------------------------------------ service tokens, worker credentials

DIGEST_PREFIX = "sha256:"
WORKER_CREDENTIAL_PREFIX = "pdw1."
_WORKER_MAC_CONTEXT = b"pdserve-worker-credential-v1\0"


def token_digest_line(token: str) -> str:
    """The verify-only line of a service token file for ``token``: ``sha256:<hex>``. A process
    whose file holds only such lines checks service tokens but cannot present or sign one (a
    worker's own server)."""
    return DIGEST_PREFIX + _digest(token).hex()


@dataclass(frozen=True, slots=True)
class _ServiceToken:
    digest: bytes
    raw: str | None
    """None for a verify-only (``sha256:``) line."""


def parse_service_token_file(text: str, source: str) -> list[_ServiceToken]:
    """Lines of a service token file: a token (at least ``MIN_KEY_CHARS`` characters, no
    spaces) or ``sha256:<64 hex>``; ``#`` comment lines and blank lines are ignored. Raises
    ``ConfigError`` naming ``source`` and the line (never the token)."""
    tokens: list[_ServiceToken] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(stripped.split()) != 1:
            raise ConfigError(f"{source}:{number}: expected one token per line")
        if stripped.startswith(DIGEST_PREFIX):
            try:
                digest = bytes.fromhex(stripped[len(DIGEST_PREFIX):])
            except ValueError:
                digest = b""
            if len(digest) != hashlib.sha256().digest_size:
                raise ConfigError(f"{source}:{number}: expected sha256:<64 hex digits>")
            tokens.append(_ServiceToken(digest, None))
            continue
        if len(stripped) < MIN_KEY_CHARS:
            raise ConfigError(f"{source}:{number}: token shorter than {MIN_KEY_CHARS} characters")
        if stripped.startswith(WORKER_CREDENTIAL_PREFIX):
            raise ConfigError(f"{source}:{number}: a service token may not start with "
                              f"{WORKER_CREDENTIAL_PREFIX!r} (the worker credential form)")
        tokens.append(_ServiceToken(_digest(stripped), stripped))
    if not tokens:
        raise ConfigError(f"{source}: no token in the file")
    return tokens


class ServiceTokens:
    """The service token file: the tokens services present to each other (``authorization:
    Bearer <token>`` on their internal channels) and the keys that sign worker credentials.

    Re-read without a restart like a key file (``KeyFile``). Rotation: append the new token
    (services present and sign with the **last** token of the file), let every service pick it
    up, then remove the old one; a removed token stays accepted for ``grace_s`` seconds after
    the reload that removed it, then it is refused (so are worker credentials it signed).
    ``clock`` is monotonic seconds (injected in tests). Raises ``ConfigError`` at construction
    if the file is missing or bad; a bad edit later is ignored with a warning.
    """

    def __init__(self, path: Path, *, grace_s: float = 300.0, poll_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.grace_s = grace_s
        self._clock = clock
        self._file = WatchedFile(path, parse_service_token_file, "service token file",
                                 poll_interval_s=poll_interval_s, clock=clock)
        self._tokens = self._file.value
        self._retired: dict[bytes, tuple[float, str | None]] = {}
        """digest -> (monotonic time its grace ends, raw token or None)."""

    @property
    def num_reloads(self) -> int:
        return self._file.num_reloads

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the file if it changed (at most every ``poll_interval_s``, or ``force``);
        True when new tokens were installed. Tokens the new file lacks start their grace."""
        if not self._file.refresh(force=force):
            return False
        now = self._clock()
        tokens = self._file.value
        kept = {token.digest for token in tokens}
        for token in self._tokens:
            if token.digest not in kept:
                self._retired[token.digest] = (now + self.grace_s, token.raw)
        for digest in kept:
            self._retired.pop(digest, None)
        self._tokens = tokens
        logger.info("service token file %s: %d tokens (%d in their grace period)",
                    self.path, len(tokens), len(self._retired))
        return True

    def _live_retired(self) -> dict[bytes, tuple[float, str | None]]:
        now = self._clock()
        self._retired = {d: entry for d, entry in self._retired.items() if entry[0] > now}
        return self._retired

    def presented(self) -> str | None:
        """The token this process presents (the file's last raw token); None for a
        verify-only file."""
        self.refresh()
        raws = [token.raw for token in self._tokens if token.raw is not None]
        return raws[-1] if raws else None

    def is_valid(self, token: str) -> bool:
        """Whether ``token`` is in the file, or was removed less than ``grace_s`` ago."""
        self.refresh()
        digest = _digest(token)
        is_known = False
        for candidate in self._tokens:  # compare all: time does not depend on which matched
            is_known |= hmac.compare_digest(candidate.digest, digest)
        return is_known or digest in self._live_retired()

    def signing_tokens(self) -> list[str]:
        """Raw tokens that may have signed a valid worker credential (file, then grace)."""
        self.refresh()
        raws = [token.raw for token in self._tokens if token.raw is not None]
        raws += [raw for _, raw in self._live_retired().values() if raw is not None]
        return raws

    def mint_worker_credential(self, worker_id: str) -> str:
        """A credential for ``worker_id`` signed with the presented token (the pool's
        provisioners hand it to the worker they start). Raises ``ConfigError`` for a
        verify-only file."""
        token = self.presented()
        if token is None:
            raise ConfigError(f"{self.path}: holds only sha256: lines; cannot sign a worker "
                              "credential", field="service_tokens_path")
        return worker_credential(token, worker_id)

    def verify_worker_credential(self, credential: str) -> str | None:
        """The worker id ``credential`` names, if a valid token signed it; else None."""
        parsed = parse_worker_credential(credential)
        if parsed is None:
            return None
        worker_id, _ = parsed
        is_valid = False
        for token in self.signing_tokens():
            is_valid |= hmac.compare_digest(worker_credential(token, worker_id), credential)
        return worker_id if is_valid else None

    def __repr__(self) -> str:
        return f"ServiceTokens({str(self.path)!r}, {len(self._tokens)} tokens)"


def worker_credential(service_token: str, worker_id: str) -> str:
    """``pdw1.<worker_id>.<hex HMAC-SHA256(service_token, context || worker_id)>``: proves the
    holder may act as ``worker_id`` and as no other worker; only holders of the service token
    can make one, and the worker never sees the token."""
    mac = hmac.new(service_token.encode("utf-8", "surrogatepass"),
                   _WORKER_MAC_CONTEXT + worker_id.encode("utf-8", "surrogatepass"),
                   hashlib.sha256).hexdigest()
    return f"{WORKER_CREDENTIAL_PREFIX}{worker_id}.{mac}"


def parse_worker_credential(text: str) -> tuple[str, str] | None:
    """``(worker_id, hex mac)`` of a worker credential's form; None for anything else."""
    if not text.startswith(WORKER_CREDENTIAL_PREFIX):
        return None
    worker_id, dot, mac = text[len(WORKER_CREDENTIAL_PREFIX):].rpartition(".")
    if not dot or not worker_id or len(mac) != 64:
        return None
    return worker_id, mac


@functools.lru_cache(maxsize=16)
def _shared_service_tokens(path: Path, grace_s: float) -> ServiceTokens:
    return ServiceTokens(path, grace_s=grace_s)


def load_service_tokens(settings: CommonSettings) -> ServiceTokens | None:
    """The process's service token file (one object per file and grace, shared by its server
    and its channels), or None when ``service_tokens_path`` is unset."""
    if settings.service_tokens_path is None:
        return None
    return _shared_service_tokens(Path(settings.service_tokens_path),
                                  float(settings.service_token_grace_s))


def load_key_file(path: Path | None) -> KeyFile | None:
    return KeyFile(path) if path is not None else None


# ------------------------------------------------------------------------- bearer metadata


def _parse_authorization(text: str) -> tuple[bool, str]:
    """Whether an authorization value's scheme is Bearer, and the credential after the scheme."""
    scheme, _, credential = text.strip().partition(" ")
    return scheme.lower() == "bearer", credential.strip()


def bearer_key(metadata: Any) -> str | None:
    """The key of an ``authorization: Bearer <key>`` entry; ``""`` for an authorization entry
    of another form (refused), None when there is none."""
    for entry_key, value in metadata or ():
        if entry_key.lower() != AUTHORIZATION_KEY:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        is_bearer, key = _parse_authorization(text)
        return key if is_bearer else ""
    return None


def bearer_tenant(authorization: str, api_keys: KeyTable) -> str:
    """The tenant of the API key in an HTTP ``Authorization: Bearer <key>`` header (the router's
    OpenAI API); ``authorization`` is the header's value, ``""`` when there is none. Raises
    ``UnauthenticatedError`` when there is no credential, or one that is not a known bearer key.
    """
    is_bearer, key = _parse_authorization(authorization)
    tenant = api_keys.lookup(key) if is_bearer and key else None
    if tenant is None:
        raise UnauthenticatedError("Incorrect API key provided" if key
                                   else "Missing API key: send 'Authorization: Bearer <key>'")
    return tenant


def bearer_metadata(key: str) -> tuple[tuple[str, str]]:
    """Call metadata that presents ``key`` (clients: ``stub.Method(req, metadata=...)``)."""
    return ((AUTHORIZATION_KEY, f"Bearer {key}"),)


# ---------------------------------------------------------------------------- client side


class _Bearer:
    """Adds ``authorization: Bearer <credential>`` to a call, unless the call carries its own
    authorization (an operator's key passed by a command). ``credential`` is asked on every
    call, so a rotated service token is presented as soon as it is read."""

    def __init__(self, credential: Callable[[], str | None]) -> None:
        self._credential = credential

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = list(details.metadata or ())
        if any(str(key).lower() == AUTHORIZATION_KEY for key, _ in metadata):
            return details
        credential = self._credential()
        if not credential:
            return details
        metadata.extend(bearer_metadata(credential))
        return grpc.aio.ClientCallDetails(details.method, details.timeout,
                                          grpc.aio.Metadata(*metadata), details.credentials,
                                          details.wait_for_ready)


class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(
        credential: Callable[[], str | None]) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that present ``credential()`` on every call of a channel, one per
    call shape (an aio channel files each interceptor under the first shape it implements)."""
    return [_BearerUnaryUnary(credential), _BearerUnaryStream(credential),
            _BearerStreamUnary(credential), _BearerStreamStream(credential)]


def outgoing_credential(settings: CommonSettings) -> Callable[[], str | None] | None:
    """What this process presents on its internal channels: its worker credential (a
    worker), else the service token file's presented token (a service); None for neither."""
    credential = settings.call_credential
    if credential:
        return lambda: credential
    tokens = load_service_tokens(settings)
    if tokens is None or tokens.presented() is None:
        return None
    return tokens.presented
