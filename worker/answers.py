"""A job's answers as text: sampled tokens become published pieces, up to a stop.

A generation's tokens go through one `TextSink` (its tally is `Decoded`); an extraction's
questions each have a text stream of their own in `Answering`, which publishes every token
tagged with its question and each answer as an `answer` event the moment it ends. Both start
from what an earlier attempt streamed (worker/resume.py): those tokens are fed silently.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import llama_cpp
from llama_cpp import Llama

from shared.llm import token_bytes
from shared.schemas import Answer, ExtractOrder, FinishReason, Timings, Usage
from worker.resume import Streamed, text_stream
from worker.text_stream import TextStream
from worker.token_publisher import TokenPublisher

# Called with (the token a text piece came from, None for text released at the end, the piece);
# returns True to stop (the job was cancelled).
OnToken = Callable[[int | None, str], bool]
# How a question's decoding ended, before its text says more (a stop string, a cancel).
Finish = Literal["stop", "length"]


@dataclass
class Decoded:
    """A generation's text and tally as its tokens come."""

    count: int = 0
    ticks: int = 0
    text: str = ""
    finish_reason: FinishReason = "length"
    first_at: float | None = None
    last_at: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        self.ticks += 1
        if self.first_at is None:
            self.first_at = now
        self.last_at = now

    def timings(
        self,
        started: float,
        prefill_started: float,
        restore_ms: float | None,
        ended_at: float | None = None,
    ) -> Timings:
        """`ended_at`: when the generation's end was decided; with no token (the first sample
        ended it), the first token's time is that decision's."""
        first_at = self.first_at or ended_at
        if first_at is None:
            return Timings(restore_ms=restore_ms)
        rate = None
        if self.first_at is not None and self.last_at is not None and self.ticks > 1:
            decode_s = self.last_at - self.first_at
            rate = (self.ticks - 1) / decode_s if decode_s > 0 else None
        return Timings(
            restore_ms=restore_ms,
            prefill_ms=(first_at - prefill_started) * 1000,
            ttft_ms=(first_at - started) * 1000,
            decode_tokens_per_s=rate,
        )


class TextSink:
    """A generation's sampled tokens become text, published as they come, up to a stop."""

    def __init__(
        self,
        llama: Llama,
        stream: TextStream,
        decoded: Decoded,
        max_tokens: int,
        on_token: OnToken,
    ) -> None:
        self._llama = llama
        self._vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self._stream = stream
        self.decoded = decoded
        self._max_tokens = max_tokens
        self._on_token = on_token

    def push(self, token: int) -> bool:
        """Take one sampled token; True when no more are wanted."""
        decoded = self.decoded
        decoded.tick()
        if llama_cpp.llama_vocab_is_eog(self._vocab, token):
            decoded.finish_reason = "stop"
            return True
        decoded.count += 1
        piece = self._stream.feed(token_bytes(self._llama, token))
        if self._on_token(token, piece):
            decoded.finish_reason = "cancelled"
            return True
        if self._stream.stopped:
            decoded.finish_reason = "stop"
            return True
        return decoded.count >= self._max_tokens


def end_text(stream: TextStream, decoded: Decoded, on_token: OnToken) -> Decoded:
    """Release the text a stop string held back, and keep the whole text."""
    tail = stream.flush()
    if tail:
        on_token(None, tail)
    decoded.text = stream.text
    return decoded


@dataclass(frozen=True, slots=True)
class QuestionEnd:
    """How one question's decoding ended: its new tokens and times."""

    tokens: list[int]
    finish_reason: Finish
    ttft_ms: float | None  # from when the questions started
    decode_tokens_per_s: float | None


@dataclass
class Answering:
    """The text side of an extraction's questions while they decode: streams, stops, cancel."""

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
    drifted: bool = False  # see worker.outcomes.Extracted.reproducible
    # Draft rows its questions' passes carried, and how many of them were written.
    drafted: int = 0
    accepted: int = 0

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
                self.on_answer(index, QuestionEnd([], "length", None, None))
            else:
                open_.append(index)
        return open_

    def budget(self, index: int) -> int:
        return self.order.max_tokens - len(self.streamed.of(self.order.questions[index].id))

    def on_token(self, index: int, token: int) -> bool:
        stream = self.streams[index]
        piece = stream.feed(token_bytes(self.llama, token))
        if self.publisher.token(token, piece, question=self.order.questions[index].id):
            self.cancelled = True
        return self.cancelled or stream.stopped

    def on_answer(self, index: int, end: QuestionEnd) -> None:
        stream = self.streams[index]
        tail = stream.flush()
        question = self.order.questions[index].id
        if tail:
            self.publisher.token(None, tail, question=question)
        finish: FinishReason = end.finish_reason
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
                completion_tokens=resumed + len(end.tokens),
                resumed_tokens=resumed,
            ),
            timings=Timings(
                ttft_ms=None if end.ttft_ms is None else end.ttft_ms + self.offset_ms,
                decode_tokens_per_s=end.decode_tokens_per_s,
            ),
        )
        self.answers[question] = view
        self.publisher.answer(question, view)
