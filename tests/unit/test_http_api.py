"""The OpenAI-compatible HTTP adapter against a fake backend, over a real socket on port 0."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest
from helpers.http_backend import (
    MODEL,
    NUM_CACHED_PROMPT_TOKENS,
    REPLY,
    TOKENIZER,
    FakeBackend,
    serve,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.errors import (
    CapacityError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from pdserve.common.tokenizer import render_chat_prompt
from pdserve.router.detokenizer import IncrementalText
from pdserve.router.types import (
    FinishReason,
    ModelCard,
    PrefillMode,
)


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except the final ``[DONE]``."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, headers: Mapping[str, str] | None = None
) -> tuple[int, Mapping[str, str], str]:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    async with session.post(url, data=data, headers=headers) as response:
        return response.status, response.headers, await response.text()


# ---------------------------------------------------------------------------------------------
# Models and health


async def test_models_list_and_retrieve() -> None:
    backend = FakeBackend(models=[ModelCard("a/b", 2048, created_unix_s=5), ModelCard("c", 8192)])
    async with serve(backend) as (session, base):
        async with session.get(f"{base}/v1/models") as response:
            body = await response.json()
        assert response.status == 200
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["a/b", "c"]
        assert body["data"][0] == {
            "id": "a/b",
            "object": "model",
            "created": 5,
            "owned_by": "pdserve",
            "max_model_len": 2048,
        }
        async with session.get(f"{base}/v1/models/a/b") as response:
            assert response.status == 200
            assert (await response.json())["id"] == "a/b"
        async with session.get(f"{base}/v1/models/nope") as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "model_not_found"


async def test_health_follows_the_model_list() -> None:
    backend = FakeBackend()
    async with serve(backend) as (session, base):
        async with session.get(f"{base}/health") as response:
            assert response.status == 200
        backend.models = []
        async with session.get(f"{base}/health") as response:
            assert response.status == 503


async def test_unknown_route_and_method_get_openai_error_bodies() -> None:
    async with serve(FakeBackend()) as (session, base):
        async with session.get(f"{base}/v1/nothing") as response:
            assert response.status == 404
            assert "error" in await response.json()
        async with session.get(f"{base}/v1/completions") as response:
            assert response.status == 405
            assert "message" in (await response.json())["error"]


# ---------------------------------------------------------------------------------------------
# Completions


async def test_completion_non_streaming() -> None:
    backend = FakeBackend()
    body = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 42,
        "ignore_eos": True,
        "user": "ignored extra field",
    }
    async with serve(backend) as (session, base):
        status, headers, text = await post(session, f"{base}/v1/completions", body)
    assert status == 200
    reply = json.loads(text)
    assert reply["object"] == "text_completion"
    assert reply["id"].startswith("cmpl-") and headers["x-request-id"] == reply["id"]
    assert reply["model"] == MODEL and reply["created"] == 1_700_000_000
    assert reply["choices"] == [
        {"index": 0, "text": REPLY[:5], "logprobs": None, "finish_reason": "length"}
    ]
    assert reply["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": NUM_CACHED_PROMPT_TOKENS},
    }
    (request,) = backend.requests
    assert request.request_id == reply["id"]
    assert request.prompt_token_ids == tuple(b"abc")
    assert (request.max_tokens, request.temperature, request.top_p, request.seed) == (
        5,
        0.5,
        0.9,
        42,
    )
    assert request.ignore_eos is True and request.prefill_mode == PrefillMode.AUTO
    assert backend.cancelled_ids == []


async def test_completion_defaults() -> None:
    backend = FakeBackend()
    async with serve(backend) as (session, base):
        status, _, text = await post(
            session, f"{base}/v1/completions", {"model": MODEL, "prompt": "x"}
        )
    assert status == 200
    (request,) = backend.requests
    assert request.max_tokens == 16 and request.ignore_eos is False and request.stop == ()
    assert json.loads(text)["choices"][0]["text"] == REPLY[:16]


async def test_completion_stops_with_eos_before_max_tokens() -> None:
    backend = FakeBackend(reply="short")
    async with serve(backend) as (session, base):
        _, _, text = await post(
            session, f"{base}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 50}
        )
    reply = json.loads(text)
    assert reply["choices"][0]["text"] == "short"
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("include_usage", [True, False])
async def test_completion_streaming(include_usage: bool) -> None:
    backend = FakeBackend(tokens_per_chunk=3)
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": include_usage},
    }
    async with serve(backend) as (session, base):
        status, headers, text = await post(session, f"{base}/v1/completions", body)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) == 4  # 10 tokens, 3 per chunk
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY[:10]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all(
        c["object"] == "text_completion" and c["id"] == headers["x-request-id"] for c in chunks
    )
    usage_chunks = [e for e in events[:-1] if not e["choices"]]
    if include_usage:
        assert all(c["usage"] is None for c in chunks)
        assert [u["usage"]["completion_tokens"] for u in usage_chunks] == [10]
        assert usage_chunks[0]["usage"]["prompt_tokens"] == 5
        assert usage_chunks[0]["usage"]["total_tokens"] == 15
        assert events[-2] is usage_chunks[0]
    else:
        assert usage_chunks == [] and all("usage" not in c for c in chunks)


async def test_a_stream_ends_in_one_http_chunk_with_its_finishing_chunk_usage_and_done() -> None:
    """The finishing chunk, the usage event and ``[DONE]`` leave in one write with the chunked
    body's terminator (aiohttp's ``iter_chunks`` yields one item per HTTP chunk); the text
    chunks before them each leave as soon as they are made."""
    backend = FakeBackend(tokens_per_chunk=3)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}}
    async with serve(backend) as (session, base):
        async with session.post(f"{base}/v1/completions", data=json.dumps(body)) as response:
            http_chunks = [data async for data, _ in response.content.iter_chunks()]
    events = [sse_events(chunk.decode()) for chunk in http_chunks if chunk]
    *texts, last = events
    assert [len(e) for e in texts] == [1, 1, 1]
    assert all(e[0]["choices"][0]["finish_reason"] is None for e in texts)
    finishing, usage, done = last
    assert finishing["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert done == "[DONE]"


@pytest.mark.parametrize("prompt", [[5, 6, 7, 256], [[5, 6, 7, 256]], ["\x05\x06\x07<|bos|>"]])
async def test_prompt_forms_give_the_same_token_ids(prompt: Any) -> None:
    backend = FakeBackend()
    async with serve(backend) as (session, base):
        status, _, text = await post(
            session, f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
    assert status == 200
    assert backend.requests[0].prompt_token_ids == (5, 6, 7, 256)
    assert json.loads(text)["usage"]["prompt_tokens"] == 4


async def test_model_may_be_omitted_when_one_model_is_served() -> None:
    backend = FakeBackend()
    async with serve(backend) as (session, base):
        status, _, _ = await post(session, f"{base}/v1/completions", {"prompt": "x"})
    assert status == 200 and backend.requests[0].model == MODEL


# ---------------------------------------------------------------------------------------------
# Chat


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
    },
]


async def test_chat_non_streaming() -> None:
    backend = FakeBackend()
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 7, "max_tokens": 99}
    async with serve(backend) as (session, base):
        status, headers, text = await post(session, f"{base}/v1/chat/completions", body)
    assert status == 200
    reply = json.loads(text)
    assert reply["object"] == "chat.completion"
    assert reply["id"].startswith("chatcmpl-") and headers["x-request-id"] == reply["id"]
    assert reply["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": REPLY[:7]},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    prompt_ids = TOKENIZER.encode(render_chat_prompt(MESSAGES))
    assert backend.requests[0].prompt_token_ids == tuple(prompt_ids)
    assert backend.requests[0].max_tokens == 7
    assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
    assert reply["usage"]["completion_tokens"] == 7


async def test_chat_streaming() -> None:
    backend = FakeBackend(tokens_per_chunk=4)
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with serve(backend) as (session, base):
        status, _, text = await post(session, f"{base}/v1/chat/completions", body)
    assert status == 200
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == REPLY[:12]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert events[-2]["usage"]["completion_tokens"] == 12


async def test_chat_without_max_tokens_may_fill_the_context() -> None:
    backend = FakeBackend(models=[ModelCard(MODEL, max_context_tokens=200)])
    async with serve(backend) as (session, base):
        status, _, _ = await post(
            session, f"{base}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}
        )
    assert status == 200
    request = backend.requests[0]
    assert request.max_tokens == 200 - len(request.prompt_token_ids)


# ---------------------------------------------------------------------------------------------
# Text assembly: stop strings, split characters


async def test_stop_string_spanning_chunks_is_cut_and_cancels_the_backend() -> None:
    backend = FakeBackend(tokens_per_chunk=1)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 30, "stop": [", w", "zzz"]}
    async with serve(backend) as (session, base):
        _, _, text = await post(session, f"{base}/v1/completions", body)
        _, _, streamed = await post(session, f"{base}/v1/completions", {**body, "stream": True})
    reply = json.loads(text)
    assert reply["choices"][0]["text"] == "Hello"
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == len("Hello, w")
    pieces = [e["choices"][0]["text"] for e in sse_events(streamed)[:-1]]
    assert "".join(pieces) == "Hello"
    assert sse_events(streamed)[-2]["choices"][0]["finish_reason"] == "stop"
    assert backend.cancelled_ids == [r.request_id for r in backend.requests]
    assert backend.requests[0].stop == (", w", "zzz")


async def test_multibyte_characters_split_across_chunks_stream_whole() -> None:
    reply = "héllo ✓ 😀 done"
    backend = FakeBackend(reply=reply, tokens_per_chunk=1)
    num_tokens = len(reply.encode())
    body = {"model": MODEL, "prompt": "x", "max_tokens": num_tokens, "stream": True}
    async with serve(backend) as (session, base):
        _, _, streamed = await post(session, f"{base}/v1/completions", body)
    pieces = [e["choices"][0]["text"] for e in sse_events(streamed)[:-1]]
    assert "".join(pieces) == reply
    assert not any("\ufffd" in p for p in pieces)
    assert len(pieces) == len(reply)  # one event per whole character


_ALPHABET = "ab✓é"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=_ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=10),
)
def test_released_text_does_not_depend_on_chunking(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    """Released text = text up to the stop string that completes first, whatever the chunks."""
    token_ids = TOKENIZER.encode(text)
    output = IncrementalText(TOKENIZER, stops)
    released: list[str] = []
    position, index = 0, 0
    while position < len(token_ids) and not output.is_stopped:
        size = cuts[index % len(cuts)]
        released.append(output.push(token_ids[position : position + size]))
        position, index = position + size, index + 1
    released.append(output.finish())
    expected = text
    for end in range(len(text) + 1):  # character-by-character reference
        found = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if found:
            expected = text[: min(found)]
            break
    assert "".join(released) == expected
    assert output.is_stopped == any(s in text for s in stops)


# ---------------------------------------------------------------------------------------------
# Bad requests


_BAD_BODIES: list[tuple[str, Any, str | None]] = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", [1, 2], None),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": {"text": "a"}}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 4096}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "seed": -1}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "seed": "7"}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": 5}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stream": "yes"}, "stream"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stream_options": "x"}, "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 2}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 5}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "echo": True}, "echo"),
    ("/v1/completions", {"model": 5, "prompt": "a"}, "model"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, "messages[0].role"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": "1"},
        "max_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), _BAD_BODIES)
async def test_bad_request_is_400_naming_the_field(path: str, body: Any, param: str | None) -> None:
    backend = FakeBackend()
    async with serve(backend) as (session, base):
        status, _, text = await post(session, f"{base}{path}", body)
    assert status == 400
    error = json.loads(text)["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    if param is not None and not param.startswith("messages["):
        assert param in error["message"]
    assert backend.requests == []


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-pdserve-prefill-mode", "sideways"),
        ("x-request-id", "has space"),
        ("x-request-id", "x" * 200),
    ],
)
async def test_bad_header_is_400_naming_it(header: str, value: str) -> None:
    backend = FakeBackend()
    async with serve(backend) as (session, base):
        status, _, text = await post(
            session,
            f"{base}/v1/completions",
            {"model": MODEL, "prompt": "a"},
            headers={header: value},
        )
    assert status == 400
    assert json.loads(text)["error"]["param"] == header
    assert backend.requests == []


async def test_body_too_large_is_413_with_an_error_body() -> None:
    backend = FakeBackend()
    async with serve(backend, max_body_bytes=1024) as (session, base):
        status, _, text = await post(
            session, f"{base}/v1/completions", {"model": MODEL, "prompt": "a" * 2000}
        )
        ok_status, _, _ = await post(
            session, f"{base}/v1/completions", {"model": MODEL, "prompt": "a" * 500}
        )
    assert status == 413
    assert json.loads(text)["error"]["code"] == "request_too_large"
    assert ok_status == 200 and len(backend.requests) == 1


async def test_unknown_model_is_404() -> None:
    backend = FakeBackend()
    async with serve(backend) as (session, base):
        status, _, text = await post(
            session, f"{base}/v1/chat/completions", {"model": "gpt-9", "messages": MESSAGES}
        )
    assert status == 404
    error = json.loads(text)["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-9" in error["message"]


# ---------------------------------------------------------------------------------------------
# Backend errors


@pytest.mark.parametrize("is_stream", [False, True])
@pytest.mark.parametrize(
    ("error", "status", "param", "retry_after"),
    [
        (
            InvalidArgumentError("too long for this deployment", field="max_tokens"),
            400,
            "max_tokens",
            None,
        ),
        (CapacityError("no KV blocks free", retry_after_s=2.2), 429, None, "3"),
        (UnavailableError("no decode worker"), 503, None, "1"),
        (NotFoundError("no such deployment"), 404, "model", None),
        (RuntimeError("boom with secret prompt text"), 500, None, None),
    ],
)
async def test_backend_error_before_first_chunk_maps_to_status(
    error: Exception, status: int, param: str | None, retry_after: str | None, is_stream: bool
) -> None:
    backend = FakeBackend()
    backend.error_before_first = error
    body = {"model": MODEL, "prompt": "secret prompt text", "stream": is_stream}
    async with serve(backend) as (session, base):
        got_status, headers, text = await post(session, f"{base}/v1/completions", body)
    assert got_status == status
    error_body = json.loads(text)["error"]
    assert error_body["param"] == param
    assert headers.get("Retry-After") == retry_after
    assert headers["x-request-id"] == backend.requests[0].request_id
    if status == 500:
        assert "secret" not in text and error_body["message"] == "internal error"
    else:
        assert error_body["message"] == str(error)
    if status == 404:
        assert error_body["code"] == "model_not_found"


async def test_backend_failure_after_stream_started_sends_an_error_event() -> None:
    backend = FakeBackend()
    backend.error_mid_stream = UnavailableError("decode worker lost")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True}
    async with serve(backend) as (session, base):
        status, _, streamed = await post(session, f"{base}/v1/completions", body)
        plain_status, _, plain = await post(
            session, f"{base}/v1/completions", {**body, "stream": False}
        )
    assert status == 200
    events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    # In-band, the message names the request (the client may send it again by that id).
    request_id = events[0]["id"]
    assert events[-2]["error"]["message"] == f"request {request_id}: decode worker lost"
    assert events[-2]["error"]["type"] == "service_unavailable_error"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == REPLY[:4]
    assert plain_status == 503 and json.loads(plain)["error"]["message"] == "decode worker lost"


async def test_error_finish_reason_is_reported_as_an_error() -> None:
    backend = FakeBackend()
    backend.final_reason = FinishReason.ERROR
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    async with serve(backend) as (session, base):
        status, _, _ = await post(session, f"{base}/v1/chat/completions", body)
        _, _, streamed = await post(
            session, f"{base}/v1/chat/completions", {**body, "stream": True}
        )
    assert status == 500
    events = sse_events(streamed)
    assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"


async def test_client_disconnect_mid_stream_cancels_the_backend() -> None:
    backend = FakeBackend()
    backend.is_hanging_mid_stream = True
    body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True}
    async with serve(backend) as (session, base):
        response = await session.post(
            f"{base}/v1/completions", json=body, headers={"x-request-id": "req-42"}
        )
        first = await response.content.readline()
        assert first.startswith(b"data: ")
        response.close()  # drops the connection while the backend is mid-generation
        await asyncio.wait_for(backend.cancel_called.wait(), timeout=10)
    assert backend.cancelled_ids == ["req-42"]


async def test_client_disconnect_while_waiting_for_a_whole_reply_cancels_the_backend() -> None:
    backend = FakeBackend()
    backend.is_hanging_mid_stream = True
    body = {"model": MODEL, "prompt": "x", "max_tokens": 10}
    async with serve(backend) as (session, base):
        waiting = asyncio.create_task(
            post(session, f"{base}/v1/completions", body, headers={"x-request-id": "req-43"})
        )
        await asyncio.wait_for(backend.hang_started.wait(), timeout=10)
        waiting.cancel()  # the client gives up: its connection closes
        await asyncio.wait_for(backend.cancel_called.wait(), timeout=10)
    assert backend.cancelled_ids == ["req-43"]


# ---------------------------------------------------------------------------------------------
# Headers and auth


async def test_request_id_and_prefill_mode_headers_reach_the_backend() -> None:
    backend = FakeBackend()
    headers = {"x-request-id": "trace-abc-1", "x-pdserve-prefill-mode": "Remote"}
    async with serve(backend) as (session, base):
        status, got, text = await post(
            session, f"{base}/v1/completions", {"model": MODEL, "prompt": "x"}, headers=headers
        )
    assert status == 200
    assert got["x-request-id"] == "trace-abc-1" == json.loads(text)["id"]
    assert backend.requests[0].request_id == "trace-abc-1"
    assert backend.requests[0].prefill_mode == PrefillMode.REMOTE


async def test_api_keys_are_required_and_name_the_tenant() -> None:
    backend = FakeBackend()
    body = {"model": MODEL, "prompt": "x"}
    async with serve(backend, api_keys={"key-a": "tenant-a", "key-b": "tenant-b"}) as (
        session,
        base,
    ):
        missing = await post(session, f"{base}/v1/completions", body)
        wrong = await post(
            session, f"{base}/v1/completions", body, headers={"Authorization": "Bearer key-c"}
        )
        async with session.get(f"{base}/v1/models") as response:
            models_status = response.status
        async with session.get(f"{base}/health") as response:
            health_status = response.status
        good = await post(
            session, f"{base}/v1/completions", body, headers={"Authorization": "Bearer key-b"}
        )
    for status, headers, text in (missing, wrong):
        assert status == 401
        assert json.loads(text)["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"] == "Bearer"
    assert models_status == 401 and health_status == 200
    assert good[0] == 200
    assert [r.tenant for r in backend.requests] == ["tenant-b"]


async def test_without_api_keys_the_tenant_is_empty() -> None:
    backend = FakeBackend()
    async with serve(backend) as (session, base):
        await post(
            session,
            f"{base}/v1/completions",
            {"model": MODEL, "prompt": "x"},
            headers={"Authorization": "Bearer anything"},
        )
    assert backend.requests[0].tenant == ""


# ---------------------------------------------------------------------------------------------
# The real OpenAI Python client


async def test_openai_python_client() -> None:
    openai = pytest.importorskip(
        "openai", reason="the 'openai' package is not installed (optional, client compatibility)"
    )
    backend = FakeBackend(tokens_per_chunk=3)
    async with serve(backend, api_keys={"sk-test": "tenant-x"}) as (_, base):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]

            completion = await client.completions.create(
                model=MODEL, prompt="hello", max_tokens=8, extra_body={"ignore_eos": True}
            )
            assert completion.choices[0].text == REPLY[:8]
            assert completion.usage is not None and completion.usage.total_tokens == 13

            stream = await client.completions.create(
                model=MODEL,
                prompt="hello",
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts = [chunk async for chunk in stream]
            assert "".join(c.choices[0].text for c in parts if c.choices) == REPLY[:8]
            assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 8

            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6
            )
            assert chat.choices[0].message.content == REPLY[:6]
            assert chat.choices[0].finish_reason == "length"

            chat_stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=6,
                stream=True,
            )
            chat_parts = [chunk async for chunk in chat_stream]
            assert chat_parts[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chat_parts) == REPLY[:6]

            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="nope", prompt="x")
            backend.error_mid_stream = UnavailableError("decode worker lost")
            broken = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=10, stream=True
            )
            with pytest.raises(openai.APIError, match="decode worker lost"):
                async for _ in broken:
                    pass
        finally:
            await client.close()
    assert {r.tenant for r in backend.requests} == {"tenant-x"}
