"""`/v1/warm`: pre-compute prefixes now, and see what every warm run did."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from api.deps import Owner, State, authenticate
from shared.errors import CacheDisabled
from shared.schemas import WarmRequest
from shared.warm_runs import WarmRunView

router = APIRouter(prefix="/v1/warm", tags=["warm"], dependencies=[Depends(authenticate)])


@router.post("", status_code=202, response_model=WarmRunView)
def warm(body: WarmRequest, state: State, owner: Owner) -> WarmRunView:
    """Queue warm jobs for a prompt, messages, a document or `documents`; returns the run.

    Its jobs report, when finished, the prefix length, how much was cached already and how
    much was computed; poll `GET /v1/warm/runs/{id}`.
    """
    if state.cache is None:
        raise CacheDisabled("the prefix cache is disabled (cache.enabled): nothing to warm")
    items = [state.submitter.warm_item(item) for item in body.items()]
    namespace = owner if state.settings.cache.per_key else None
    return state.warm_runs.start([(item, namespace) for item in items], "manual", owner=owner)


@router.get("/runs", response_model=list[WarmRunView])
def runs(state: State, owner: Owner, limit: int = Query(20, ge=1, le=100)) -> list[WarmRunView]:
    """Recent warm runs, newest first (scheduled, caught up, and requested here)."""
    runs = state.warm_runs.recent(owner, limit)
    return [run.model_copy(update={"jobs": []}) for run in runs]


@router.get("/runs/{run_id}", response_model=WarmRunView)
def run(run_id: str, state: State, owner: Owner) -> WarmRunView:
    return state.warm_runs.get(run_id, owner)
