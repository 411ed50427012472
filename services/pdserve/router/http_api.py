"""The router's OpenAI-compatible HTTP front end (aiohttp): an adapter only, no policy.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``GET /health``. Standard clients (the OpenAI SDK, aiperf,
guidellm) work unmodified: same request fields, same response and SSE chunk shapes, same error
body ``{"error": {"message", "type", "param", "code"}}``.

The handlers authenticate (``pdserve.common.auth.bearer_tenant``, against the same API key file
as gRPC), validate the request (``router.http_requests``: the backend takes token ids), run the
generation as text (``router.http_generation``, which matches stop strings on the decoded text),
and answer with OpenAI bodies or server-sent events (``router.http_responses``); every error
goes through one mapping to an HTTP status (``router.http_errors``). Errors raised before the
first chunk become a plain HTTP error, even for ``stream: true``, because the first chunk is
awaited before the SSE response starts; a failure after that ends the stream with one
``data: {"error": ...}`` event whose message names the request id, and ``data: [DONE]``, never
a silent cut. A decode worker's death mid-stream is not such a failure: the core fails the
request over (``router.failover``) and the stream goes on. This router's own death cuts the
connection (nothing can be sent from a dead process); the client has the request id from the
``x-request-id`` response header and may send the request again.

Extensions: ``ignore_eos`` (as in vLLM; default false), the ``x-pdserve-prefill-mode`` request
header (``auto|remote|local``), ``x-request-id`` (taken from the request or generated, and always
returned).
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from contextlib import aclosing
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import propagate

from pdserve.common.credentials import KeyTable, bearer_tenant
from pdserve.common.errors import ConfigError, NotFoundError
from pdserve.router.http_errors import ApiError, error_for, too_large
from pdserve.router.http_generation import GenerationRun
from pdserve.router.http_requests import (
    REQUEST_ID_HEADER,
    ParsedRequest,
    RequestContext,
    parse_request,
    prefill_mode_of,
    request_id_of,
    requested_model,
)
from pdserve.router.http_responses import (
    SSE_DONE,
    choice_object,
    envelope,
    model_object,
    sse_event,
)
from pdserve.router.tokenizer_registry import TokenizerSource
from pdserve.router.types import GenerationBackend

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""Largest accepted request body; a 128K-token prompt as JSON token ids is about 1 MB."""



class _OpenAiHandlers:
    """The route handlers; every /v1 handler authenticates first and answers errors in-shape."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizers: TokenizerSource,
        api_keys: KeyTable | None,
        max_body_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self._backend = backend
        self._tokenizers = tokenizers
        self._api_keys = api_keys
        self._max_body_bytes = max_body_bytes
        self._clock = clock

    # -- auth and headers

    def _tenant(self, request: web.Request) -> str:
        """The caller's tenant; ``""`` when no keys are configured. Raises
        ``UnauthenticatedError`` (401)."""
        if self._api_keys is None:
            return ""
        return bearer_tenant(request.headers.get("Authorization", ""), self._api_keys)

    def _context(self, request: web.Request, request_id: str) -> RequestContext:
        mode = prefill_mode_of(request.headers)
        return RequestContext(request_id, self._tenant(request), mode)

    async def _read_json(self, request: web.Request) -> Mapping[str, Any]:
        """The body as a JSON object. Raises ``ApiError`` 413 (too large) or 400 (not an object)."""
        max_bytes = self._max_body_bytes
        if request.content_length is not None and request.content_length > max_bytes:
            raise too_large(max_bytes)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(max_bytes) from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ApiError(400, f"The request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object")
        return body

    # -- endpoints

    async def health(self, request: web.Request) -> web.Response:
        try:
            num_models = len(self._backend.list_models())
        except Exception:
            logger.exception("health: listing models failed")
            num_models = 0
        status = 200 if num_models > 0 else 503
        return web.json_response(
            {"status": "ok" if num_models else "unavailable", "num_models": num_models},
            status=status,
        )

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            self._tenant(request)
            cards = self._backend.list_models()
        except Exception as error:  # mapped to an HTTP error in one place
            return error_for(error, "").to_response()
        return web.json_response({"object": "list", "data": [model_object(c) for c in cards]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        try:
            self._tenant(request)
            cards = [c for c in self._backend.list_models() if c.name == name]
            if not cards:
                raise NotFoundError(f"The model '{name}' does not exist", field="model")
        except Exception as error:
            return error_for(error, "").to_response()
        return web.json_response(model_object(cards[0]))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=True)

    async def _generate(self, request: web.Request, *, is_chat: bool) -> web.StreamResponse:
        """One generation. A W3C ``traceparent`` (and ``tracestate``) header makes the router's
        spans children of the caller's trace; without one, the router starts a trace."""
        if "traceparent" not in request.headers:
            return await self._generate_in_context(request, is_chat=is_chat)
        attached = otel_context.attach(propagate.extract(request.headers))
        try:
            return await self._generate_in_context(request, is_chat=is_chat)
        finally:
            otel_context.detach(attached)

    async def _generate_in_context(self, request: web.Request, *,
                                   is_chat: bool) -> web.StreamResponse:
        request_id = ""
        try:
            request_id = request_id_of(request.headers, "chatcmpl" if is_chat else "cmpl")
            context = self._context(request, request_id)
            body = await self._read_json(request)
            card = requested_model(body, self._backend.list_models())
            tokenizer = await self._tokenizers.for_model(card.name)
            parsed = parse_request(
                body, is_chat=is_chat, card=card, tokenizer=tokenizer, context=context)
        except Exception as error:
            return error_for(error, request_id).to_response(request_id)
        run = GenerationRun(self._backend, parsed.generation, tokenizer)
        try:
            await run.start()
            if parsed.is_stream:
                return await self._stream(request, parsed, run)
            return await self._complete(parsed, run)
        except Exception as error:
            return error_for(error, request_id).to_response(request_id)
        finally:
            await run.close()

    async def _complete(self, parsed: ParsedRequest, run: GenerationRun) -> web.Response:
        texts: list[str] = []
        finish_reason: str | None = None
        async with aclosing(run.steps()) as steps:
            async for step in steps:
                texts.append(step.text)
                finish_reason = step.finish_reason
        body = envelope(parsed, int(self._clock()), is_chunk=False)
        body["choices"] = [choice_object(parsed, "".join(texts), finish_reason, is_chunk=False)]
        body["usage"] = run.usage()
        return web.json_response(
            body,
            headers={REQUEST_ID_HEADER: parsed.generation.request_id},
            dumps=lambda obj: json.dumps(obj, ensure_ascii=False),
        )

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, run: GenerationRun
    ) -> web.StreamResponse:
        request_id = parsed.generation.request_id
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                REQUEST_ID_HEADER: request_id,
            }
        )
        await response.prepare(request)
        chunk_envelope = envelope(parsed, int(self._clock()), is_chunk=True)
        usage_field = {"usage": None} if parsed.is_usage_streamed else {}
        # The last events (the finishing chunk, usage, an error, [DONE]) leave with the stream's
        # end in one write: nothing follows them, so holding them back delays nothing.
        tail: list[bytes] = []
        try:
            is_first = parsed.is_chat
            async with aclosing(run.steps()) as steps:
                async for step in steps:
                    if not (step.text or step.finish_reason or is_first):
                        continue
                    choice = choice_object(
                        parsed, step.text, step.finish_reason, is_chunk=True, is_first=is_first
                    )
                    event = sse_event({**chunk_envelope, "choices": [choice], **usage_field})
                    if step.finish_reason:
                        tail.append(event)
                    else:
                        await response.write(event)
                    is_first = False
            if parsed.is_usage_streamed:
                tail.append(sse_event({**chunk_envelope, "choices": [], "usage": run.usage()}))
        except ConnectionResetError:
            logger.info("request %s: client went away during the stream", request_id)
            return response
        except Exception as error:  # the status line is sent: report in-band
            api_error = error_for(error, request_id)
            if request_id not in api_error.message:  # the client may resubmit by it
                api_error.message = f"request {request_id}: {api_error.message}"
            tail.append(sse_event(api_error.body()))
        tail.append(SSE_DONE)
        try:
            await response.write_eof(b"".join(tail))
        except ConnectionResetError:
            logger.info("request %s: client went away at the end of the stream", request_id)
        return response


