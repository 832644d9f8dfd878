"""An extraction job on the worker: the document's prefix once, then every question together.

The prefix (instructions + document) is restored or prefilled once like any job's, through the
engine (so it is cached and reused); the questions then fork from it and decode together
(`worker.multi_sequence`). Each token goes out tagged with its question, and each answer as an
`answer` event the moment it completes. A re-run after a worker died keeps the answers and
tokens its earlier attempt streamed (worker/resume.py) and decodes only the rest.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace

from llama_cpp import Llama

from shared.llm import document_prompts
from shared.schemas import (
    Answer,
    ExtractionResult,
    ExtractOrder,
    FinishReason,
    SpeculationReport,
    Timings,
    Usage,
)
from worker import multi_sequence
from worker.engine import Engine
from worker.multi_sequence import Question
from worker.resume import NOTHING, Streamed, text_stream
from worker.speculation import drafting_report, drafts
from worker.text_stream import TextStream
from worker.token_publisher import TokenPublisher


@dataclass(frozen=True, slots=True)
class Extracted:
    result: ExtractionResult
    usage: Usage
    timings: Timings
    prefix_tokens: int
    speculation: SpeculationReport | None
    # False: an answer may depend on what ran beside it (worker/conclave/streams.py Ended).
    reproducible: bool = True


@dataclass
class Answering:
    """The text side of every question while they decode: streams, stops, cancellation."""

    llama: Llama
    order: ExtractOrder
    publisher: TokenPublisher
    prompt_tokens: list[int]
    cached: int
    # Answers' times count from when the questions started; jobs' from when the job did.
    offset_ms: float
    streamed: Streamed
    streams: list[TextStream] = field(init=False)
    answers: dict[str, Answer] = field(init=False)
    cancelled: bool = False
    drifted: bool = False  # see Extracted.reproducible

    def __post_init__(self) -> None:
        llama, stop = self.llama, self.order.stop
        self.streams = [
            text_stream(llama, stop, self.streamed.of(q.id)) for q in self.order.questions
        ]
        self.answers = dict(self.streamed.answers)

    def open_questions(self) -> list[int]:
        """Questions still to decode; those the earlier attempt took to the end end now."""
        open_ = []
        for index, question in enumerate(self.order.questions):
            if question.id in self.answers:
                continue
            if self.streams[index].stopped or self.budget(index) <= 0:
                self.on_answer(index, multi_sequence.Answer([], "length", None, None))
            else:
                open_.append(index)
        return open_

    def budget(self, index: int) -> int:
        return self.order.max_tokens - len(self.streamed.of(self.order.questions[index].id))

    def on_token(self, index: int, token: int) -> bool:
        stream = self.streams[index]
        piece = stream.feed(self.llama.detokenize([token]))
        if self.publisher.token(token, piece, question=self.order.questions[index].id):
            self.cancelled = True
        return self.cancelled or stream.stopped

    def on_answer(self, index: int, answer: multi_sequence.Answer) -> None:
        stream = self.streams[index]
        tail = stream.flush()
        question = self.order.questions[index].id
        if tail:
            self.publisher.token(None, tail, question=question)
        finish: FinishReason = answer.finish_reason
        if self.cancelled:
            finish = "cancelled"
        elif stream.stopped:
            finish = "stop"
        resumed = len(self.streamed.of(question))
        view = Answer(
            text=stream.text,
            finish_reason=finish,
            usage=Usage(
                prompt_tokens=self.prompt_tokens[index],
                cached_tokens=self.cached,
                completion_tokens=resumed + len(answer.tokens),
                resumed_tokens=resumed,
            ),
            timings=Timings(
                ttft_ms=None if answer.ttft_ms is None else answer.ttft_ms + self.offset_ms,
                decode_tokens_per_s=answer.decode_tokens_per_s,
            ),
        )
        self.answers[question] = view
        self.publisher.answer(question, view)


def extract(
    engine: Engine, order: ExtractOrder, publisher: TokenPublisher, streamed: Streamed = NOTHING
) -> Extracted:
    started = time.perf_counter()
    llama = engine.llama
    prefix, tails = document_prompts(llama, order.document, [q.question for q in order.questions])
    cached = engine.load_document(order.cache_namespace, prefix + tails[0], len(prefix))
    prefilled = time.perf_counter()
    prompt_tokens = [len(prefix) + len(t) for t in tails]
    offset_ms = (prefilled - started) * 1000
    answering = Answering(llama, order, publisher, prompt_tokens, cached, offset_ms, streamed)
    open_ = answering.open_questions()
    report = _decode(engine, order, answering, prefix, tails, open_) if open_ else None
    outcome = extraction_outcome(
        order, answering, prefix, tails, cached, started, prefilled, streamed
    )
    return replace(outcome, speculation=report)


def extraction_outcome(
    order: ExtractOrder,
    answering: Answering,
    prefix: list[int],
    tails: list[list[int]],
    cached: int,
    started: float,
    prefilled: float,
    streamed: Streamed,
) -> Extracted:
    """The job's result, usage and timings once every question is answered."""
    ids = [q.id for q in order.questions]
    answers = {i: answering.answers[i] for i in ids}
    result = ExtractionResult(
        answers=answers,
        object={i: a.text.strip() for i, a in answers.items()} if order.fields else None,
    )
    usage = Usage(
        prompt_tokens=len(prefix) + sum(len(t) for t in tails),
        cached_tokens=cached,
        completion_tokens=sum(a.usage.completion_tokens for a in answers.values()),
        resumed_tokens=streamed.resumed_tokens,
    )
    first = min((a.timings.ttft_ms for a in answers.values() if a.timings.ttft_ms), default=None)
    timings = Timings(prefill_ms=(prefilled - started) * 1000, ttft_ms=first)
    return Extracted(result, usage, timings, len(prefix), None, not answering.drifted)


def _decode(
    engine: Engine,
    order: ExtractOrder,
    answering: Answering,
    prefix: list[int],
    tails: list[list[int]],
    open_: list[int],
) -> SpeculationReport | None:
    """Decode the open questions together; their streamed tokens are prefilled after them."""
    tails = [[*tails[i], *answering.streamed.of(order.questions[i].id)] for i in open_]
    questions = [
        Question(
            tokens=tail,
            max_tokens=answering.budget(i),
            temperature=order.temperature,
            top_p=order.top_p,
            seed=(order.seed + i) % 2**32,
        )
        for i, tail in zip(open_, tails, strict=True)
    ]
    with contextlib.ExitStack() as stack:
        drafting = None
        if engine.speculator is not None and drafts(order.speculation, order.temperature):
            prompts = [prefix + tail for tail in tails]
            drafting = stack.enter_context(engine.speculator.drafting(prompts, order.speculation))
        multi_sequence.answer_questions(
            engine.llama,
            questions,
            engine.chunk_tokens,
            lambda j, token: answering.on_token(open_[j], token),
            on_answer=lambda j, answer: answering.on_answer(open_[j], answer),
            drafting=drafting,
        )
    return None if drafting is None else drafting_report(order.speculation, drafting)
