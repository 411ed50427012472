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
  PublishDestination, AwaitDestination, ReleaseTicket,
  ReportTickets
KvTransferService: AbortTicket                           worker, service, admin
KvTransferService: GetTicket, ListTickets,               admin, service
  WatchTickets, GetLedger
CapacityGovernorService: SetAutoscalerControls,          admin
  SetLocalPrefillThreshold
CapacityGovernorService: GetCapacity, GetPlan,           admin, service
  WhatIfPlan, ListDecisions, GetExpertPlacement,
  WhatIfExpertPlacement, GetLocalPrefillThreshold
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
SHA-256 digests, so lookup time does not depend on how much of a key matched. The files, the
credentials and the bearer metadata that carries them are ``pdserve.common.credentials``'.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.common.certs import PeerKind, parse_spiffe_id
from pdserve.common.credentials import (
    WORKER_CREDENTIAL_PREFIX,
    KeyTable,
    ServiceTokens,
    bearer_key,
    load_key_file,
    load_service_tokens,
)
from pdserve.common.errors import PermissionDeniedError, UnauthenticatedError
from pdserve.common.grpc_handlers import wrap_handler
from pdserve.common.metrics import counter
from pdserve.common.settings import CommonSettings

logger = logging.getLogger(__name__)



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
               "PublishDestination", "AwaitDestination", "ReleaseTicket", "ReportTickets"),
    **_service("KvTransferService", frozenset({Role.WORKER, Role.SERVICE, Role.ADMIN}),
               "AbortTicket"),
    **_service("KvTransferService", _OPERATOR, "GetTicket", "ListTickets", "WatchTickets",
               "GetLedger"),
    **_service("CapacityGovernorService", frozenset({Role.ADMIN}), "SetAutoscalerControls",
               "SetLocalPrefillThreshold"),
    **_service("CapacityGovernorService", _OPERATOR, "GetCapacity", "GetPlan", "WhatIfPlan",
               "ListDecisions", "GetExpertPlacement", "WhatIfExpertPlacement",
               "GetLocalPrefillThreshold"),
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
