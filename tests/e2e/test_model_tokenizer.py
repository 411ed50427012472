"""A deployment served with a real model's tokenizer, end to end: ``sim`` workers started with
``--tokenizer-path`` (a Hugging Face tokenizer folder built here: a small byte-level BPE and a
ChatML template, context limit 512) ship it to their pool managers at registration, and the router
(its own process, no shared filesystem) tokenizes, templates and detokenizes with it.

Cluster: coordinator, prefill and decode pool managers, one router, one prefill and one decode
worker, every one its own ``pdserve serve`` process over real gRPC, hot state in Redis. Tests run
in file order on one cluster."""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import redis
import tokenizers
from helpers.tokenizers import build_tokenizer_folder

from pdserve.api.v1 import router_pb2, router_pb2_grpc

from .conftest import ServiceProcess, run_cli

pytestmark = pytest.mark.timeout(240)

MODEL = "smol-chat"
MAX_MODEL_LEN = 512
MAX_TOKENS = 24
WORKER_ARGS = ["--speedup", "200", "--num-kv-layers", "4", "--max-num-blocks", "2048",
               "--deployment", MODEL]
MESSAGES = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Name the capital of France, s'il vous plaît 🙂"}]


@dataclass(frozen=True, slots=True)
class Stack:
    router: ServiceProcess
    library: tokenizers.Tokenizer
    """The model's tokenizer as the ``tokenizers`` library loads it from the folder."""
    router_command: list[str]
    env: dict[str, str]
    redis_url: str


