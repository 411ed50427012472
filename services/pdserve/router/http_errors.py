"""HTTP errors of the OpenAI front end: the error body ``{"error": {"message", "type", "param",
"code"}}`` and the one mapping from ``PdserveError`` subclasses to HTTP statuses."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from pdserve.common.errors import (
    CapacityError,
    DeadlineError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from pdserve.router.http_requests import REQUEST_ID_HEADER

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with an OpenAI error body; ``headers`` carries e.g. ``Retry-After``."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self, request_id: str | None = None) -> web.Response:
        headers = dict(self.headers)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        return web.json_response(self.body(), status=self.status, headers=headers)


def _retry_after_headers(retry_after_s: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (rounded up), and the OpenAI SDK's ``retry-after-ms``."""
    retry_after_s = max(0.0, retry_after_s)
    return {
        "Retry-After": str(math.ceil(retry_after_s)),
        "retry-after-ms": str(math.ceil(retry_after_s * 1000)),
    }


def error_for(error: BaseException, request_id: str) -> ApiError:
    """The one mapping from exceptions to HTTP errors. Unknown errors say nothing inside."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, InvalidArgumentError):
        return ApiError(400, error.message, param=error.field)
    if isinstance(error, NotFoundError):
        return ApiError(404, error.message, param=error.field or "model", code="model_not_found")
    if isinstance(error, CapacityError):
        return ApiError(
            429,
            error.message,
            error_type="rate_limit_error",
            param=error.field,
            code="rate_limit_exceeded",
            headers=_retry_after_headers(error.retry_after_s),
        )
    if isinstance(error, UnavailableError):
        retry_after_s = float(getattr(error, "retry_after_s", 1.0))
        return ApiError(
            503,
            error.message,
            error_type="service_unavailable_error",
            param=error.field,
            code="service_unavailable",
            headers=_retry_after_headers(retry_after_s),
        )
    if isinstance(error, UnauthenticatedError):
        return ApiError(401, error.message, "authentication_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
    if isinstance(error, PermissionDeniedError):
        return ApiError(403, error.message, "permission_error", code="permission_denied")
    if isinstance(error, DeadlineError):
        return ApiError(504, error.message, "timeout_error", code="timeout")
    logger.error("request %s failed", request_id, exc_info=error)
    return ApiError(500, "internal error", "server_error", code="internal_error")


def too_large(max_bytes: int) -> ApiError:
    """413: the body is over ``max_bytes``."""
    return ApiError(
        413, f"The request body is larger than {max_bytes} bytes", code="request_too_large"
    )
