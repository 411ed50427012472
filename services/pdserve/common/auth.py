"""Who may call what: client API keys, admin keys, service tokens, worker credentials and
mutual-TLS peer identities, checked by one gRPC server interceptor in front of every servicer.

Credentials and the roles they give a call (``authorization: Bearer <credential>`` metadata, or
the peer's certificate):

* a key in the **API key file** -> ``client``, and the key's tenant becomes the call's tenant
  (``current_tenant()``, which the router puts into ``GenerationRequest.tenant``);
* a key in the **admin key file** -> ``admin`` (the operator API);
* a token in the **service token file** (``service_tokens_path``) -> ``service``. Services
  present the file's last token on all their internal channels (``grpc_client.open_channel``
  adds it to every call that carries no authorization of its own);
* a **worker credential** ``pdw1.<worker_id>.<hex HMAC-SHA256(service token, worker_id)>``
  -> ``worker``, bound to that worker id: a call about another worker (``Register``,
  ``Heartbeat``, ``Deregister`` naming another id; a ticket call on a ticket that names neither
  as its prefill nor its decode worker) is refused with PERMISSION_DENIED (``check_worker_id``,
  the coordinator's servicer). Only holders of a service token can make one; a worker never
  holds the token. The pool's provisioners hand each worker they start its credential
  (``PDSERVE_WORKER_CREDENTIAL``); a worker they cannot name (a Kubernetes Deployment's pod)
  registers by the join token alone and gets it in ``RegisterResponse.worker_credential`` (such
  a join may not take the id of a live worker). Every heartbeat returns it re-signed with the
  newest token (``HeartbeatResponse.worker_credential``), so workers follow a rotation;
* the peer's **mTLS certificate**: its SPIFFE ID ``spiffe://pdserve.local/<kind>/<name>``
  (``pdserve.common.certs``) gives ``service`` or ``worker``; a certificate of kind ``client``
  or without a pdserve ID gives no role (the connection is allowed, the call still needs a key).
  A worker certificate is not bound to a worker id (only a worker credential is).

Defaults, precisely: with **nothing configured** (no API key file, no admin key file, no service
token file, no mutual TLS) every caller has every role: the laptop stack needs no set-up and no
interceptor runs. Otherwise: with no API key file every caller counts as ``client`` (tenant
``""``); with no admin key file every caller counts as ``admin``; and nobody gets ``service``
or ``worker`` without a service token, a worker credential or a service/worker certificate.
So once any key file is configured without mutual TLS, every service needs
``service_tokens_path`` (a server without it logs a warning: its internal methods refuse every
caller); ``pdserve up`` generates one when keys are configured, compose and the Kubernetes
manifests carry one. One exception keeps joining possible: without mutual TLS, ``Register``
(``JOIN_METHODS``) may be called with no credential, because its join token is checked by the
pool. The router's OpenAI HTTP API checks the same API key file (``bearer_tenant``: the
``Authorization`` header's bearer key, or 401) and can serve HTTPS itself
(``http_tls_cert_path``/``http_tls_key_path``).

Method -> roles (``METHOD_ROLES``; a method missing from the table is refused, so a new RPC must
be placed here before anyone can call it):

======================================================  ====================================
RouterService: Generate, Cancel, ListModels              client, admin
PoolService: Register, Heartbeat, Deregister             worker, bound to its worker id
                                                         (Register/Heartbeat also need the
                                                         join token, checked by the pool;
                                                         without mTLS Register needs no other
                                                         credential)
PoolService: Drain, SetTargetSize                        admin, service (the governor)
PoolService: ListWorkers, WatchPool                      admin, service
KvTransferService: OpenTicket                            service (the router)
KvTransferService: UpdateProgress, RenewLease,           worker, service
  PublishDestination, AwaitDestination, ReleaseTicket
KvTransferService: AbortTicket                           worker, service, admin
KvTransferService: GetTicket, ListTickets,               admin, service
  WatchTickets, GetLedger
CapacityGovernorService: SetAutoscalerControls           admin
CapacityGovernorService: GetCapacity, GetPlan,           admin, service
  WhatIfPlan, ListDecisions, GetExpertPlacement,
  WhatIfExpertPlacement
WorkerAgentService: AdmitTicket, Prefill, Decode,        service (router, coordinator, pools)
  DropTicket, ApplyExpertPlacement, BeginDrain
WorkerAgentService: GetStatus, GetPerformanceProfile     service, admin
grpc.health.v1.Health, server reflection                 anyone (no check)
======================================================  ====================================

Refusals: a call with no usable credential (no key, no pdserve certificate) or with a key, token
or worker credential that no file proves gets ``UNAUTHENTICATED``; a caller whose roles do not
include the method's gets ``PERMISSION_DENIED`` (e.g. a client key on an admin method, a worker
credential on ``SetTargetSize``), and so does a worker credential used for another worker id.
Every refusal is counted in ``pdserve_grpc_auth_refused_calls_total{method, code}``.

Key files hold one ``<key> <name>`` pair per line (``#`` starts a comment line, blank lines are
ignored); a key has at least ``MIN_KEY_CHARS`` characters and no spaces, a name is a tenant (API
keys) or an operator (admin keys). The service token file holds one token per line, or a
``sha256:<hex>`` line that lets a process check a token it cannot present (``pdserve up`` gives
its workers' own servers such a file). Files are re-read without a restart when their
modification time, size or inode changes (checked at most every ``poll_interval_s`` on use); a
file that fails to parse on reload is ignored with a warning and the previous keys stay. Service
token rotation: append the new token (it is presented from then on), then remove the old one;
a removed token, and the worker credentials it signed, stay accepted for
``service_token_grace_s`` and are refused after it. Keys are never logged; lookups compare
SHA-256 digests, so lookup time does not depend on how much of a key matched.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import hashlib
import hmac
import inspect
import logging
import re
import time
from collections.abc import Callable, ItemsView, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.common.certs import PeerKind, parse_spiffe_id
from pdserve.common.errors import ConfigError, PermissionDeniedError, UnauthenticatedError
from pdserve.common.grpc_handlers import wrap_handler
from pdserve.common.metrics import counter
from pdserve.common.settings import CommonSettings

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
AUTHORIZATION_KEY = "authorization"
_NAME_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


class Role(enum.StrEnum):
    CLIENT = "client"
    ADMIN = "admin"
    WORKER = "worker"
    SERVICE = "service"


# ------------------------------------------------------------------------------ the table

_CLIENT = frozenset({Role.CLIENT, Role.ADMIN})
_OPERATOR = frozenset({Role.ADMIN, Role.SERVICE})
_WORKER_CALLS = frozenset({Role.WORKER, Role.SERVICE})


def _service(name: str, roles: frozenset[Role], *methods: str) -> dict[str, frozenset[Role]]:
    return {f"/pdserve.api.v1.{name}/{method}": roles for method in methods}


METHOD_ROLES: Mapping[str, frozenset[Role]] = {
    **_service("RouterService", _CLIENT, "Generate", "Cancel", "ListModels"),
    **_service("PoolService", frozenset({Role.WORKER}), "Register", "Heartbeat", "Deregister"),
    **_service("PoolService", _OPERATOR, "Drain", "SetTargetSize", "ListWorkers", "WatchPool"),
    **_service("KvTransferService", frozenset({Role.SERVICE}), "OpenTicket"),
    **_service("KvTransferService", _WORKER_CALLS, "UpdateProgress", "RenewLease",
               "PublishDestination", "AwaitDestination", "ReleaseTicket"),
    **_service("KvTransferService", frozenset({Role.WORKER, Role.SERVICE, Role.ADMIN}),
               "AbortTicket"),
    **_service("KvTransferService", _OPERATOR, "GetTicket", "ListTickets", "WatchTickets",
               "GetLedger"),
    **_service("CapacityGovernorService", frozenset({Role.ADMIN}), "SetAutoscalerControls"),
    **_service("CapacityGovernorService", _OPERATOR, "GetCapacity", "GetPlan", "WhatIfPlan",
               "ListDecisions", "GetExpertPlacement", "WhatIfExpertPlacement"),
    **_service("WorkerAgentService", frozenset({Role.SERVICE}), "AdmitTicket", "Prefill",
               "Decode", "DropTicket", "ApplyExpertPlacement", "BeginDrain"),
    **_service("WorkerAgentService", _OPERATOR, "GetStatus", "GetPerformanceProfile"),
}
"""Full gRPC method name -> the roles that may call it."""

PUBLIC_SERVICE_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
"""Methods nobody needs a credential for: load balancers probe health; the schema is public."""


JOIN_METHODS = frozenset({"/pdserve.api.v1.PoolService/Register"})
"""Without mutual TLS, a caller with no credential may still call these: the join token in the
request admits it (the pool checks it, refuses a live worker's id, and returns a worker
credential that names the id it registered)."""


def is_public(method: str) -> bool:
    return method.startswith(PUBLIC_SERVICE_PREFIXES)


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


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size, st.st_ino


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
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        try:
            self._stamp = _stamp(path)
            keys = parse_key_file(path.read_text(), str(path))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the key file: {exc.strerror}") from None
        super().__init__(keys)
        self._next_check_s = clock() + poll_interval_s
        self.num_reloads = 0

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the file if it changed (or ``force``); True when new keys were installed.
        A file that cannot be read or parsed leaves the current keys in place."""
        now = self._clock()
        if not force and now < self._next_check_s:
            return False
        self._next_check_s = now + self._poll_interval_s
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp and not force:
                return False
            keys = parse_key_file(self.path.read_text(), str(self.path))
        except OSError as exc:
            logger.warning("key file %s unreadable (keeping %d keys): %s", self.path,
                           len(self._keys), exc.strerror)
            return False
        except ConfigError as exc:
            logger.warning("key file changed but is invalid (keeping %d keys): %s",
                           len(self._keys), exc.message)
            return False
        self._stamp = stamp
        self._install(keys)
        self.num_reloads += 1
        logger.info("key file %s reloaded: %d keys", self.path, len(keys))
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
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        try:
            self._stamp = _stamp(path)
            self._tokens = self._parse(path.read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the token file: {exc.strerror}") from None
        self._next_check_s = clock() + poll_interval_s

    def _parse(self, text: str) -> tuple[str, ...]:
        tokens = tuple(line.strip() for line in text.splitlines()
                       if line.strip() and not line.strip().startswith("#"))
        if not tokens:
            raise ConfigError(f"{self.path}: no token in the file")
        return tokens

    def tokens(self) -> tuple[str, ...]:
        """The valid tokens now (re-read at most every ``poll_interval_s``)."""
        now = self._clock()
        if now >= self._next_check_s:
            self._next_check_s = now + self._poll_interval_s
            try:
                stamp = _stamp(self.path)
                if stamp != self._stamp:
                    self._tokens = self._parse(self.path.read_text())
                    self._stamp = stamp
                    logger.info("token file %s reloaded: %d tokens", self.path,
                                len(self._tokens))
            except (OSError, ConfigError) as exc:
                logger.warning("token file %s changed but cannot be used (keeping the old "
                               "tokens): %s", self.path, getattr(exc, "message", exc))
        return self._tokens


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
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        try:
            self._stamp = _stamp(path)
            self._tokens = parse_service_token_file(path.read_text(), str(path))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the service token file: "
                              f"{exc.strerror}") from None
        self._retired: dict[bytes, tuple[float, str | None]] = {}
        """digest -> (monotonic time its grace ends, raw token or None)."""
        self._next_check_s = clock() + poll_interval_s
        self.num_reloads = 0

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the file if it changed (at most every ``poll_interval_s``, or ``force``);
        True when new tokens were installed."""
        now = self._clock()
        if not force and now < self._next_check_s:
            return False
        self._next_check_s = now + self._poll_interval_s
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp and not force:
                return False
            tokens = parse_service_token_file(self.path.read_text(), str(self.path))
        except OSError as exc:
            logger.warning("service token file %s unreadable (keeping %d tokens): %s",
                           self.path, len(self._tokens), exc.strerror)
            return False
        except ConfigError as exc:
            logger.warning("service token file changed but is invalid (keeping %d tokens): %s",
                           len(self._tokens), exc.message)
            return False
        kept = {token.digest for token in tokens}
        for token in self._tokens:
            if token.digest not in kept:
                self._retired[token.digest] = (now + self.grace_s, token.raw)
        for digest in kept:
            self._retired.pop(digest, None)
        self._stamp = stamp
        self._tokens = tokens
        self.num_reloads += 1
        logger.info("service token file %s reloaded: %d tokens (%d in their grace period)",
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


# --------------------------------------------------------------------- authentication


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, as far as the credentials prove. ``has_credential``: a valid key or a
    pdserve certificate was presented (distinguishes UNAUTHENTICATED from PERMISSION_DENIED)."""

    roles: frozenset[Role]
    tenant: str = ""
    name: str = ""
    has_credential: bool = False
    worker_id: str = ""
    """Set when the caller presented a worker credential: the only worker it may act as."""


