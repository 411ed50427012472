"""``pdserve up`` as a user runs it: the one-machine stack in a subprocess, the OpenAI Python client
against its HTTP address, ``pdserve generate`` and ``pdserve status`` against its gRPC address,
and a clean stop on SIGTERM. Tests run in file order; the last one stops the stack."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .conftest import ServiceProcess, run_cli

pytestmark = pytest.mark.timeout(180)

MODEL = "llama-3.1-8b"
MAX_TOKENS = 8
STOP_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def stack(processes: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    up = ServiceProcess("pdserve-up", ["up", "--grpc-port", "0", "--http-port", "0",
                                       "--speedup", "100"])
    processes.append(up.start())
    up.wait_ready()
    assert up.grpc_address and up.http_url, f"no addresses announced\n{up.describe()}"
    yield up


def _client(stack: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                         timeout=30.0)


def test_openai_client_streams_a_completion(stack: ServiceProcess) -> None:
    stream = _client(stack).completions.create(
        model=MODEL, prompt="The quick brown fox jumps over the lazy dog", max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    choices = [c.choices[0] for c in chunks if c.choices]
    text = "".join(choice.text for choice in choices)
    assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
    assert len(choices) > 1, "the completion did not stream"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert len(text) == MAX_TOKENS, repr(text)  # sim tokens are single printable bytes


def test_openai_client_streams_a_chat_completion(stack: ServiceProcess) -> None:
    stream = _client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Say something."}],
        max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    choices = [c.choices[0] for c in chunks if c.choices]
    text = "".join(choice.delta.content or "" for choice in choices)
    assert choices[0].delta.role == "assistant"
    assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens > len("Say something.")  # the chat template's tokens
    assert len(text) == MAX_TOKENS, repr(text)


def test_generate_and_status_commands(stack: ServiceProcess) -> None:
    prompt = "Tell me about disaggregated prefill " * 8  # 288 tokens: prefilled remotely
    generated = run_cli(["generate", prompt, "--address", stack.grpc_address,
                         "--max-tokens", str(MAX_TOKENS)])
    assert generated.returncode == 0, generated.stderr
    assert len(generated.stdout.rstrip("\n")) == MAX_TOKENS, repr(generated.stdout)
    assert f"{len(prompt)} prompt + {MAX_TOKENS} tokens" in generated.stderr, generated.stderr
    assert "prefill p-" in generated.stderr, generated.stderr

    status = run_cli(["status", "--address", stack.grpc_address])
    assert status.returncode == 0, status.stderr
    rows = [line.split() for line in status.stdout.splitlines() if line.startswith(MODEL)]
    roles = sorted(row[1] for row in rows)
    assert roles == ["decode", "decode", "prefill", "prefill"], status.stdout
    assert all(row[3] == "ready" for row in rows), status.stdout
    tickets = [line for line in status.stdout.splitlines() if line.startswith("tickets:")]
    assert tickets and "done" in tickets[0], status.stdout  # the requests of the tests above
    ledger = [line.split() for line in status.stdout.splitlines() if line.startswith("d-")]
    assert len(ledger) == 2 and all(row[1] == row[4] for row in ledger), status.stdout


def test_sigterm_stops_the_stack_and_its_workers(stack: ServiceProcess) -> None:
    status = run_cli(["status", "--address", stack.grpc_address])
    worker_addresses = [line.split()[4] for line in status.stdout.splitlines()
                        if line.startswith(MODEL)]
    assert len(worker_addresses) == 4, status.stdout
    assert len(stack.descendants()) >= 4, "the provisioned workers are not child processes"
    code = stack.stop(STOP_TIMEOUT_S)
    assert code == 0, f"exit {code} (None: killed after {STOP_TIMEOUT_S}s)\n{stack.describe()}"
    assert not stack.orphans, f"worker processes {stack.orphans} outlived pdserve up"
    for address in [stack.grpc_address, *worker_addresses]:
        host, port = address.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=2.0).close()


@pytest.mark.parametrize("command", [
    ["up", "--engine", "vllm", "--grpc-port", "0", "--http-port", "-1"],
    ["serve", "worker", "--engine", "vllm", "--role", "decode", "--pool-address",
     "127.0.0.1:1", "--coordinator-address", "127.0.0.1:1"],
])
@pytest.mark.parametrize("folder", ["missing", "broken"])
def test_a_bad_model_folder_is_one_error_naming_it(command: list[str], folder: str,
                                                   tmp_path: Path) -> None:
    """Before anything starts (no vLLM needed to say so)."""
    path = tmp_path / folder
    if folder == "broken":
        path.mkdir()
        (path / "config.json").write_text("{not json")
    result = run_cli([*command, "--model-path", str(path)], {"PDSERVE_JOIN_TOKEN": "t" * 32})
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert f"model path {path}" in line

