"""An extraction job over the Conclave: the document's prefix held once, questions forked.

The prefix (instructions + document) is a prefill-only stream that stays held while the job's
questions run; each question is a stream whose prompt starts with that prefix, so the Conclave
copies the held cells into the question's sequence instead of computing them again, and the
questions decode in the same steps as every other job's tokens.
"""

from __future__ import annotations

import contextlib
import queue
import time
from dataclasses import dataclass, field
from functools import partial

from llama_cpp import Llama

from shared.errors import ContextOverflow
from shared.llm import document_prompts
from shared.prefix_usage import document_prefix_id
from shared.schemas import ExtractOrder
from worker.answers import Answering, Finish, QuestionEnd
from worker.conclave.loop import Conclave
from worker.conclave.streams import (
    Ended,
    Event,
    StreamHandle,
    StreamRequest,
    Token,
    expect,
    wait_started,
)
from worker.outcomes import Extracted, extraction_outcome
from worker.prompt_breaks import chunk_breaks
from worker.resume import NOTHING, Streamed
from worker.sampling import Sampling
from worker.token_publisher import TokenPublisher


class DoesNotFit(ContextOverflow):
    """A question's own tokens and answer cannot fit in a sequence next to the prefix."""

    def __init__(self, question: int, overflow: int) -> None:
        super().__init__(
            f"question {question} does not fit in the context next to the shared prefix: "
            f"{overflow} tokens too many"
        )
        self.question = question
        self.overflow = overflow


@dataclass
class _Question:
    index: int  # in the order's questions
    tokens: list[int] = field(default_factory=list)
    first_at: float | None = None
    last_at: float | None = None


def extract(
    conclave: Conclave,
    llama: Llama,
    n_ctx: int,
    order: ExtractOrder,
    publisher: TokenPublisher,
    streamed: Streamed = NOTHING,
    priority: int = 0,
) -> Extracted:
    """Answer every question of `order`; `n_ctx` is what one request may hold."""
    started = time.perf_counter()
    prefix, tails = document_prompts(llama, order.document, [q.question for q in order.questions])
    for index, tail in enumerate(tails):
        overflow = len(prefix) + len(tail) + order.max_tokens - n_ctx
        if overflow > 0:
            raise DoesNotFit(index, overflow)
    head = [*prefix, *tails[0]]
    document = (document_prefix_id(order.document, order.cache_namespace), len(prefix))
    hold = StreamRequest(
        head,
        chunk_breaks(len(prefix), limit=len(head) - 1),
        order.cache_namespace,
        priority,
        max_new=0,
        end=len(prefix),
        hold=True,
        document=document,
    )
    with conclave.submit(conclave.handle(hold)) as held:
        cached = min(wait_started(held).cached_tokens, len(prefix))
        expect(held.next())  # the prefix is in memory
        prefilled = time.perf_counter()
        prompt_tokens = [len(prefix) + len(t) for t in tails]
        offset_ms = (prefilled - started) * 1000
        answering = Answering(llama, order, publisher, prompt_tokens, cached, offset_ms, streamed)
        open_ = answering.open_questions()
        if open_:
            _answer(conclave, order, answering, prefix, tails, open_, priority)
    return extraction_outcome(order, answering, prefix, tails, cached, started, prefilled, streamed)


def _answer(
    conclave: Conclave,
    order: ExtractOrder,
    answering: Answering,
    prefix: list[int],
    tails: list[list[int]],
    open_: list[int],
    priority: int,
) -> None:
    """Submit every open question as a stream of its own, all sharing one event queue."""
    events: queue.SimpleQueue[tuple[StreamHandle, Event]] = queue.SimpleQueue()
    started = time.perf_counter()
    questions = [_Question(i) for i in open_]
    with contextlib.ExitStack() as stack:
        handles = []
        for j, i in enumerate(open_):
            resumed = answering.streamed.of(order.questions[i].id)
            tokens = [*prefix, *tails[i], *resumed]
            # As a generation job resumes: its streamed tokens start a chunk after the prompt.
            resumed_from = len(prefix) + len(tails[i]) - 1 if resumed else None
            request = StreamRequest(
                tokens,
                chunk_breaks(len(prefix), resumed_from, limit=len(tokens) - 1),
                order.cache_namespace,
                priority,
                max_new=answering.budget(i),
                sampling=Sampling(order.temperature, order.top_p, (order.seed + i) % 2**32),
                speculation=order.speculation,
            )
            on_token = partial(_on_token, answering, questions[j])
            handle = conclave.handle(request, on_token, events, tag=j)
            handles.append(stack.enter_context(conclave.submit(handle)))
        live = len(handles)
        while live:
            handle, event = handles[0].next_tagged()
            live -= _on_event(answering, questions[handle.tag], expect(event), started)


def _on_token(answering: Answering, question: _Question, event: Token) -> bool:
    """Model thread: a question's token goes out at once; True stops the question."""
    question.tokens.append(event.token)
    question.first_at = question.first_at or event.at
    question.last_at = event.at
    return answering.on_token(question.index, event.token)


def _on_event(answering: Answering, question: _Question, event: Event | None, t0: float) -> int:
    """Job thread: pass a question's end on; returns 1 when the question ended."""
    if not isinstance(event, Ended):
        return 0
    finish: Finish = "length" if event.reason == "length" else "stop"
    answering.drifted = answering.drifted or event.drifted
    answering.drafted += event.drafted
    answering.accepted += event.accepted
    ttft = ((question.first_at or event.at) - t0) * 1000
    rate = None
    if question.first_at and question.last_at and question.last_at > question.first_at:
        rate = (len(question.tokens) - 1) / (question.last_at - question.first_at)
    answering.on_answer(question.index, QuestionEnd(question.tokens, finish, ttft, rate))
    return 1