class Decision(enum.StrEnum):
    ALLOW = "allow"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"


def decide(method: str, principal: Principal,
           table: Mapping[str, frozenset[Role]] = METHOD_ROLES) -> Decision:
    """Pure: may ``principal`` call ``method``?"""
    if is_public(method):
        return Decision.ALLOW
    allowed = table.get(method, frozenset())
    if principal.roles & allowed:
        return Decision.ALLOW
    return Decision.PERMISSION_DENIED if principal.has_credential else Decision.UNAUTHENTICATED


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


class Authenticator:
    """Turns a call's credentials into a ``Principal`` (see the module docstring for the
    defaults when a key file, the service token file or mutual TLS is absent)."""

    def __init__(self, api_keys: KeyTable | None, admin_keys: KeyTable | None, *,
                 is_mutual_tls: bool, service_tokens: ServiceTokens | None = None) -> None:
        self.api_keys = api_keys
        self.admin_keys = admin_keys
        self.is_mutual_tls = is_mutual_tls
        self.service_tokens = service_tokens
        base: set[Role] = set()
        if api_keys is None:
            base.add(Role.CLIENT)
        if admin_keys is None:
            base.add(Role.ADMIN)
        is_anything_configured = (api_keys is not None or admin_keys is not None
                                  or service_tokens is not None)
        if not is_mutual_tls and not is_anything_configured:
            base |= {Role.SERVICE, Role.WORKER}  # the laptop default: nothing configured at all
        self._base_roles = frozenset(base)

    @property
    def is_open(self) -> bool:
        """Every caller may call everything (nothing configured): no interceptor needed."""
        return self._base_roles == frozenset(Role)

    def _key_roles(self, key: str) -> tuple[set[Role], str, str, str]:
        """``(roles, tenant, name, worker_id)`` that ``key`` proves; raises
        ``UnauthenticatedError`` for a key that is in no file."""
        tokens = self.service_tokens
        if key and tokens is not None:
            if key.startswith(WORKER_CREDENTIAL_PREFIX):
                worker_id = tokens.verify_worker_credential(key)
                if worker_id is None:
                    raise UnauthenticatedError("invalid credentials: unknown worker credential")
                return {Role.WORKER}, "", worker_id, worker_id
            if tokens.is_valid(key):
                return {Role.SERVICE}, "", "service", ""
        admin = self.admin_keys.lookup(key) if self.admin_keys and key else None
        client = self.api_keys.lookup(key) if self.api_keys and key else None
        if admin is None and client is None:
            raise UnauthenticatedError("invalid credentials: unknown key")
        roles: set[Role] = set()
        if admin is not None:
            roles.add(Role.ADMIN)
        if client is not None:
            roles.add(Role.CLIENT)
        return roles, client or "", admin or "", ""

    def authenticate(self, key: str | None, spiffe_id: str | None) -> Principal:
        """Raises ``UnauthenticatedError`` for a key (or worker credential) that no file
        proves."""
        roles = set(self._base_roles)
        tenant = name = worker_id = ""
        has_credential = False
        if key is not None:
            key_roles, tenant, name, worker_id = self._key_roles(key)
            roles |= key_roles
            has_credential = True
        if spiffe_id and self.is_mutual_tls:
            identity = parse_spiffe_id(spiffe_id)
            if identity is not None:
                kind, cert_name = identity
                if kind is PeerKind.SERVICE:
                    roles.add(Role.SERVICE)
                elif kind is PeerKind.WORKER:
                    roles.add(Role.WORKER)
                name = name or cert_name
                has_credential = has_credential or kind is not PeerKind.CLIENT
        return Principal(frozenset(roles), tenant=tenant, name=name,
                         has_credential=has_credential, worker_id=worker_id)


