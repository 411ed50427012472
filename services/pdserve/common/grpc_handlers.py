"""Rewrapping a gRPC method handler: how a server interceptor that acts inside a call (the error
mapping of ``pdserve.common.grpc_server``, the authorization of ``pdserve.common.auth``) puts
code around the servicer's behaviour while keeping the handler's streaming kind and serializers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]
"""A handler's behaviour: ``(request or request iterator, context)`` -> response(s)."""

Deserializer = Callable[[bytes], Any] | None
"""A handler's request deserializer (None: the behaviour gets the raw bytes)."""

_HANDLER_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}
"""(request streaming, response streaming) -> the handler's behaviour attribute and factory."""


def _same(deserializer: Deserializer) -> Deserializer:
    return deserializer


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    wrap_behavior: Callable[[Behavior], Behavior],
    wrap_deserializer: Callable[[Deserializer], Deserializer] = _same,
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by ``wrap_behavior(behaviour)`` and its request
    deserializer by ``wrap_deserializer(deserializer)``; same streaming kind, same response
    serializer. A handler without a behaviour of its kind is returned as it is."""
    attr, factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, attr)
    if behavior is None:
        return handler
    return factory(
        wrap_behavior(behavior),
        request_deserializer=wrap_deserializer(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )
