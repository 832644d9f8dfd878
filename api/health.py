"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from rq import Worker

from api.state import state_of
from shared.errors import ServiceUnavailable

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(request: Request) -> JSONResponse:
    redis = state_of(request).redis
    redis.ping()
    workers = Worker.count(connection=redis)
    if workers == 0:
        raise ServiceUnavailable("no live worker is registered")
    return JSONResponse({"status": "ready", "workers": workers})
