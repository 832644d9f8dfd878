"""The one exception tree. Each error knows its HTTP status; the API maps them in one place."""

from __future__ import annotations


class GranaryError(Exception):
    status_code = 500
    error_type = "internal_error"
    # Response headers the status calls for (401: how to authenticate).
    headers: dict[str, str] = {}  # noqa: RUF012 (never mutated: subclasses replace it)

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequest(GranaryError):
    status_code = 400
    error_type = "invalid_request"


class ContextOverflow(InvalidRequest):
    error_type = "context_length_exceeded"


class Unauthorized(GranaryError):
    status_code = 401
    error_type = "invalid_api_key"
    headers = {"WWW-Authenticate": "Bearer"}  # noqa: RUF012


class JobNotFound(GranaryError):
    status_code = 404
    error_type = "not_found"


class PayloadTooLarge(GranaryError):
    status_code = 413
    error_type = "payload_too_large"


class UnsupportedMediaType(GranaryError):
    status_code = 415
    error_type = "unsupported_media_type"


class IdempotencyConflict(GranaryError):
    """An Idempotency-Key reused with a different request body."""

    status_code = 422
    error_type = "idempotency_conflict"


class Conflict(GranaryError):
    status_code = 409
    error_type = "conflict"


class CacheDisabled(Conflict):
    """Warming needs the prefix cache; it is switched off."""


class ServiceUnavailable(GranaryError):
    status_code = 503
    error_type = "unavailable"


class ModelUnavailable(GranaryError):
    """The model file is missing or unreadable; the message says how to fix it."""

    status_code = 503
    error_type = "model_unavailable"


class TrimRejected(GranaryError):
    """`granary model trim` found its copy would lose text or was asked the impossible."""

    error_type = "trim_rejected"
