"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from rq import Worker

from api.deps import State
from shared.errors import ServiceUnavailable

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(state: State) -> JSONResponse:
    redis = state.redis
    redis.ping()
    workers = Worker.count(connection=redis)
    if workers == 0:
        raise ServiceUnavailable("no live worker is registered")
    return JSONResponse({"status": "ready", "workers": workers})
