"""A trivial OpenAI-compatible backend for ``bench/peers.py``: answers ``/v1/completions`` and
``/v1/chat/completions`` at once with ``max_tokens`` tokens (streamed as SSE or whole), with the
usage counts a real server reports. No model, no tokenizer: the floor every system is held to.

    python bench/_peers_backend.py PORT [MODEL]

Prints ``ready`` once it listens on 127.0.0.1:PORT.
"""

from __future__ import annotations

import json
import sys
import time

from aiohttp import web


def _num_prompt_tokens(body: dict[str, object]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt.split())
    messages = body.get("messages")
    return sum(len(str(m.get("content", "")).split()) for m in messages
               if isinstance(m, dict)) if isinstance(messages, list) else 0


def make_app(model: str) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        is_chat = request.path.endswith("/chat/completions")
        num_tokens = max(1, int(body.get("max_tokens") or 8))
        usage = {"prompt_tokens": _num_prompt_tokens(body), "completion_tokens": num_tokens,
                 "total_tokens": _num_prompt_tokens(body) + num_tokens}
        created = int(time.time())
        kind = "chat.completion" if is_chat else "text_completion"
        if not body.get("stream"):
            choice: dict[str, object] = {"index": 0, "finish_reason": "length"}
            if is_chat:
                choice["message"] = {"role": "assistant", "content": " x" * num_tokens}
            else:
                choice["text"] = " x" * num_tokens
            return web.json_response({"id": "cmpl-fake", "object": kind, "created": created,
                                      "model": model, "choices": [choice], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(num_tokens):
            is_last = index == num_tokens - 1
            choice = {"index": 0, "finish_reason": "length" if is_last else None}
            if is_chat:
                choice["delta"] = {"content": " x"}
            else:
                choice["text"] = " x"
            chunk: dict[str, object] = {"id": "cmpl-fake", "object": kind + ".chunk",
                                        "created": created, "model": model, "choices": [choice]}
            if is_last:
                chunk["usage"] = usage
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model, "object": "model", "owned_by": "bench"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    port = int(sys.argv[1])
    model = sys.argv[2] if len(sys.argv) > 2 else "fake"
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    print("ready", flush=True)
    web.run_app(make_app(model), host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    main()
