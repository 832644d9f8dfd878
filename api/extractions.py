"""`/v1/extractions`: many questions about one document, answered as one job.

The job is read, streamed and cancelled through `/v1/jobs/{id}`: its result is `extraction`
(answers by question id), and its SSE stream tags each token with its question and sends one
`answer` event as each answer completes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request

from api.auth import authenticate, owner_of
from api.jobs import check_idempotency_key
from api.state import state_of
from shared.schemas import ExtractionRequest, JobView

router = APIRouter(
    prefix="/v1/extractions", tags=["extractions"], dependencies=[Depends(authenticate)]
)


@router.post("", status_code=202, response_model=JobView)
def create_extraction(
    body: ExtractionRequest,
    request: Request,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> JobView:
    check_idempotency_key(idempotency_key)
    return state_of(request).submitter.submit(
        body, queue_name="interactive", idempotency_key=idempotency_key, owner=owner_of(request)
    )
