"""The floor ``bench/peers.py`` holds pdserve's CPU per request against (``bench/_path_floor.py``)
must do the work it claims, or its ratio means nothing: four real processes on a private Redis,
every request through the coordinator's scripts, a decode stream and the prefill's KV frames."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def floor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    sys.path.insert(0, str(BENCH))
    try:
        from _peers_procs import start_floor
    finally:
        sys.path.remove(str(BENCH))
    started = start_floor(tmp_path_factory.mktemp("floor"))
    try:
        yield started
    finally:
        started.stop()


def _post(base_url: str, is_stream: bool, num_prompt_tokens: int = 200) -> bytes:
    body = {"model": "llama-3.1-8b", "prompt": list(range(num_prompt_tokens)), "max_tokens": 8,
            "stream": is_stream}
    request = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return response.read()


def test_streamed_and_whole_answers(floor: object) -> None:
    streamed = _post(floor.base_url, True).decode()  # type: ignore[attr-defined]
    events = [line[6:] for line in streamed.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "12,3,4,5,6,7,8"
    assert chunks[-1]["usage"] == {"prompt_tokens": 200, "completion_tokens": 8,
                                   "total_tokens": 208}
    whole = json.loads(_post(floor.base_url, False))  # type: ignore[attr-defined]
    assert whole["choices"][0]["text"] == "1,2,3,4,5,6,7,8"


def test_concurrent_requests_each_land_their_kv_and_free_their_blocks(floor: object) -> None:
    """Prompts of different lengths at once: each decode stream waits for exactly its own
    ticket's layers (a frame counted against another ticket would end one early or hang it),
    and every reservation the coordinator's Open script made is released again."""
    base_url = floor.base_url  # type: ignore[attr-defined]
    lengths = [16 * (1 + i % 7) + i % 3 for i in range(48)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda n: _post(base_url, True, n), lengths))
    assert all(a.endswith(b"data: [DONE]\n\n") for a in answers)
    store = redis.Redis.from_url(floor.store_url)  # type: ignore[attr-defined]
    # The decode side reports ended tickets after their streams close: wait for the last batch.
    deadline = time.monotonic() + 10
    while store.keys("floor:ticket:*") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.keys("floor:ticket:*") == []
    assert int(store.hget("floor:ledger:{decode-0}", "reserved") or 0) == 0
