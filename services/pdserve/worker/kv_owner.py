"""Who owns each physical KV block of a decode worker, by fencing token.

The decode worker is the only owner of its physical blocks (ARCHITECTURE.md, "One request",
step 5): when it admits a ticket its allocator picks blocks and the agent records here that the
ticket's fencing token owns them. Every KV write that arrives from a prefill worker is checked
against this table *before* a byte lands, so a late frame of an expired or retried ticket can
never write into blocks that were handed to someone else.

Only the decode worker's agent calls ``assign`` and ``release``; transports only read
(``check``, ``owns_all``). The table is not thread-safe: it lives on the agent's event loop,
like the receivers that read it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pdserve.common.errors import IllegalTransitionError, InvalidArgumentError, StaleTokenError
from pdserve.common.types import FencingToken

_UNOWNED = -1


class ForeignBlockError(StaleTokenError):
    """A token named blocks it does not own (all of them) right now: refuse, write nothing."""


class BlockConflictError(IllegalTransitionError):
    """``assign`` was asked for blocks another token owns: an allocator bug, never a race."""


BlockIds = Iterable[int] | np.ndarray


class BlockOwnerTable:
    """Owner of each of ``num_blocks`` physical block ids (the same id in every layer).

    Stored as an ``int64[num_blocks]`` array of owner indices (-1 = unowned), so that checking a
    frame of N blocks is one vectorised comparison. Owner indices are never reused: a released
    token's index dies with it, so a stale token cannot match a later owner by accident.

    ``num_releases`` grows by one on every ``release``. Blocks change owner only through a release
    (``assign`` refuses owned blocks), so a reader that checked ownership at release epoch E knows
    it still holds while ``num_releases == E`` — the receivers use this to re-check cheaply
    between the partial reads of one frame.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise InvalidArgumentError(f"num_blocks must be positive, got {num_blocks}")
        self._owner_index = np.full(num_blocks, _UNOWNED, dtype=np.int64)
        self._token_to_index: dict[FencingToken, int] = {}
        self._index_to_token: dict[int, FencingToken] = {}
        self._index_to_block_ids: dict[int, list[int]] = {}
        self._next_index = 0
        self.num_releases = 0

    @property
    def num_blocks(self) -> int:
        return int(self._owner_index.shape[0])

    @property
    def num_owned_blocks(self) -> int:
        return sum(len(ids) for ids in self._index_to_block_ids.values())

    def assign(self, token: FencingToken, block_ids: BlockIds) -> None:
        """Make ``token`` the owner of ``block_ids`` (adds to what it owns already).

        Raises ``InvalidArgumentError`` for ids out of range or repeated, and
        ``BlockConflictError`` if any id is owned by another token; in both cases nothing changes.
        Re-assigning a block the token already owns is a conflict too (it is an allocator bug).
        """
        ids = self._as_ids(block_ids)
        if ids.size == 0:
            return
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            raise InvalidArgumentError(
                f"block ids must be in [0, {self.num_blocks}), got {ids.min()}..{ids.max()}",
                field="block_ids",
            )
        if np.unique(ids).size != ids.size:
            raise InvalidArgumentError("block ids repeat", field="block_ids")
        owners = self._owner_index[ids]
        if (owners != _UNOWNED).any():
            taken = ids[owners != _UNOWNED][:8].tolist()
            raise BlockConflictError(f"blocks already owned, e.g. {taken}; not assigned to {token}")
        index = self._token_to_index.get(token)
        if index is None:
            index = self._next_index
            self._next_index += 1
            self._token_to_index[token] = index
            self._index_to_token[index] = token
            self._index_to_block_ids[index] = []
        self._owner_index[ids] = index
        self._index_to_block_ids[index].extend(ids.tolist())

    def release(self, token: FencingToken) -> list[int]:
        """Take every block away from ``token``; returns them (assignment order). Idempotent."""
        index = self._token_to_index.pop(token, None)
        if index is None:
            return []
        del self._index_to_token[index]
        block_ids = self._index_to_block_ids.pop(index)
        self._owner_index[block_ids] = _UNOWNED
        self.num_releases += 1
        return block_ids

    def owner_of(self, block_id: int) -> FencingToken | None:
        """The token owning ``block_id``, or None. Raises ``InvalidArgumentError`` out of range."""
        if not 0 <= block_id < self.num_blocks:
            raise InvalidArgumentError(f"block id {block_id} not in [0, {self.num_blocks})")
        index = int(self._owner_index[block_id])
        return None if index == _UNOWNED else self._index_to_token[index]

    def block_ids_of(self, token: FencingToken) -> list[int]:
        """Blocks ``token`` owns, in assignment order (empty if none)."""
        index = self._token_to_index.get(token)
        return [] if index is None else list(self._index_to_block_ids[index])

    def owns_all(self, token: FencingToken, block_ids: BlockIds) -> bool:
        """True iff ``token`` owns every one of ``block_ids`` now (vacuously true for none)."""
        ids = self._as_ids(block_ids)
        if ids.size == 0:
            return True
        index = self._token_to_index.get(token)
        if index is None or ids.min() < 0 or ids.max() >= self.num_blocks:
            return False
        return bool((self._owner_index[ids] == index).all())

    def check(self, token: FencingToken, block_ids: BlockIds) -> None:
        """Raise ``ForeignBlockError`` unless ``token`` owns every one of ``block_ids`` now."""
        if self.owns_all(token, block_ids):
            return
        ids = self._as_ids(block_ids)
        if token not in self._token_to_index:
            raise ForeignBlockError(f"{token} owns no blocks on this worker")
        in_range = ids[(ids >= 0) & (ids < self.num_blocks)]
        if in_range.size != ids.size:
            raise ForeignBlockError(f"{token} named block ids outside [0, {self.num_blocks})")
        index = self._token_to_index[token]
        foreign = in_range[self._owner_index[in_range] != index][:8].tolist()
        raise ForeignBlockError(f"{token} does not own blocks {foreign} (of {ids.size} named)")

    def blocks_by_token(self) -> dict[str, int]:
        """``str(token) -> number of blocks it owns``, as a heartbeat's ``BlockReport`` wants."""
        return {
            str(self._index_to_token[index]): len(ids)
            for index, ids in self._index_to_block_ids.items()
        }

    @staticmethod
    def _as_ids(block_ids: BlockIds) -> np.ndarray:
        ids = np.asarray(block_ids if isinstance(block_ids, np.ndarray) else list(block_ids))
        if ids.size == 0:
            return np.zeros(0, dtype=np.int64)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise InvalidArgumentError("block ids must be a flat sequence of integers")
        return ids.astype(np.int64, copy=False)
