"""The ``nixl`` backend: what the transport registry hands out by the name ``nixl``."""

from __future__ import annotations

import time
import weakref

from pdserve.worker.engine import KvCache
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.nixl.agent import load_nixl
from pdserve.worker.transports.nixl.receiver import NixlKvReceiver
from pdserve.worker.transports.nixl.sender import NixlKvSender, SenderAgent
from pdserve.worker.transports.nixl.settings import DEFAULT_NIXL_SETTINGS, NixlTransportSettings
from pdserve.worker.transports.values import MonotonicClock


class NixlBackend:
    """The ``nixl`` backend: available where the NIXL Python API imports."""

    name = "nixl"
    is_pull = True
    frame_versions: tuple[int, ...] = NixlKvReceiver.frame_versions

    def __init__(self, settings: NixlTransportSettings = DEFAULT_NIXL_SETTINGS) -> None:
        self.settings = settings
        self._sender_agents: weakref.WeakKeyDictionary[KvCache, SenderAgent] = (
            weakref.WeakKeyDictionary())

    def is_available(self) -> tuple[bool, str]:
        nixl, why = load_nixl()
        return nixl is not None, why

    def create_receiver(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                        *, clock: MonotonicClock = time.perf_counter) -> NixlKvReceiver:
        return NixlKvReceiver(kv_cache, owner_table, clock, self.settings)

    def create_sender(self, kv_cache: KvCache,
                      *, clock: MonotonicClock = time.perf_counter) -> NixlKvSender:
        shared = self._sender_agents.get(kv_cache)
        if shared is None:
            shared = SenderAgent(kv_cache, self.settings)
            self._sender_agents[kv_cache] = shared
        return NixlKvSender(kv_cache, shared, clock, self.settings)


BACKEND = NixlBackend()