_REFUSED_CALLS = counter(
    "grpc", "auth_refused", "calls",
    "gRPC calls refused by authentication or authorization, by method and status code "
    "(unauthenticated, permission_denied).", ("method", "code"))


def count_refusal(method: str, code: grpc.StatusCode) -> None:
    """Count one refused call (``pdserve_grpc_auth_refused_calls_total``); methods outside
    ``METHOD_ROLES`` share the label ``other`` so a scanner cannot grow the label set."""
    label = method if method in METHOD_ROLES else "other"
    _REFUSED_CALLS.labels(method=label, code=code.name.lower()).inc()


def check_worker_id(worker_id: str, field: str = "worker_id", *, method: str = "") -> None:
    """Refuse (``PermissionDeniedError`` naming ``field``) a call made with a worker credential
    for another worker than ``worker_id``. A caller without a worker credential (a service, an
    operator, an mTLS worker certificate, the open default) is not bound to a worker id."""
    principal = _PRINCIPAL.get()
    if principal is None or not principal.worker_id or principal.worker_id == worker_id:
        return
    count_refusal(method, grpc.StatusCode.PERMISSION_DENIED)
    raise PermissionDeniedError(
        f"{field}: this worker credential acts only as {principal.worker_id!r}, not "
        f"{worker_id!r}", field=field)


