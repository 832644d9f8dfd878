"""`GET /v1/cache`: what the shared prefix cache holds and how well it serves."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.deps import State, authenticate
from shared.prefix_cache import cache_report
from shared.schemas import CacheReport

router = APIRouter(prefix="/v1/cache", tags=["cache"], dependencies=[Depends(authenticate)])


@router.get("", response_model=CacheReport, response_model_exclude={"dir"})
def cache_stats(state: State) -> CacheReport:
    # Where the cache lives on the host is for its operator (`granary cache stats`), not for
    # every holder of an API key.
    return cache_report(state.settings, state.redis, state.cache)
