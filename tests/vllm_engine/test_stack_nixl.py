"""The whole stack on vLLM (``stack_support``) with the KV over nixl: the decode engine's
connector READs each layer the prefill engine's connector announces, out of the prefill engine's
registered KV cache into blocks the decode side owns. The same token-exact, checksummed handoff as
over tcp (``test_stack``); the fault tests there exercise the paths both transports share.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from e2e.conftest import ServiceProcess
from helpers.requirements import require_nixl
from stack_support import (
    AFTER_SEED,
    PROMPTS,
    VllmStack,
    check_token_exact_and_checksummed,
    start_vllm_stack,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nixl_stack(tiny_model_dir: Path, e2e_redis_url: str, e2e_database_url: str,
                     processes: list[ServiceProcess]) -> AsyncIterator[VllmStack]:
    require_nixl()
    yield await start_vllm_stack(tiny_model_dir, e2e_redis_url, e2e_database_url, processes,
                                 transport="nixl", prompts={**PROMPTS, **AFTER_SEED})


async def test_workers_register_nixl(nixl_stack: VllmStack) -> None:
    for role in ("prefill", "decode"):
        assert "nixl" in nixl_stack.worker(role).kv_transports, role


async def test_handoff_over_nixl_is_token_exact_and_checksummed(nixl_stack: VllmStack) -> None:
    await check_token_exact_and_checksummed(nixl_stack)
