"""NIXL itself: importing it (``load_nixl``), an agent with one KV cache's layer buffers
registered (``NixlAgent``), and the READ descriptors of one layer (``read_descriptors``)."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import os
import uuid
import weakref
from types import ModuleType
from typing import Any

import numpy as np

from pdserve.common.errors import UnavailableError
from pdserve.worker.engine import KvCache, KvMemory
from pdserve.worker.transports.nixl.control import ControlError

_NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
"""Import names of the NIXL Python API, tried in this order."""
INSTALL_HINT = "pip install --no-deps nixl-cu12"

_nixl: ModuleType | None = None
_nixl_error = ""


def load_nixl() -> tuple[ModuleType | None, str]:
    """The NIXL module, or ``(None, why)``. Imported once; sets ``UCX_MODULES`` first if unset."""
    global _nixl, _nixl_error
    if _nixl is not None or _nixl_error:
        return _nixl, _nixl_error
    os.environ.setdefault("UCX_MODULES", "^ib")
    errors = []
    for name in _NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if not hasattr(module, "nixl_agent"):
            errors.append(f"{name}: no nixl_agent")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO goes to stdout
        _nixl = module
        return _nixl, ""
    _nixl_error = f"NIXL is not installed ({INSTALL_HINT}): " + "; ".join(errors)
    return None, _nixl_error


_agent_numbers = itertools.count(1)


class NixlAgent:
    """A NIXL agent (UCX, no progress thread) with one KV cache's layer buffers registered.

    ``base_addresses[l]`` is the address of layer l's buffer; block b of layer l starts at
    ``base_addresses[l] + b * block_nbytes``. ``close`` deregisters (also run at collection).
    """

    def __init__(self, kv_cache: KvCache, role: str) -> None:
        nixl, why = load_nixl()
        if nixl is None:
            raise UnavailableError(f"transport 'nixl' unavailable: {why}")
        self.name = f"pdserve-{role}-{os.getpid()}-{next(_agent_numbers)}-{uuid.uuid4().hex[:8]}"
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        try:
            self.agent: Any = nixl.nixl_agent(self.name, config)
        except Exception as exc:
            raise UnavailableError(f"cannot create a NIXL agent: {exc}") from exc
        if "UCX" not in self.agent.backends:
            raise UnavailableError("NIXL has no UCX backend here")
        self.block_nbytes = kv_cache.layout.block_nbytes
        memory = kv_cache.memory
        self.memory_kind = memory.kind
        """NIXL's memory type of the registered layers: DRAM (host) or VRAM (a GPU's)."""
        self.device_id = memory.device_id
        self.base_addresses = np.array(memory.layer_addresses, dtype=np.uint64)
        self._registration = self.agent.register_memory(memory_regions(memory), memory.kind)
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._remote_names: set[str] = set()
        self._finalizer = weakref.finalize(self, _deregister, self.agent, self._registration,
                                           kv_cache)

    def add_remote(self, name: str, metadata: bytes) -> None:
        """Load a peer's metadata once per peer name; raises ``ControlError`` if it is not
        that peer's."""
        if name in self._remote_names:
            return
        try:
            loaded = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise ControlError(f"peer metadata refused by NIXL: {exc}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(loaded)
            raise ControlError(f"metadata names agent {loaded!r}, HELLO said {name!r}")
        self._remote_names.add(name)

    def progress(self) -> None:
        """Drive the agent's progress (notifications are not used; they are dropped)."""
        self.agent.get_new_notifs()

    def close(self) -> None:
        self._finalizer()


def memory_regions(memory: KvMemory) -> list[tuple[int, int, int, str]]:
    """NIXL registration regions ``(address, nbytes, device_id, "")``, one per layer."""
    return [(address, nbytes, memory.device_id, "")
            for address, nbytes in zip(memory.layer_addresses, memory.layer_nbytes, strict=True)]


def _deregister(agent: Any, registration: Any, kv_cache: KvCache) -> None:
    """Deregister before the cache's memory can go away (``kv_cache`` is held until then)."""
    with contextlib.suppress(Exception):
        agent.deregister_memory(registration)
    del kv_cache


def _paired_runs(dst_ids: np.ndarray, src_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """Maximal runs where both dst and src ids go up by one: ``(dst_first, src_first, count)``."""
    is_break = (np.diff(dst_ids) != 1) | (np.diff(src_ids) != 1)
    starts = np.concatenate(([0], np.flatnonzero(is_break) + 1))
    counts = np.diff(np.concatenate((starts, [dst_ids.size])))
    return dst_ids[starts], src_ids[starts], counts


def read_descriptors(local: NixlAgent, layer: int, dst_ids: np.ndarray, remote_base: int,
                     src_ids: np.ndarray, remote_device_id: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Two ``uint64[n, 3]`` arrays ``(address, nbytes, device)``: local destination runs (on the
    local agent's device) and the matching remote source runs of one layer (on
    ``remote_device_id``), equal lengths row by row."""
    block_nbytes = local.block_nbytes
    dst_first, src_first, counts = _paired_runs(dst_ids, src_ids)
    nbytes = counts.astype(np.uint64) * np.uint64(block_nbytes)
    local_device = np.full_like(nbytes, local.device_id)
    remote_device = np.full_like(nbytes, remote_device_id)
    local_addr = local.base_addresses[layer] + dst_first.astype(np.uint64) * np.uint64(block_nbytes)
    remote_addr = np.uint64(remote_base) + src_first.astype(np.uint64) * np.uint64(block_nbytes)
    return (np.stack([local_addr, nbytes, local_device], axis=1),
            np.stack([remote_addr, nbytes, remote_device], axis=1))

