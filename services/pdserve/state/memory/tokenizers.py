"""``TokenizerStore`` in process memory."""

from __future__ import annotations

from pdserve.common.tokenizer_bundle import TokenizerBundle
from pdserve.common.types import Clock
from pdserve.state.shared import check_required, check_ttl


class MemoryTokenizerStore:
    """Bundles by digest; one expires ``ttl_s`` after its last put or touch, on the injected
    clock."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._bundles: dict[str, tuple[TokenizerBundle, float]] = {}

    async def put(self, bundle: TokenizerBundle, ttl_s: float) -> None:
        check_ttl(ttl_s)
        self._bundles[bundle.sha256] = (bundle, self._clock() + ttl_s)

    async def get(self, sha256: str) -> TokenizerBundle | None:
        check_required(sha256, "sha256")
        entry = self._bundles.get(sha256)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._bundles[sha256]
            return None
        return entry[0]

    async def touch(self, sha256: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        bundle = await self.get(sha256)
        if bundle is None:
            return False
        self._bundles[sha256] = (bundle, self._clock() + ttl_s)
        return True
