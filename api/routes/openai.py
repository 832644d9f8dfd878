"""OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

Every request is an ordinary job on the `interactive` queue, so it gets the prefix cache and
the warmer like any other; api/openai_requests.py says how a request becomes a job.
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
    job = body.job_request()
    view = await run_in_threadpool(state.submitter.submit, job, queue_name=INTERACTIVE, owner=owner)
    reply = _Reply(kind, view.id, state.settings.model, owner)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(state, reply, usage), media_type="text/event-stream")
    final = await _wait_or_cancel(state, request, reply)
    return reply.whole(final)


async def _wait_or_cancel(state: AppState, request: Request, reply: _Reply) -> JobView:
    """The finished job; a client that hangs up meanwhile cancels it."""

    async def finished() -> None:
        async for _ in state.hub.job_events(reply.job_id):
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
        await run_in_threadpool(state.submitter.cancel, reply.job_id, reply.owner)
    else:
        done_task.result()  # Redis went away while waiting: a 503, nothing was sent yet
    view = await run_in_threadpool(state.store.get, reply.job_id)
    if view.status == JobStatus.FAILED:
        raise ServiceUnavailable(f"generation failed: {view.error}")
    return view


async def _stream(state: AppState, reply: _Reply, include_usage: bool) -> AsyncIterator[bytes]:
    finished = False
    try:
        yield reply.sse(reply.chunk(role=True))
        async for batch in state.hub.job_events(reply.job_id):
            text = "".join(orjson.loads(e.data)["text"] for e in batch if e.event == "token")
            if text:
                yield reply.sse(reply.chunk(text=text))
            if batch[-1].final:
                finished = True
                view = await run_in_threadpool(state.store.get, reply.job_id)
                for chunk in reply.last_chunks(view, include_usage):
                    yield reply.sse(chunk)
                yield b"data: [DONE]\n\n"
    except REDIS_DOWN:
        # The response has started: it ends with an error chunk, not a cut. The job goes on
        # (the message names it); cancelling it would need Redis too.
        finished = True
        yield reply.sse(reply.interrupted())
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: stop generating for nobody
            # Starlette cancels this generator when the client leaves; shield the clean-up.
            with anyio.CancelScope(shield=True), contextlib.suppress(*REDIS_DOWN):
                await run_in_threadpool(state.submitter.cancel, reply.job_id, reply.owner)


class _Reply:
    """OpenAI's response shapes for one job."""

    def __init__(self, kind: Kind, job_id: str, model: str, owner: str | None) -> None:
        self.kind = kind
        self.job_id = job_id
        self.owner = owner
        self.model = model
        self.created = int(time.time())
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{job_id}"

    def whole(self, view: JobView) -> dict[str, Any]:
        text = view.result.text if view.result else ""
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = _finish_reason(view)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [choice]) | {"usage": _usage(view)}

    def chunk(
        self, text: str = "", role: bool = False, finish: str | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
            return self._envelope("chat.completion.chunk", [choice])
        choice["text"] = text
        return self._envelope("text_completion", [choice])

    def last_chunks(self, view: JobView, include_usage: bool) -> list[dict[str, Any]]:
        if view.status == JobStatus.FAILED:
            return [
                {"error": {"message": f"generation failed: {view.error}", "type": "server_error"}}
            ]
        chunks = [self.chunk(finish=_finish_reason(view))]
        if include_usage:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            chunks.append(self._envelope(obj, []) | {"usage": _usage(view)})
        return chunks

    def interrupted(self) -> dict[str, Any]:
        message = (
            "the stream was interrupted (Redis unavailable); the job goes on: "
            f"GET /v1/jobs/{self.job_id} for its result"
        )
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


def _usage(view: JobView) -> dict[str, Any]:
    usage = view.usage
    fields: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.cached_result:  # granary's own: answered from an identical request's result
        fields["cached_result"] = True
    return fields
