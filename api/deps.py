"""What a route declares to get the app's state, its caller and the headers it honours.

Routes name these types in their signatures; FastAPI resolves each once per request, so a
router that authenticates and a route that asks for `Owner` check the key once.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from api import auth
from api.state import AppState
from shared.errors import InvalidRequest

MAX_IDEMPOTENCY_KEY_CHARS = 255


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.granary
    return state


State = Annotated[AppState, Depends(app_state)]


def authenticate(request: Request, state: State) -> str | None:
    """The caller's owner id (None when no keys are set); 401 without a configured key.

    api/guard.py has already refused a bad key before the body was read; this is what gives
    a route its owner (and keeps a router that is mounted without the guard closed)."""
    return auth.caller(request.headers.get("authorization", ""), state.settings.api_keys)


Owner = Annotated[str | None, Depends(authenticate)]


def idempotency_key(
    idempotency_key: Annotated[str | None, Header()] = None,
) -> str | None:
    if idempotency_key is not None and not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise InvalidRequest("Idempotency-Key must be 1-255 characters", field="Idempotency-Key")
    return idempotency_key


IdempotencyKey = Annotated[str | None, Depends(idempotency_key)]
