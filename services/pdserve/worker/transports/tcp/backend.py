"""The ``tcp`` backend: what the transport registry hands out by the name ``tcp``."""

from __future__ import annotations

import time

from pdserve.worker.engine import KvCache
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.tcp.receiver import TcpKvReceiver
from pdserve.worker.transports.tcp.sender import TcpKvSender
from pdserve.worker.transports.tcp.settings import DEFAULT_TCP_SETTINGS, TcpTransportSettings
from pdserve.worker.transports.values import MonotonicClock


class TcpBackend:
    """The ``tcp`` backend (always available where there are sockets)."""

    name = "tcp"
    is_pull = False
    frame_versions: tuple[int, ...] = TcpKvReceiver.frame_versions

    def __init__(self, settings: TcpTransportSettings = DEFAULT_TCP_SETTINGS) -> None:
        self.settings = settings

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def create_receiver(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                        *, clock: MonotonicClock = time.perf_counter) -> TcpKvReceiver:
        return TcpKvReceiver(kv_cache, owner_table, clock, self.settings)

    def create_sender(self, kv_cache: KvCache,
                      *, clock: MonotonicClock = time.perf_counter) -> TcpKvSender:
        return TcpKvSender(kv_cache, clock, self.settings)


BACKEND = TcpBackend()

