"""The decode worker's block owner table: who may write which block, by fencing token."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.common.errors import InvalidArgumentError, StaleTokenError
from pdserve.common.types import FencingToken
from pdserve.worker.kv_owner import BlockConflictError, BlockOwnerTable, ForeignBlockError


@pytest.fixture
def table() -> BlockOwnerTable:
    return BlockOwnerTable(16)


def test_assign_then_check_and_owner_of(table: BlockOwnerTable) -> None:
    token = FencingToken.new()
    table.assign(token, [3, 7, 5])
    table.check(token, [7, 3])
    table.check(token, np.array([5], dtype=np.int64))
    assert table.owner_of(7) == token
    assert table.owner_of(4) is None
    assert table.block_ids_of(token) == [3, 7, 5]
    assert table.num_owned_blocks == 3


def test_assign_adds_to_what_a_token_owns(table: BlockOwnerTable) -> None:
    token = FencingToken.new()
    table.assign(token, [1, 2])
    table.assign(token, [9])
    table.check(token, [1, 2, 9])
    assert table.blocks_by_token() == {str(token): 3}


def test_assign_refuses_blocks_of_another_token_and_changes_nothing(
    table: BlockOwnerTable,
) -> None:
    first, second = FencingToken.new(), FencingToken.new()
    table.assign(first, [1, 2])
    with pytest.raises(BlockConflictError):
        table.assign(second, [0, 2, 4])
    assert table.owner_of(0) is None and table.owner_of(4) is None
    assert table.owner_of(2) == first
    assert table.block_ids_of(second) == []


@pytest.mark.parametrize("block_ids", [[16], [-1], [2, 2]])
def test_assign_refuses_bad_ids(table: BlockOwnerTable, block_ids: list[int]) -> None:
    with pytest.raises(InvalidArgumentError):
        table.assign(FencingToken.new(), block_ids)
    assert table.num_owned_blocks == 0


def test_check_refuses_partial_ownership(table: BlockOwnerTable) -> None:
    mine, theirs = FencingToken.new(), FencingToken.new()
    table.assign(mine, [0, 1])
    table.assign(theirs, [2])
    with pytest.raises(ForeignBlockError, match=r"\[2\]"):
        table.check(mine, [0, 1, 2])
    with pytest.raises(ForeignBlockError):
        table.check(mine, [0, 3])  # 3 is unowned: not mine either
    assert not table.owns_all(mine, [1, 2])
    assert table.owns_all(mine, [1, 0])


def test_foreign_block_error_is_a_stale_token_error(table: BlockOwnerTable) -> None:
    with pytest.raises(StaleTokenError):
        table.check(FencingToken.new(), [0])


def test_check_refuses_out_of_range_ids(table: BlockOwnerTable) -> None:
    token = FencingToken.new()
    table.assign(token, [15])
    with pytest.raises(ForeignBlockError):
        table.check(token, [15, 16])
    assert not table.owns_all(token, [-1])


def test_other_attempt_of_the_same_ticket_owns_nothing(table: BlockOwnerTable) -> None:
    first = FencingToken.new()
    second = FencingToken(first.ticket_id, attempt=2)
    table.assign(second, [4, 5])
    with pytest.raises(ForeignBlockError):
        table.check(first, [4])


def test_release_returns_blocks_and_revokes_for_good(table: BlockOwnerTable) -> None:
    old, new = FencingToken.new(), FencingToken.new()
    table.assign(old, [6, 8])
    assert table.release(old) == [6, 8]
    assert table.num_releases == 1
    table.assign(new, [8, 6])
    with pytest.raises(ForeignBlockError):
        table.check(old, [6])
    table.check(new, [6, 8])
    assert table.release(old) == []  # idempotent
    assert table.num_releases == 1


def test_release_frees_blocks_for_reassignment(table: BlockOwnerTable) -> None:
    token = FencingToken.new()
    table.assign(token, range(16))
    table.release(token)
    assert table.num_owned_blocks == 0
    assert all(table.owner_of(b) is None for b in range(16))


def test_owner_of_out_of_range_is_invalid(table: BlockOwnerTable) -> None:
    with pytest.raises(InvalidArgumentError):
        table.owner_of(16)


def test_empty_check_is_vacuously_true(table: BlockOwnerTable) -> None:
    table.check(FencingToken.new(), [])


def test_many_tokens_keep_separate_blocks() -> None:
    table = BlockOwnerTable(1024)
    rng = np.random.default_rng(7)
    permutation = rng.permutation(1024)
    tokens = [FencingToken.new() for _ in range(32)]
    for i, token in enumerate(tokens):
        table.assign(token, permutation[i * 32 : (i + 1) * 32])
    for i, token in enumerate(tokens):
        table.check(token, permutation[i * 32 : (i + 1) * 32])
        neighbour = permutation[((i + 1) % 32) * 32]
        assert not table.owns_all(token, [neighbour])
    assert sum(table.blocks_by_token().values()) == 1024
