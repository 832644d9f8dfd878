"""`/v1/extractions`: many questions about one document, answered as one job.

The job is read, streamed and cancelled through `/v1/jobs/{id}`: its result is `extraction`
(answers by question id), and its SSE stream tags each token with its question and sends one
`answer` event as each answer completes.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.deps import IdempotencyKey, Owner, State, authenticate
from api.routes.jobs import submit_interactive
from shared.schemas import ExtractionRequest, JobView

router = APIRouter(
    prefix="/v1/extractions", tags=["extractions"], dependencies=[Depends(authenticate)]
)


@router.post("", status_code=202, response_model=JobView)
def create_extraction(
    body: ExtractionRequest, state: State, owner: Owner, idempotency_key: IdempotencyKey
) -> JobView:
    return submit_interactive(state, body, owner, idempotency_key)
