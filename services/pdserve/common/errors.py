"""One error hierarchy for pdserve, mapped to gRPC status codes in exactly one place.

Services raise these; the gRPC server bootstrap turns them into statuses (see
``pdserve.common.grpc_server``), and clients turn statuses back into them. Anything that is not
a ``PdserveError`` becomes ``INTERNAL`` with a generic message, and its traceback is logged.
"""

from __future__ import annotations

import grpc


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidArgumentError(PdserveError):
    """The caller sent something malformed; ``field`` names it. Never retry unchanged."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(PdserveError):
    """A named entity (worker, ticket, deployment) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(PdserveError):
    """An entity with this identity exists already."""

    code = grpc.StatusCode.ALREADY_EXISTS


class CapacityError(PdserveError):
    """No capacity right now; retry after ``retry_after_s``."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, field: str | None = None
    ) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s


class IllegalTransitionError(PdserveError):
    """A state machine refused a transition (ticket, worker lifecycle)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleTokenError(PdserveError):
    """A call carried a fencing token that no longer owns what it names (lease lost)."""

    code = grpc.StatusCode.ABORTED


class UnavailableError(PdserveError):
    """No healthy worker or dependency can take the call now; safe to retry elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(PdserveError):
    """Missing or wrong credentials (join token, API key)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(PdserveError):
    """Credentials are valid but do not allow this call."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineError(PdserveError):
    """The call's deadline passed before it finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ConfigError(PdserveError):
    """A setting is malformed; the message names the variable and the expected form."""

    code = grpc.StatusCode.INVALID_ARGUMENT


_CODE_TO_ERROR: dict[grpc.StatusCode, type[PdserveError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        CapacityError,
        IllegalTransitionError,
        StaleTokenError,
        UnavailableError,
        UnauthenticatedError,
        PermissionDeniedError,
        DeadlineError,
    )
}


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map any exception to the (code, message) a client sees. Unknown errors say nothing inside."""
    if isinstance(error, PdserveError):
        return error.code, error.message
    return grpc.StatusCode.INTERNAL, "internal error"


_CODE_OF_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def code_of_number(number: int) -> grpc.StatusCode:
    """The status code a number on the wire stands for (UNKNOWN for one gRPC does not define)."""
    return _CODE_OF_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_from_status(code: grpc.StatusCode, message: str) -> PdserveError:
    """The client-side inverse of ``status_for``."""
    cls = _CODE_TO_ERROR.get(code, PdserveError)
    return cls(message)
