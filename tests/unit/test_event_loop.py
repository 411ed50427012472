"""Which event loop a pdserve process runs on (uvloop unless PDSERVE_UVLOOP turns it off)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pdserve.common.runtime import install_fast_event_loop

uvloop = pytest.importorskip("uvloop")


@pytest.fixture
def restored_policy() -> Iterator[None]:
    policy = asyncio.get_event_loop_policy()
    yield
    asyncio.set_event_loop_policy(policy)


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize(("value", "is_uvloop"),
                         [(None, True), ("1", True), ("0", False), ("false", False), ("NO", False)])
def test_setting_picks_the_loop(monkeypatch: pytest.MonkeyPatch, restored_policy: None,
                                value: str | None, is_uvloop: bool) -> None:
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    if value is None:
        monkeypatch.delenv("PDSERVE_UVLOOP", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_UVLOOP", value)
    assert install_fast_event_loop() is is_uvloop
    module = asyncio.run(_loop_module())
    assert module.startswith("uvloop") is is_uvloop, module
