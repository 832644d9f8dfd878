"""What every request passes before FastAPI reads its body: the key, the content type, the size.

FastAPI parses a JSON body before it resolves dependencies, so checks made there come after a
client could make the API read, parse and hold any body it likes. This ASGI middleware answers
401 (no or wrong key), 415 (a body that is not `application/json`) and 413 (a body over
`api.max_body_bytes`, by its Content-Length or, when it has none, as it arrives) first.

The content type stays strict on purpose: a web page may POST a form or plain text to any
address without a CORS preflight, so accepting JSON under those types would let any page a
user visits submit jobs to a granary on their machine.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import auth
from api.errors import response_for
from shared.errors import GranaryError, PayloadTooLarge, UnsupportedMediaType
from shared.settings import Settings

_DOC_PATHS = ("/docs", "/redoc", "/openapi.json")
_BODY_METHODS = ("POST", "PUT", "PATCH")


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self._app = app
        self._keys = settings.api_keys
        self._open_docs = settings.api.open_docs
        self._max_body = settings.api.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        try:
            self._check(scope)
        except GranaryError as exc:
            await response_for(exc)(scope, receive, send)
            return
        if scope["method"] not in _BODY_METHODS:
            await self._app(scope, receive, send)
            return
        await self._with_bounded_body(scope, receive, send)

    def _check(self, scope: Scope) -> None:
        headers = Headers(scope=scope)
        path: str = scope["path"]
        if path.startswith("/v1/") or (not self._open_docs and path.startswith(_DOC_PATHS)):
            auth.caller(headers.get("authorization", ""), self._keys)
        if scope["method"] not in _BODY_METHODS:
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            raise self._too_large()
        has_body = length is None or length != "0"
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if has_body and media_type != "application/json":
            raise UnsupportedMediaType(
                f"the body must be JSON sent with 'Content-Type: application/json' "
                f"(got {media_type or 'no content type'!r})",
                field="Content-Type",
            )

    async def _with_bounded_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body, counting (a chunked upload says no length up front), then pass it on.

        FastAPI reads a JSON body whole before parsing it, so holding it here costs nothing
        more; a body over the limit is refused without the app seeing any of it.
        """
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self._app(scope, _replay(message, receive), send)  # client went away
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self._max_body:
                await response_for(self._too_large())(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self._app(scope, _replay(body, receive), send)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body is over {self._max_body} bytes (api.max_body_bytes)"
        )


def _replay(first: Message, then: Receive) -> Receive:
    """A receive() that gives `first`, then whatever `then` gives (a disconnect, in time)."""
    given = False

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return first
        return await then()

    return receive
