"""Every error the API can answer, mapped to an HTTP status in one place.

Shape: `{"error": {"type", "message", "field"}}`. Validation problems are 400s that name the
field; nothing a client sends can produce a 500.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from shared.errors import GranaryError
from shared.log_limit import RateLimitedLog
from shared.redis_outage import describe

log = logging.getLogger(__name__)
# Every request fails alike while Redis is down: one line per interval says so.
_outage = RateLimitedLog(log)


def error_body(error_type: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"error": {"type": error_type, "message": message, "field": field}}


_LOCATIONS = ("body", "query", "path", "header", "cookie")
# Pydantic names the member of a union a value failed against ("str", "list[str]",
# "function-after[_encodable(), str]"): a type, not a field the client could look for.
_TYPE_NAMES = {"str", "int", "float", "bool", "none", "list", "dict"}


def _field(loc: tuple[Any, ...]) -> str | None:
    """The field as the client wrote it: `messages.0.content`, `path` (an unknown field)."""
    parts = list(loc[1:] if loc and loc[0] in _LOCATIONS else loc)
    named = [str(p) for p in parts if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    return ".".join(named) or None


def response_for(exc: GranaryError) -> JSONResponse:
    """The one mapping of granary's errors to HTTP, also used before FastAPI sees a request."""
    body = error_body(exc.error_type, exc.message, exc.field)
    return JSONResponse(body, exc.status_code, headers=exc.headers or None)


async def _granary_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GranaryError)
    return response_for(exc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    # RequestValidationError: the body as received; ValidationError: a model built from it
    # (an OpenAI request turned into a job request).
    assert isinstance(exc, RequestValidationError | ValidationError)
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return JSONResponse(error_body("invalid_request", "request body is not valid JSON"), 400)
    field = _field(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    if field:
        message = f"{field}: {message}"
    return JSONResponse(error_body("invalid_request", message, field), 400)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error_type = "not_found" if exc.status_code == 404 else "http_error"
    return JSONResponse(error_body(error_type, str(exc.detail)), exc.status_code)


# Seconds a client is asked to wait before trying again while Redis is unavailable: as long as
# the longest pause between the API's own reconnect attempts (shared/redis_outage.py).
REDIS_RETRY_AFTER_S = 2


async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
    _outage.failure("Redis unavailable (%s): answering 503", describe(exc))
    body = error_body("unavailable", "the queue (Redis) is unavailable")
    return JSONResponse(body, 503, headers={"Retry-After": str(REDIS_RETRY_AFTER_S)})


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Every known failure has its own type above; reaching here is a bug, logged in full.
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body("internal_error", "internal error"), 500)


def install(app: FastAPI) -> None:
    app.add_exception_handler(GranaryError, _granary_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(redis.ConnectionError, _redis_down)
    app.add_exception_handler(redis.TimeoutError, _redis_down)
    app.add_exception_handler(Exception, _unexpected)
