"""OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

Every request is ordinary jobs on the `interactive` queue (one, or one per choice of `n`), so
it gets the prefix cache and the warmer like any other; api/openai_requests.py says how a
request becomes its jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.deps import Owner, State, authenticate
from api.openai_requests import ChatRequest, CompletionRequest
from api.state import AppState
from shared.errors import ServiceUnavailable
from shared.job_store import JobEvent
from shared.queues import INTERACTIVE
from shared.redis_outage import REDIS_DOWN
from shared.schemas import JobStatus, JobView

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(authenticate)])

Kind = Literal["chat", "text"]


@router.get("/models")
def list_models(state: State) -> dict[str, Any]:
    settings = state.settings
    model = {"id": settings.model, "object": "model", "created": 0, "owned_by": "granary"}
    return {"object": "list", "data": [model]}


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, state: State, owner: Owner) -> Any:
    return await _serve(request, state, owner, body, "text")


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, request: Request, state: State, owner: Owner) -> Any:
    return await _serve(request, state, owner, body, "chat")


async def _serve(
    request: Request,
    state: AppState,
    owner: str | None,
    body: CompletionRequest | ChatRequest,
    kind: Kind,
) -> Any:
    job_ids: list[str] = []
    try:
        for job in body.job_requests():
            view = await run_in_threadpool(
                state.submitter.submit, job, queue_name=INTERACTIVE, owner=owner
            )
            job_ids.append(view.id)
    except BaseException:
        await _cancel(state, job_ids, owner)  # no response names them: nobody would read them
        raise
    reply = _Reply(kind, job_ids, body.n, state.settings.model, owner)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(state, reply, usage), media_type="text/event-stream")
    finals = await _wait_or_cancel(state, request, reply)
    return reply.whole(finals)


async def _cancel(state: AppState, job_ids: list[str], owner: str | None) -> None:
    for job_id in job_ids:
        await run_in_threadpool(state.submitter.cancel, job_id, owner)


async def _wait_or_cancel(state: AppState, request: Request, reply: _Reply) -> list[JobView]:
    """The finished jobs; a client that hangs up meanwhile cancels them."""

    async def finished() -> None:
        for job_id in reply.job_ids:
            async for _ in state.hub.job_events(job_id):
                pass

    async def hung_up() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    done_task = asyncio.create_task(finished())
    gone_task = asyncio.create_task(hung_up())
    done, pending = await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if done_task not in done:
        await _cancel(state, reply.job_ids, reply.owner)
    else:
        done_task.result()  # Redis went away while waiting: a 503, nothing was sent yet
    views = [await run_in_threadpool(state.store.get, job_id) for job_id in reply.job_ids]
    for view in views:
        if view.status == JobStatus.FAILED:
            raise ServiceUnavailable(f"generation failed: {view.error}")
    return views


async def _stream(state: AppState, reply: _Reply, include_usage: bool) -> AsyncIterator[bytes]:
    finished = False
    try:
        for index in range(reply.n):
            yield reply.sse(reply.chunk(index, role=True))
        views: list[JobView] = []
        async for job, batch in _events(state, reply.job_ids):
            text = "".join(orjson.loads(e.data)["text"] for e in batch if e.event == "token")
            for index in reply.choices_of(job):
                if text:
                    yield reply.sse(reply.chunk(index, text=text))
            if batch[-1].final:
                view = await run_in_threadpool(state.store.get, reply.job_ids[job])
                views.append(view)
                for chunk in reply.last_chunks(job, view):
                    yield reply.sse(chunk)
        finished = True
        if include_usage:
            yield reply.sse(reply.usage_chunk(views))
        yield b"data: [DONE]\n\n"
    except REDIS_DOWN:
        # The response has started: it ends with an error chunk, not a cut. The jobs go on
        # (the message names them); cancelling them would need Redis too.
        finished = True
        yield reply.sse(reply.interrupted())
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: stop generating for nobody
            # Starlette cancels this generator when the client leaves; shield the clean-up.
            with anyio.CancelScope(shield=True), contextlib.suppress(*REDIS_DOWN):
                await _cancel(state, reply.job_ids, reply.owner)


async def _events(state: AppState, job_ids: list[str]) -> AsyncIterator[tuple[int, list[JobEvent]]]:
    """Each job's event batches, tagged with the job's place in `job_ids`, as they come."""
    if len(job_ids) == 1:
        async for batch in state.hub.job_events(job_ids[0]):
            yield 0, batch
        return
    queue: asyncio.Queue[tuple[int, list[JobEvent] | Exception | None]] = asyncio.Queue()

    async def pump(job: int) -> None:
        try:
            async for batch in state.hub.job_events(job_ids[job]):
                await queue.put((job, batch))
            await queue.put((job, None))
        except Exception as exc:  # Redis went away: the reader raises it
            await queue.put((job, exc))

    pumps = [asyncio.create_task(pump(job)) for job in range(len(job_ids))]
    try:
        running = len(pumps)
        while running:
            job, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield job, item
    finally:
        for task in pumps:
            task.cancel()


class _Reply:
    """OpenAI's response shapes for `n` choices of one request, from its jobs: one per choice,
    or one for all when the choices are greedy (the same text)."""

    def __init__(
        self, kind: Kind, job_ids: list[str], n: int, model: str, owner: str | None
    ) -> None:
        self.kind = kind
        self.job_ids = job_ids
        self.n = n
        self.owner = owner
        self.model = model
        self.created = int(time.time())
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{job_ids[0]}"

    def choices_of(self, job: int) -> range:
        """The choices job `job` (its place in `job_ids`) answers."""
        return range(job, self.n, len(self.job_ids))

    def whole(self, views: list[JobView]) -> dict[str, Any]:
        choices = []
        for index in range(self.n):
            view = views[index % len(views)]
            text = view.result.text if view.result else ""
            choice: dict[str, Any] = {"index": index, "logprobs": None}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["finish_reason"] = _finish_reason(view)
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices) | {"usage": _usage(views)}

    def chunk(
        self, index: int, text: str = "", role: bool = False, finish: str | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
            return self._envelope("chat.completion.chunk", [choice])
        choice["text"] = text
        return self._envelope("text_completion", [choice])

    def last_chunks(self, job: int, view: JobView) -> list[dict[str, Any]]:
        """What ends job `job`'s choices: their finish reasons, or its failure."""
        if view.status == JobStatus.FAILED:
            return [
                {"error": {"message": f"generation failed: {view.error}", "type": "server_error"}}
            ]
        return [self.chunk(index, finish=_finish_reason(view)) for index in self.choices_of(job)]

    def usage_chunk(self, views: list[JobView]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, []) | {"usage": _usage(views)}

    def interrupted(self) -> dict[str, Any]:
        jobs = ", ".join(f"GET /v1/jobs/{job_id}" for job_id in self.job_ids)
        message = f"the stream was interrupted (Redis unavailable); generation goes on: {jobs}"
        return {"error": {"message": message, "type": "server_error", "code": "unavailable"}}

    @staticmethod
    def sse(data: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def _finish_reason(view: JobView) -> str:
    reason = view.result.finish_reason if view.result else "stop"
    return "length" if reason == "length" else "stop"


def _usage(views: list[JobView]) -> dict[str, Any]:
    """The prompt once (the choices share it), the tokens decoded for all of them (greedy
    choices are decoded once)."""
    prompt = views[0].usage
    decoded = sum(view.usage.completion_tokens for view in views)
    fields: dict[str, Any] = {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": decoded,
        "total_tokens": prompt.prompt_tokens + decoded,
        "prompt_tokens_details": {"cached_tokens": prompt.cached_tokens},
    }
    if all(view.usage.cached_result for view in views):
        fields["cached_result"] = True  # granary's own: answered from an identical request
    return fields
