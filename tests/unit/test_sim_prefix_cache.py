"""The simulator's prefix cache (kept by trace block) against a plain LRU of engine blocks."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import pytest

from pdserve.sim.prefix_cache import PrefixCache
from pdserve.sim.traces import Trace, parse_mooncake_jsonl


class EngineBlockLru:
    """The reference: one entry per engine block hash, a prompt's blocks touched last first."""

    def __init__(self) -> None:
        self.lru: OrderedDict[int, None] = OrderedDict()

    def cached_blocks(self, hashes: list[int]) -> int:
        for n, value in enumerate(hashes):
            if value not in self.lru:
                return n
        return len(hashes)

    def touch(self, hashes: list[int], capacity_blocks: int) -> None:
        for value in reversed(hashes):
            if value in self.lru:
                self.lru.move_to_end(value)
            else:
                self.lru[value] = None
        while len(self.lru) > capacity_blocks:
            self.lru.popitem(last=False)


def _conversations(seed: int, num_requests: int) -> Trace:
    """Prompts that share, extend and cut each other's prefixes: each request takes a random
    earlier prompt's ids (or starts anew), keeps a random number of them, may add new ones, and
    ends anywhere in its last 512-token block (so one trace block is touched at many lengths)."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    next_id = 0
    rows = []
    for i in range(num_requests):
        if prompts and rng.random() < 0.8:
            base = rng.choice(prompts)
            ids = base[:rng.randint(1, len(base))]
        else:
            ids = []
        for _ in range(rng.randint(0 if ids else 1, 3)):
            ids.append(next_id)
            next_id += 1
        prompts.append(ids)
        length = 512 * (len(ids) - 1) + rng.randint(1, 512)
        rows.append(json.dumps({"timestamp": i, "input_length": length, "output_length": 1,
                                "hash_ids": ids}) + "\n")
    return parse_mooncake_jsonl(rows)


@pytest.mark.parametrize(("seed", "block_size", "capacity_blocks"),
                         [(1, 16, 40), (2, 16, 300), (3, 64, 9), (4, 128, 25), (5, 512, 3),
                          (6, 16, 10_000)])
def test_holds_exactly_what_an_engine_block_lru_holds(seed: int, block_size: int,
                                                      capacity_blocks: int) -> None:
    trace = _conversations(seed, 400)
    cache, reference = PrefixCache(), EngineBlockLru()
    rng = random.Random(seed)
    num_hits = 0
    for i in range(trace.num_requests):
        chunks, counts = trace.prefix_chunks(i, block_size)
        hashes = trace.engine_block_hashes(i, block_size)
        assert sum(counts) == len(hashes)
        cached = cache.cached_blocks(chunks, counts)
        assert cached == reference.cached_blocks(hashes), i
        num_hits += cached > 0
        # Probe earlier prompts too: what is held of them must agree as well.
        j = rng.randrange(i + 1)
        assert (cache.cached_blocks(*trace.prefix_chunks(j, block_size))
                == reference.cached_blocks(trace.engine_block_hashes(j, block_size)))
        if chunks:
            cache.touch(chunks, counts, capacity_blocks)
            reference.touch(hashes, capacity_blocks)
        assert cache.num_blocks == len(reference.lru) <= capacity_blocks
    assert num_hits > trace.num_requests // 10  # the prompts do share prefixes


def test_a_prompt_larger_than_the_cache_keeps_its_leading_blocks() -> None:
    trace = parse_mooncake_jsonl([json.dumps({"timestamp": 0, "input_length": 1500,
                                              "output_length": 1, "hash_ids": [4, 5, 6]})])
    chunks, counts = trace.prefix_chunks(0, 16)
    assert counts == [32, 32, 29]  # 1,500 tokens: 93 full blocks of 16
    cache = PrefixCache()
    cache.touch(chunks, counts, 40)
    assert cache.num_blocks == 40
    assert cache.cached_blocks(chunks, counts) == 40
    assert cache.holds(chunks[1]) and not cache.holds(chunks[2])