@web.middleware
async def _openai_error_bodies(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (no such route, wrong method) as OpenAI error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        headers = {k: v for k, v in error.headers.items() if k.lower() == "allow"}
        error_type = "invalid_request_error" if error.status < 500 else "server_error"
        message = f"{error.reason}: {request.method} {request.path}"
        return ApiError(error.status, message, error_type, headers=headers).to_response()


def create_app(
    backend: GenerationBackend,
    tokenizers: TokenizerSource,
    *,
    api_keys: Mapping[str, str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    clock: Callable[[], float] = time.time,
) -> web.Application:
    """The OpenAI-compatible application in front of ``backend``.

    ``tokenizers`` gives each served model's tokenizer: prompt ids, the chat template, ``usage``
    and streamed text come from it. ``api_keys`` maps API key -> tenant (a
    ``pdserve.common.credentials.KeyFile`` follows edits to its file; any other mapping is taken
    as it is now): when given (even empty), every ``/v1`` call needs
    ``Authorization: Bearer <key>``; ``/health`` never does. ``max_body_bytes`` bounds request
    bodies (413 beyond). ``clock`` gives wall-clock seconds for ``created``.
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    keys = api_keys if api_keys is None or isinstance(api_keys, KeyTable) else KeyTable(api_keys)
    handlers = _OpenAiHandlers(backend, tokenizers, keys, max_body_bytes, clock)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_openai_error_bodies])
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model_id:.+}", handlers.get_model)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    return app


def server_ssl_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """The HTTPS context of the HTTP API: ``cert_path`` (PEM certificate chain) and its key.
    TLS 1.2 at least; clients are not asked for certificates (they present API keys). Raises
    ``ConfigError`` naming the setting when a file cannot be read or does not fit."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"http_tls_cert_path: cannot load {cert_path} with {key_path}: {exc}",
                          field="http_tls_cert_path") from None
    return context


async def start_http_server(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (port 0 = any free port), over HTTPS with
    ``ssl_context`` (``server_ssl_context``) when given; returns the runner and the port.

    Handlers are cancelled when their client disconnects, which cancels the backend request.
    Stop with ``await runner.cleanup()``.
    """
    # No access-log line per request at INFO (a measurable share of a request's CPU): the
    # access log is written only when its logger is enabled for DEBUG.
    access_log = logging.getLogger("aiohttp.access")
    is_logged = access_log.isEnabledFor(logging.DEBUG)
    runner = web.AppRunner(app, handler_cancellation=True,
                           access_log=access_log if is_logged else None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        bound_port = int(runner.addresses[0][1])
    except BaseException:
        await runner.cleanup()
        raise
    return runner, bound_port
