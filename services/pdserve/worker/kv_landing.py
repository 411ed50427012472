"""The decode side's KV data path over one KV memory: who owns each block, and the receiver that
lands frames there.

Whoever picks a ticket's blocks hands them to ``claim``: the ticket's fencing token becomes their
owner (``BlockOwnerTable``) and the receiver expects the prompt's layers in them, so from then on
only frames under that token naming those blocks land. ``release`` ends it the other way round:
the receiver refuses anything more of the ticket first, then the blocks lose their owner, and only
then may they serve another ticket. The in-house decode scheduler uses this over the host
``KvCache``; an engine's KV connector can use it over its own memory, in the process that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.errors import UnavailableError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.runtime import KvPlacement
from pdserve.worker.transports.base import KvReceiver
from pdserve.worker.transports.registry import TransportBackend
from pdserve.worker.transports.values import TransferResult


class KvLanding:
    """Block owners and the KV receiver of one ``KvCache``. Lives on one event loop."""

    def __init__(self, kv_cache: KvCache) -> None:
        self.kv_cache = kv_cache
        self.owners = BlockOwnerTable(kv_cache.layout.num_blocks)
        self.receiver: KvReceiver | None = None

    async def start(self, kv_host: str, kv_port: int, transport: TransportBackend) -> str:
        """Start receiving over ``transport``; returns the address senders use."""
        self.receiver = transport.create_receiver(self.kv_cache, self.owners)
        return await self.receiver.start(kv_host, kv_port)

    async def close(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()

    def own(self, token: FencingToken, block_ids: Sequence[int]) -> None:
        """Make ``token`` the owner of ``block_ids`` with no KV to arrive (a local prefill)."""
        self.owners.assign(token, block_ids)

    def claim(self, token: FencingToken, block_ids: Sequence[int],
              num_prompt_tokens: int) -> KvPlacement:
        """Make ``token`` the owner of ``block_ids`` and expect every layer of a prompt of
        ``num_prompt_tokens`` tokens in the first blocks; returns where the prompt lands.
        Nothing is kept if it raises (a token is expected at most once, ever)."""
        layout = self.kv_cache.layout
        prompt_block_ids = list(block_ids[:layout.num_blocks_for(num_prompt_tokens)])
        receiver = self._receiver()
        self.owners.assign(token, block_ids)
        try:
            receiver.expect(token, prompt_block_ids, layout.num_layers)
        except BaseException:
            self.owners.release(token)
            raise
        return KvPlacement(tuple(prompt_block_ids), receiver.metadata(), receiver.frame_versions)

    async def wait(self, token: FencingToken, timeout_s: float) -> TransferResult:
        """``KvReceiver.wait``: the transfer once every layer landed and the sender said DONE."""
        return await self._receiver().wait(token, timeout_s)

    def release(self, token: FencingToken, reason: str) -> None:
        """End ``token``'s hold: nothing more of it lands, then its blocks have no owner."""
        if self.receiver is not None:
            self.receiver.cancel(token, reason)
        self.owners.release(token)

    def _receiver(self) -> KvReceiver:
        if self.receiver is None:
            raise UnavailableError("the KV receiver is not started")
        return self.receiver
