"""Transport backends by name: ``tcp`` (default), ``inproc`` (tests), ``nixl`` (optional).

Each backend is a module exposing ``BACKEND``, imported only when first asked for, so an
optional backend whose library is missing costs nothing until someone names it (and then says
why it is unavailable). Adding one is one line in ``_BUILTIN_MODULES``, or ``register_backend``
from anywhere.
"""

from __future__ import annotations

import importlib
import time
from typing import Protocol, runtime_checkable

from pdserve.common.errors import AlreadyExistsError, InvalidArgumentError, UnavailableError
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.base import KvReceiver, KvSender
from pdserve.worker.transports.values import MonotonicClock


@runtime_checkable
class TransportBackend(Protocol):
    """A way to move KV between workers. ``is_pull``: the receiver READs what senders offer."""

    name: str
    is_pull: bool
    frame_versions: tuple[int, ...]
    """Versions of the backend's wire format its receivers read (what a worker announces in
    ``WorkerInfo.kv_frame_versions``)."""

    def is_available(self) -> tuple[bool, str]:
        """``(True, "")``, or ``(False, why)`` (missing library, no device)."""
        ...

    def create_receiver(
        self, kv_cache: KvCache, owner_table: BlockOwnerTable,
        *, clock: MonotonicClock = time.perf_counter,
    ) -> KvReceiver:
        """The decode worker's receiver over ``kv_cache``, validating against ``owner_table``."""
        ...

    def create_sender(
        self, kv_cache: KvCache, *, clock: MonotonicClock = time.perf_counter
    ) -> KvSender:
        """A sender for one ticket out of ``kv_cache``."""
        ...


_BUILTIN_MODULES: dict[str, str] = {
    "tcp": "pdserve.worker.transports.tcp.backend",
    "inproc": "pdserve.worker.transports.inproc",
    "nixl": "pdserve.worker.transports.nixl.backend",
}
_BACKENDS: dict[str, TransportBackend] = {}
_IMPORT_ERRORS: dict[str, str] = {}


def register_backend(backend: TransportBackend, *, replace: bool = False) -> None:
    """Make ``backend`` reachable by ``backend.name``."""
    if backend.name in _BACKENDS and not replace:
        raise AlreadyExistsError(f"transport backend {backend.name!r} is registered already")
    _BACKENDS[backend.name] = backend


def _load_builtin(name: str) -> None:
    if name in _BACKENDS or name in _IMPORT_ERRORS or name not in _BUILTIN_MODULES:
        return
    try:
        module = importlib.import_module(_BUILTIN_MODULES[name])
    except ImportError as exc:
        _IMPORT_ERRORS[name] = f"cannot import {_BUILTIN_MODULES[name]}: {exc}"
        return
    _BACKENDS.setdefault(name, module.BACKEND)


def registered_backends() -> list[str]:
    """Every known backend name, available or not, sorted."""
    return sorted(set(_BUILTIN_MODULES) | set(_BACKENDS))


def get_backend(name: str) -> TransportBackend:
    """The backend called ``name``. Unknown -> ``InvalidArgumentError`` naming the known ones;
    known but unusable here -> ``UnavailableError`` saying why."""
    _load_builtin(name)
    backend = _BACKENDS.get(name)
    if backend is None:
        if name in _IMPORT_ERRORS:
            raise UnavailableError(f"transport {name!r} unavailable: {_IMPORT_ERRORS[name]}")
        raise InvalidArgumentError(
            f"unknown transport {name!r}; known: {', '.join(registered_backends())}",
            field="transport",
        )
    is_ok, why = backend.is_available()
    if not is_ok:
        raise UnavailableError(f"transport {name!r} unavailable: {why}")
    return backend


def backend_status() -> dict[str, str]:
    """``name -> ""`` for every usable backend, ``name -> why not`` for the others."""
    result: dict[str, str] = {}
    for name in registered_backends():
        _load_builtin(name)
        if name in _IMPORT_ERRORS:
            result[name] = _IMPORT_ERRORS[name]
            continue
        is_ok, why = _BACKENDS[name].is_available()
        result[name] = "" if is_ok else why or "unavailable"
    return result


def available_backends() -> list[str]:
    """Names of the backends usable in this process, sorted."""
    return [name for name, why in backend_status().items() if not why]