_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "pdserve_principal", default=None)


def current_principal() -> Principal | None:
    """The authenticated caller of the gRPC call being served (None without the interceptor)."""
    return _PRINCIPAL.get()


def current_tenant() -> str:
    """The calling client's tenant (from its API key); ``""`` when unknown or unauthenticated."""
    principal = _PRINCIPAL.get()
    return principal.tenant if principal is not None else ""


def _peer_spiffe_id(context: grpc.aio.ServicerContext) -> str | None:
    try:
        values = context.auth_context().get("peer_spiffe_id") or ()
    except Exception:  # noqa: BLE001 - no auth context on an insecure port
        return None
    for value in values:
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates and authorizes every call (``METHOD_ROLES``) before its handler runs, and
    makes the caller available to the handler through ``current_principal``."""

    def __init__(self, authenticator: Authenticator,
                 table: Mapping[str, frozenset[Role]] = METHOD_ROLES) -> None:
        self.authenticator = authenticator
        self._table = table

    async def _admit(self, method: str, context: grpc.aio.ServicerContext) -> Principal:
        """The caller, or the call is aborted (``context.abort`` raises)."""
        try:
            principal = self.authenticator.authenticate(
                bearer_key(context.invocation_metadata()), _peer_spiffe_id(context))
        except UnauthenticatedError as exc:
            logger.debug("%s refused from %s: %s", method, context.peer(), exc.message)
            count_refusal(method, grpc.StatusCode.UNAUTHENTICATED)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, exc.message)
            raise  # unreachable: abort raises
        decision = decide(method, principal, self._table)
        if (decision is Decision.UNAUTHENTICATED and method in JOIN_METHODS
                and not self.authenticator.is_mutual_tls):
            decision = Decision.ALLOW  # the request's join token is the credential: the pool
        if decision is Decision.UNAUTHENTICATED:
            logger.debug("%s refused from %s: no credentials", method, context.peer())
            count_refusal(method, grpc.StatusCode.UNAUTHENTICATED)
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing credentials: send 'authorization: Bearer <key>' or a client certificate")
        elif decision is Decision.PERMISSION_DENIED:
            error = PermissionDeniedError(f"{method}: not allowed for this caller")
            logger.debug("%s refused for roles %s", method, sorted(principal.roles))
            count_refusal(method, grpc.StatusCode.PERMISSION_DENIED)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, error.message)
        return principal

    def _wrap(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            @functools.wraps(behavior)
            async def wrapped_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                _PRINCIPAL.set(await self._admit(method, context))
                async for response in behavior(request, context):
                    yield response

            return wrapped_stream

        @functools.wraps(behavior)
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _PRINCIPAL.set(await self._admit(method, context))
            return await behavior(request, context)

        return wrapped

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_public(method):
            return handler
        return wrap_handler(handler, lambda behavior: self._wrap(behavior, method))


def load_key_file(path: Path | None) -> KeyFile | None:
    return KeyFile(path) if path is not None else None


def auth_interceptor(settings: CommonSettings) -> AuthInterceptor | None:
    """The interceptor a server with ``settings`` needs, or None when nothing is configured
    (no key files, no service token file and no mutual TLS: every call is allowed, at no
    cost)."""
    tls = settings.tls
    is_mutual = tls is not None and tls.cert_path is not None and tls.ca_path is not None
    service_tokens = load_service_tokens(settings)
    authenticator = Authenticator(load_key_file(settings.api_keys_path),
                                  load_key_file(settings.admin_keys_path),
                                  is_mutual_tls=is_mutual, service_tokens=service_tokens)
    if authenticator.is_open:
        return None
    if not is_mutual and service_tokens is None:
        logger.warning("keys are set but there is neither mutual TLS nor a service token file: "
                       "internal methods (workers, services) refuse every caller on %s; set "
                       "service_tokens_path on every service", settings.grpc_address)
    if authenticator.admin_keys is None and not is_mutual:
        logger.info("no admin key file: the operator methods this server has (Drain, "
                    "SetTargetSize, SetAutoscalerControls, GetStatus, ...) are open to every "
                    "caller on %s", settings.grpc_address)
    return AuthInterceptor(authenticator)


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
