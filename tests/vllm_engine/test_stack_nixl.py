"""The whole stack on vLLM (``stack_support``) with the KV over nixl and two prefill workers: the
decode engine's connector READs each layer a prefill engine's connector announces, out of that
engine's registered KV cache into blocks the decode side owns. The same token-exact, checksummed
handoff as over tcp (``test_stack``; the fault tests there exercise the paths both transports
share); prefix routing fed by vLLM's own KV cache events: a conversation's second turn goes
to the prefill worker whose engine holds the first turn, and stops being sent there for its
prefix once that engine has evicted it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from e2e.conftest import ServiceProcess
from e2e.faults import MODEL
from helpers.requirements import require_nixl
from stack_support import (
    AFTER_SEED,
    BLOCK_SIZE,
    PROMPTS,
    VllmStack,
    _generate,
    _prompt,
    _wait_for,
    check_token_exact_and_checksummed,
    start_vllm_stack,
    status_of,
)

from pdserve.common.tokenizer import prefix_block_hashes
from pdserve.state.prefix_index import RedisPrefixIndex

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

TURN_ONE = _prompt(8 * BLOCK_SIZE + 10, 30)
"""A first turn of eight full blocks (and a partial one, which no engine caches)."""
MAX_FILLERS = 96


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nixl_stack(tiny_model_dir: Path, e2e_redis_url: str, e2e_database_url: str,
                     processes: list[ServiceProcess]) -> AsyncIterator[VllmStack]:
    require_nixl()
    yield await start_vllm_stack(tiny_model_dir, e2e_redis_url, e2e_database_url, processes,
                                 transport="nixl", prompts={**PROMPTS, **AFTER_SEED},
                                 num_prefill=2)


async def test_workers_register_nixl(nixl_stack: VllmStack) -> None:
    for role in ("prefill", "decode"):
        for worker in nixl_stack.workers(role):
            assert "nixl" in worker.kv_transports, role


async def test_handoff_over_nixl_is_token_exact_and_checksummed(nixl_stack: VllmStack) -> None:
    await check_token_exact_and_checksummed(nixl_stack)


async def _cache_hits(stack: VllmStack, worker_id: str) -> int:
    (worker,) = [w for w in stack.workers("prefill") if w.worker_id == worker_id]
    return (await status_of(worker)).prompt_tokens_by_source.get("local_cache_hit", 0)


async def test_second_turn_goes_where_vllm_holds_the_first_until_it_is_evicted(
        nixl_stack: VllmStack) -> None:
    client = aioredis.Redis.from_url(nixl_stack.stack.env["PDSERVE_REDIS_URL"])
    index = RedisPrefixIndex(client)
    worker_ids = [w.worker_id for w in nixl_stack.workers("prefill")]
    hashes = prefix_block_hashes(TURN_ONE, BLOCK_SIZE)
    assert len(hashes) == 8

    async def held() -> dict[str, int]:
        return await index.overlap(MODEL, worker_ids, hashes)

    try:
        first = await _generate(nixl_stack, TURN_ONE)
        assert first.error is None and first.final is not None
        holder = first.final.prefill_worker_id
        (other,) = set(worker_ids) - {holder}

        async def indexed() -> bool:  # the engine's events, reported on a heartbeat
            return (await held())[holder] == len(hashes)

        await _wait_for(indexed, 30.0, "the first turn's blocks in the holder's prefix index")
        assert (await held())[other] == 0

        # The second turn extends the first: it goes to the holder, whose vLLM finds the first
        # turn's eight full blocks in its prefix cache (vLLM's own count for the request,
        # ``RequestOutput.num_cached_tokens``, which the usage reports as OpenAI's
        # ``cached_tokens``).
        assert first.final.usage.cached_prompt_tokens == 0
        turn_two = TURN_ONE + first.tokens + _prompt(40, 31)
        hits_before = await _cache_hits(nixl_stack, holder)
        second = await _generate(nixl_stack, turn_two)
        assert second.error is None and second.final is not None
        assert second.final.prefill_worker_id == holder
        assert second.final.usage.cached_prompt_tokens == len(hashes) * BLOCK_SIZE
        # vLLM's running counter (its stat loggers' prompt tokens by source), as the agent
        # reports it: printed only, it reaches the agent with the engine's next stats record.
        await asyncio.sleep(1.0)
        print(f"holder's prefix-cache hit counter for the second turn: "
              f"{await _cache_hits(nixl_stack, holder) - hits_before} tokens "
              f"(the first turn's full blocks: {len(hashes) * BLOCK_SIZE})")

        # Other conversations fill the holder's cache: vLLM evicts the first turn's blocks,
        # its events say so, and the index stops naming the holder for that prefix.
        num_fillers = 0

        async def evicted() -> bool:
            return (await held())[holder] == 0

        while not await evicted():
            assert num_fillers < MAX_FILLERS, "the holder's engine never evicted the first turn"
            batch = [_prompt(15 * BLOCK_SIZE, 100 + num_fillers + i) for i in range(4)]
            replies = await asyncio.gather(*(_generate(nixl_stack, p, max_tokens=1)
                                             for p in batch))
            assert all(r.error is None for r in replies)
            num_fillers += len(batch)
            await asyncio.sleep(1.0)  # a heartbeat carries the evictions
        hits = {w: await _cache_hits(nixl_stack, w) for w in worker_ids}
        third = await _generate(nixl_stack, turn_two)
        assert third.error is None and third.final is not None
        served_by = third.final.prefill_worker_id
        assert third.final.usage.cached_prompt_tokens == 0  # nothing was cached
        assert await _cache_hits(nixl_stack, served_by) == hits[served_by]
    finally:
        await client.aclose()