def chatml(messages: list[dict[str, str]]) -> str:
    """The prompt the folder's ChatML template renders, written out by hand."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _context_of(router: ServiceProcess) -> int:
    with grpc.insecure_channel(router.grpc_address) as channel:
        models = router_pb2_grpc.RouterServiceStub(channel).ListModels(
            router_pb2.ListModelsRequest(), timeout=5).models
    card = next((m for m in models if m.name == MODEL), None)
    if card is None or (card.num_prefill_workers, card.num_decode_workers) != (1, 1):
        return 0
    return card.max_context_tokens


@pytest.fixture(scope="module")
def stack(e2e_redis_url: str, e2e_database_url: str, processes: list[ServiceProcess],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = build_tokenizer_folder(tmp_path_factory.mktemp("model"), max_model_len=MAX_MODEL_LEN)
    join_token = secrets.token_hex(16)
    env = {"PDSERVE_REDIS_URL": e2e_redis_url, "PDSERVE_DATABASE_URL": e2e_database_url,
           "PDSERVE_LOG_FORMAT": "text", "PDSERVE_METRICS_PORT": "-1"}
    pool_env = {**env, "PDSERVE_JOIN_TOKEN": join_token}
    coordinator = ServiceProcess("kv-transfer", ["serve", "kv-transfer"], env)
    pools = [ServiceProcess(f"{role}-pool", ["serve", f"{role}-pool", "--deployments", MODEL],
                            pool_env) for role in ("prefill", "decode")]
    for process in (coordinator, *pools):
        processes.append(process.start())
    for process in (coordinator, *pools):
        process.wait_ready()
    router_command = ["serve", "router", "--coordinator-address", coordinator.grpc_address,
                      "--http-port", "0", "--is-shedding-enabled", "false"]
    router = ServiceProcess("router", router_command, env)
    workers = [ServiceProcess(f"{role}-worker", [
        "serve", "worker", "--role", role, "--pool-address", pool.grpc_address,
        "--coordinator-address", coordinator.grpc_address, "--tokenizer-path", str(folder),
        *WORKER_ARGS], {"PDSERVE_JOIN_TOKEN": join_token, "PDSERVE_LOG_FORMAT": "text"})
        for role, pool in zip(("prefill", "decode"), pools, strict=True)]
    for process in (router, *workers):
        processes.append(process.start())
    for process in (router, *workers):
        process.wait_ready()
    _wait_for_workers(router)
    library = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    yield Stack(router, library, router_command, env, e2e_redis_url)


def _wait_for_workers(router: ServiceProcess) -> None:
    deadline = time.monotonic() + 30.0
    while _context_of(router) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _context_of(router) == MAX_MODEL_LEN, router.describe()


def _client(stack: Stack, router: ServiceProcess | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{(router or stack.router).http_url}/v1", api_key="unused",
                         max_retries=0, timeout=30.0)


def _post(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{stack.router.http_url}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_models_show_the_models_context_limit(stack: Stack) -> None:
    models = _client(stack).models.list().data
    assert [(m.id, m.model_extra["max_model_len"]) for m in models] == [(MODEL, MAX_MODEL_LEN)]


def test_chat_usage_counts_the_rendered_template_with_the_models_tokenizer(stack: Stack) -> None:
    reply = _client(stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, seed=7)
    expected = stack.library.encode(chatml(MESSAGES), add_special_tokens=False).ids
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(expected)
    assert reply.usage.prompt_tokens != len(chatml(MESSAGES).encode())  # not the byte count
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.choices[0].message.content, reply


def test_streamed_and_unstreamed_text_are_equal(stack: Stack) -> None:
    client = _client(stack)
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, seed=7)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, seed=7,
        stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1, "the reply did not stream"
    # Sim tokens are arbitrary ids of this vocabulary, so the text may hold invalid UTF-8 (as
    # U+FFFD); streamed or not, it is the same text.
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    completion = client.completions.create(model=MODEL, prompt="The quick brown fox",
                                           max_tokens=4, temperature=0.0)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(stack.library.encode("The quick brown fox").ids)


def test_a_prompt_over_the_models_context_is_refused_naming_the_field(stack: Stack) -> None:
    long_text = " ".join(f"word{i}" for i in range(600))
    assert len(stack.library.encode(long_text).ids) > MAX_MODEL_LEN
    status, body = _post(stack, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": long_text}], "max_tokens": 4})
    assert status == 400, body
    assert body["error"]["param"] == "messages" and str(MAX_MODEL_LEN) in body["error"]["message"]
    status, body = _post(stack, "/v1/completions",
                         {"model": MODEL, "prompt": long_text, "max_tokens": 4})
    assert (status, body["error"]["param"]) == (400, "prompt"), body
    with grpc.insecure_channel(stack.router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(model=MODEL, prompt=long_text)
        request.sampling.max_tokens = 4
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in (info.value.details() or "")


def test_grpc_text_and_counts_are_the_models(stack: Stack) -> None:
    prompt = "Tell me about disaggregated serving, s'il vous plaît"
    with grpc.insecure_channel(stack.router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(model=MODEL, prompt=prompt, include_text=True)
        request.sampling.max_tokens = MAX_TOKENS
        messages = list(stub.Generate(request, timeout=30))
    token_ids = [t for m in messages for t in m.token_ids]
    assert messages[-1].usage.prompt_tokens == len(stack.library.encode(prompt).ids)
    assert "".join(m.text for m in messages) == stack.library.decode(token_ids)


def test_a_worker_with_a_bad_tokenizer_folder_stops_naming_it(stack: Stack,
                                                              tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = run_cli(["serve", "worker", "--role", "decode", "--pool-address", "127.0.0.1:1",
                      "--coordinator-address", "127.0.0.1:1", "--join-token", "x",
                      "--tokenizer-path", str(missing)])
    assert result.returncode != 0
    assert str(missing) in result.stderr, result.stderr


def test_after_a_store_loss_the_workers_send_their_tokenizer_again(
    stack: Stack, processes: list[ServiceProcess],
) -> None:
    """Everything in Redis is lost; the workers are re-adopted by their next heartbeats and asked
    for their bundles, so a router started afterwards (which has never seen the tokenizer) loads
    it from the store and counts with it."""
    client = redis.Redis.from_url(stack.redis_url)
    try:
        client.flushdb()
    finally:
        client.close()
    late = ServiceProcess("late-router", stack.router_command, stack.env)
    processes.append(late.start())
    late.wait_ready()
    _wait_for_workers(late)
    reply = None
    for _ in range(50):  # the bundle is back one heartbeat after the re-adoption
        try:
            reply = _client(stack, late).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0.0)
            break
        except openai.InternalServerError:  # 503: the tokenizer is not in the store yet
            time.sleep(0.2)
    assert reply is not None and reply.usage is not None, late.describe()
    expected = stack.library.encode(chatml(MESSAGES), add_special_tokens=False).ids
    assert reply.usage.prompt_tokens == len(expected)
