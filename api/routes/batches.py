"""`/v1/batches`: many extraction requests at once, on the `batch` queue; results as JSON Lines."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from api.deps import Owner, State, authenticate
from shared.schemas import BatchRequest, BatchView

router = APIRouter(prefix="/v1/batches", tags=["batches"], dependencies=[Depends(authenticate)])


@router.post("", status_code=202, response_model=BatchView)
def create_batch(body: BatchRequest, state: State, owner: Owner) -> BatchView:
    return state.batches.create(body.items, owner)


@router.get("/{batch_id}", response_model=BatchView)
def get_batch(batch_id: str, state: State, owner: Owner) -> BatchView:
    return state.batches.get(batch_id, owner)


@router.get("/{batch_id}/results")
def batch_results(batch_id: str, state: State, owner: Owner) -> StreamingResponse:
    """One JSON object per line and item, in submission order, echoing `custom_id`."""
    lines = state.batches.results(batch_id, owner)
    first = next(lines, None)  # an unknown batch is a 404 before the response starts

    def encode() -> Iterator[bytes]:
        if first is not None:
            yield first.model_dump_json().encode() + b"\n"
        for line in lines:
            yield line.model_dump_json().encode() + b"\n"

    return StreamingResponse(encode(), media_type="application/x-ndjson")


@router.delete("/{batch_id}", response_model=BatchView)
def cancel_batch(batch_id: str, state: State, owner: Owner) -> BatchView:
    return state.batches.cancel(batch_id, owner)
