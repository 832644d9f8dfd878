"""`/v1/jobs`: submit, read, cancel, and stream a generation job.

Handlers that only talk to Redis synchronously are plain `def`s: FastAPI runs them in its
thread pool, so the event loop never blocks on the sync client rq needs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Header
from fastapi.concurrency import run_in_threadpool
from sse_starlette import EventSourceResponse, ServerSentEvent

from api.deps import IdempotencyKey, Owner, State, authenticate
from api.errors import error_body
from api.state import AppState
from shared.errors import InvalidRequest
from shared.job_store import JobEvent
from shared.queues import INTERACTIVE
from shared.redis_outage import REDIS_DOWN
from shared.schemas import ExtractionRequest, JobRequest, JobView

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(authenticate)])

# Plain "\n" line ends: a "\r\n" split across two network reads makes some clients
# (httpx-sse, seen here) end an event early and deliver it without its data.
SSE_SEP = "\n"


@router.post("", status_code=202, response_model=JobView)
def create_job(
    body: JobRequest, state: State, owner: Owner, idempotency_key: IdempotencyKey
) -> JobView:
    return submit_interactive(state, body, owner, idempotency_key)


def submit_interactive(
    state: AppState,
    body: JobRequest | ExtractionRequest,
    owner: str | None,
    idempotency_key: str | None,
) -> JobView:
    """A job or an extraction someone is waiting for: the `interactive` queue."""
    return state.submitter.submit(
        body, queue_name=INTERACTIVE, idempotency_key=idempotency_key, owner=owner
    )


@router.get("/{job_id}", response_model=JobView)
def get_job(job_id: str, state: State, owner: Owner) -> JobView:
    return state.store.get_owned(job_id, owner)


@router.delete("/{job_id}", response_model=JobView)
def cancel_job(job_id: str, state: State, owner: Owner) -> JobView:
    return state.submitter.cancel(job_id, owner)


@router.get("/{job_id}/events")
async def job_events(
    job_id: str,
    state: State,
    owner: Owner,
    last_event_id: Annotated[str | None, Header()] = None,
) -> EventSourceResponse:
    # 404 (unknown, or another key's job) before the stream starts.
    await run_in_threadpool(state.store.get_owned, job_id, owner)
    after = _parse_last_event_id(last_event_id)
    return EventSourceResponse(_events(state, job_id, after), ping=15, sep=SSE_SEP)


def _parse_last_event_id(value: str | None) -> int:
    if value is None or value == "":
        return -1
    try:
        return int(value)
    except ValueError:
        raise InvalidRequest("Last-Event-ID must be an integer", field="Last-Event-ID") from None


async def _events(state: AppState, job_id: str, after: int) -> AsyncIterator[bytes]:
    # Events that arrive together (a worker publishes tokens in batches) go in one write.
    try:
        async for batch in state.hub.job_events(job_id, after):
            yield await _encode(state, job_id, batch)
    except REDIS_DOWN:
        # The response has started: no status code can say it now, an event can.
        yield _interrupted()


def _interrupted() -> bytes:
    """The `error` event of a stream whose Redis went away. It has no id, so the client's
    Last-Event-ID stays that of the last event it got, and resuming with it misses nothing."""
    message = (
        "the event stream was interrupted (Redis unavailable); the job goes on: reconnect "
        "with Last-Event-ID set to the last event's id to resume"
    )
    data = orjson.dumps(error_body("unavailable", message)).decode()
    return ServerSentEvent(data, event="error", sep=SSE_SEP).encode()


async def _encode(state: AppState, job_id: str, events: list[JobEvent]) -> bytes:
    chunks = []
    for event in events:
        data = event.data
        if event.final:
            data = (await run_in_threadpool(state.store.get, job_id)).model_dump_json()
        sse = ServerSentEvent(data, event=event.event, id=str(event.seq), sep=SSE_SEP)
        chunks.append(sse.encode())
    return b"".join(chunks)
