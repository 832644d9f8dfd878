"""`GET /v1/cache`: what the shared prefix cache holds and how well it serves."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api.auth import authenticate
from api.state import state_of
from shared.cache_counters import cache_report
from shared.schemas import CacheReport

router = APIRouter(prefix="/v1/cache", tags=["cache"], dependencies=[Depends(authenticate)])


@router.get("", response_model=CacheReport)
def cache_stats(request: Request) -> CacheReport:
    state = state_of(request)
    return cache_report(state.settings, state.redis, state.cache)
