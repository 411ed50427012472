"""Who may call what: client API keys, admin keys and mutual-TLS peer identities, checked by one
gRPC server interceptor in front of every servicer.

Credentials and the roles they give a call:

* ``authorization: Bearer <key>`` metadata whose key is in the **API key file** -> ``client``,
  and the key's tenant becomes the call's tenant (``current_tenant()``, which the router puts
  into ``GenerationRequest.tenant`` for per-tenant limits);
* a key in the **admin key file** -> ``admin`` (the operator API);
* the peer's **mTLS certificate**: its SPIFFE ID ``spiffe://pdserve.local/<kind>/<name>``
  (``pdserve.common.certs``) gives ``service`` or ``worker``; a certificate of kind ``client``
  or without a pdserve ID gives no role (the connection is allowed, the call still needs a key).

Open defaults, so that a laptop stack needs no set-up: with no API key file every caller counts
as ``client`` (tenant ``""``); with no admin key file every caller counts as ``admin``; and a
server **without mutual TLS** cannot tell services from anyone else, so every caller counts as
``service`` and ``worker`` — the network is then the trust boundary, as for the KV data path in
clear. Consequently only mutual TLS *and* both key files close every door; a server with keys
but no mTLS logs a warning at start-up. The router's OpenAI HTTP API checks the same API key
file (``bearer_tenant``: the ``Authorization`` header's bearer key, or 401).

Method -> roles (``METHOD_ROLES``; a method missing from the table is refused, so a new RPC must
be placed here before anyone can call it):

======================================================  ====================================
RouterService: Generate, Cancel, ListModels              client, admin
PoolService: Register, Heartbeat, Deregister             worker (Register/Heartbeat also need
                                                         the join token, checked by the pool)
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

Refusals: a call with no usable credential (no key, no pdserve certificate) or with a key that is
in no file gets ``UNAUTHENTICATED``; a caller whose roles do not include the method's gets
``PERMISSION_DENIED`` (e.g. a client key on an admin method, a worker certificate on
``SetTargetSize``).

Key files hold one ``<key> <name>`` pair per line (``#`` starts a comment line, blank lines are
ignored); a key has at least ``MIN_KEY_CHARS`` characters and no spaces, a name is a tenant (API
keys) or an operator (admin keys). Files are re-read without a restart when their modification
time, size or inode changes (checked at most every ``poll_interval_s`` on use); a file that
fails to parse on reload is ignored with a warning and the previous keys stay. Keys are never
logged; lookups compare SHA-256 digests, so lookup time does not depend on how much of a key
matched.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import hashlib
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


# --------------------------------------------------------------------- authentication


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, as far as the credentials prove. ``has_credential``: a valid key or a
    pdserve certificate was presented (distinguishes UNAUTHENTICATED from PERMISSION_DENIED)."""

    roles: frozenset[Role]
    tenant: str = ""
    name: str = ""
    has_credential: bool = False


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
    defaults when a key file or mutual TLS is absent)."""

    def __init__(self, api_keys: KeyTable | None, admin_keys: KeyTable | None, *,
                 is_mutual_tls: bool) -> None:
        self.api_keys = api_keys
        self.admin_keys = admin_keys
        self.is_mutual_tls = is_mutual_tls
        base: set[Role] = set()
        if api_keys is None:
            base.add(Role.CLIENT)
        if admin_keys is None:
            base.add(Role.ADMIN)
        if not is_mutual_tls:
            base |= {Role.SERVICE, Role.WORKER}
        self._base_roles = frozenset(base)

    @property
    def is_open(self) -> bool:
        """Every caller may call everything (nothing configured): no interceptor needed."""
        return self._base_roles == frozenset(Role)

    def authenticate(self, key: str | None, spiffe_id: str | None) -> Principal:
        """Raises ``UnauthenticatedError`` for a key that is in no key file."""
        roles = set(self._base_roles)
        tenant = name = ""
        has_credential = False
        if key is not None:
            admin = self.admin_keys.lookup(key) if self.admin_keys and key else None
            client = self.api_keys.lookup(key) if self.api_keys and key else None
            if admin is None and client is None:
                raise UnauthenticatedError("invalid credentials: unknown key")
            if admin is not None:
                roles.add(Role.ADMIN)
                name = admin
            if client is not None:
                roles.add(Role.CLIENT)
                tenant = client
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
                         has_credential=has_credential)


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
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, exc.message)
            raise  # unreachable: abort raises
        decision = decide(method, principal, self._table)
        if decision is Decision.UNAUTHENTICATED:
            logger.debug("%s refused from %s: no credentials", method, context.peer())
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing credentials: send 'authorization: Bearer <key>' or a client certificate")
        elif decision is Decision.PERMISSION_DENIED:
            error = PermissionDeniedError(f"{method}: not allowed for this caller")
            logger.debug("%s refused for roles %s", method, sorted(principal.roles))
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
    (no key files and no mutual TLS: every call is allowed, at no cost)."""
    tls = settings.tls
    is_mutual = tls is not None and tls.cert_path is not None and tls.ca_path is not None
    authenticator = Authenticator(load_key_file(settings.api_keys_path),
                                  load_key_file(settings.admin_keys_path),
                                  is_mutual_tls=is_mutual)
    if authenticator.is_open:
        return None
    if not is_mutual:
        logger.warning("API/admin keys are set but gRPC is not mutual TLS: internal methods "
                       "(workers, services, Drain, SetTargetSize) are open to anyone who can "
                       "reach %s", settings.grpc_address)
    return AuthInterceptor(authenticator)
