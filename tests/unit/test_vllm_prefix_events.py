"""vLLM's KV cache events as pdserve's prefix index sees them (``prefix_events``): no vLLM needed
(the events are look-alikes of vLLM's; the real ones are in tests/vllm_engine)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pdserve.common.tokenizer import chained_block_hash, prefix_block_hashes
from pdserve.worker.engines.vllm.prefix_events import KvEventSubscriber, PrefixEventIndex

BLOCK = 16


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass
class AllBlocksCleared:
    pass


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def _vllm_hashes(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def test_chained_block_hash_continues_prefix_block_hashes() -> None:
    tokens = _tokens(5 * BLOCK + 3, 0)
    parent = None
    chained = []
    for i in range(5):
        parent = chained_block_hash(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        chained.append(parent)
    assert chained == prefix_block_hashes(tokens, BLOCK)
    with pytest.raises(ValueError):
        chained_block_hash(None, [-1])


def test_stored_runs_chain_across_events_into_the_routers_hashes() -> None:
    tokens = _tokens(4 * BLOCK, 1)
    index = PrefixEventIndex(BLOCK)
    ours = _vllm_hashes("a", 4)
    subscriber = KvEventSubscriber("ipc://unused", index)
    # Two steps of one prompt: blocks 0-1, then 2-3 under block 1.
    subscriber.apply([BlockStored(ours[:2], None, tokens[:2 * BLOCK], BLOCK)])
    subscriber.apply([BlockStored(ours[2:], ours[1], tokens[2 * BLOCK:], BLOCK)])
    expected = prefix_block_hashes(tokens, BLOCK)
    assert index.all_hashes() == sorted(expected)

    # A second prompt sharing two blocks, then diverging: only its new blocks are new.
    other = tokens[:2 * BLOCK] + _tokens(BLOCK, 2)
    subscriber.apply([BlockStored([b"b-2"], ours[1], other[2 * BLOCK:], BLOCK)])
    added, removed = index.take_delta()
    assert added == [prefix_block_hashes(other, BLOCK)[2]] and removed == []


def test_removed_and_cleared_leave_the_delta_and_the_full_report() -> None:
    tokens = _tokens(3 * BLOCK, 3)
    index = PrefixEventIndex(BLOCK)
    subscriber = KvEventSubscriber("ipc://unused", index)
    ours = _vllm_hashes("c", 3)
    subscriber.apply([BlockStored(ours, None, tokens, BLOCK)])
    hashes = prefix_block_hashes(tokens, BLOCK)
    assert index.take_delta() == (sorted(hashes), [])
    assert index.take_delta() == ([], [])  # nothing new since

    subscriber.apply([BlockRemoved([ours[2]])])
    assert index.take_delta() == ([], [hashes[2]])
    # Evicted and stored again between two reports: no change to report.
    subscriber.apply([BlockRemoved([ours[1]]), BlockStored([ours[1]], ours[0],
                                                            tokens[BLOCK:2 * BLOCK], BLOCK)])
    assert index.take_delta() == ([], [])

    subscriber.apply([AllBlocksCleared()])
    assert len(index) == 0
    assert index.take_delta() == ([], sorted(hashes[:2]))
    assert index.all_hashes() == []


def test_blocks_whose_parent_was_never_seen_or_that_do_not_fit_are_skipped() -> None:
    index = PrefixEventIndex(BLOCK)
    subscriber = KvEventSubscriber("ipc://unused", index)
    tokens = _tokens(2 * BLOCK, 4)
    subscriber.apply([BlockStored(_vllm_hashes("d", 2), b"never-seen", tokens, BLOCK)])
    subscriber.apply([BlockStored(_vllm_hashes("e", 2), None, tokens, 2 * BLOCK)])  # block size
    subscriber.apply([BlockStored(_vllm_hashes("f", 2), None, tokens[:-1], BLOCK)])  # short
    subscriber.apply([BlockStored(_vllm_hashes("g", 2), None, tokens, BLOCK, lora_id=3)])
    assert len(index) == 0 and index.num_skipped_blocks == 8
    subscriber.apply([BlockRemoved([b"unknown"])])  # harmless
    assert index.all_hashes() == []
