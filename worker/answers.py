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
from shared.schemas import Answer, ExtractOrder, FinishReason, Timings, Usage, Vote
from worker.restore_cost import Choice, choice_timings
from worker.resume import Streamed, text_stream
from worker.text_stream import TextStream
from worker.token_publisher import TokenPublisher
from worker.vote import Ballot

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
        choice: Choice | None = None,
    ) -> Timings:
        """`ended_at`: when the generation's end was decided; with no token (the first sample
        ended it), the first token's time is that decision's. `choice`: a prefix found on
        disk, restored or not."""
        restored = choice_timings(choice) | {"restore_ms": restore_ms}
        first_at = self.first_at or ended_at
        if first_at is None:
            return Timings(**restored)
        rate = None
        if self.first_at is not None and self.last_at is not None and self.ticks > 1:
            decode_s = self.last_at - self.first_at
            rate = (self.ticks - 1) / decode_s if decode_s > 0 else None
        return Timings(
            prefill_ms=(first_at - prefill_started) * 1000,
            ttft_ms=(first_at - started) * 1000,
            decode_tokens_per_s=rate,
            **restored,
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
    """How one sample of a question ended: its new tokens and times."""

    tokens: list[int]
    finish_reason: Finish
    ttft_ms: float | None  # from when the questions started
    decode_tokens_per_s: float | None


# A sample that ends with no token decoded: one the earlier attempt took to its end, or the
# times of a vote whose sample 0 never ended.
NOTHING_DECODED = QuestionEnd([], "length", None, None)


@dataclass
class _Votes:
    """A voted question while its samples decode (sample 0's text stream is the question's)."""

    ballot: Ballot
    streams: dict[int, TextStream]  # samples 1 and on
    finishes: dict[int, FinishReason] = field(default_factory=dict)
    tokens: int = 0  # every sample's, those stopped once the vote was decided included
    first: QuestionEnd | None = None  # sample 0's end: the answer's times


@dataclass
class Answering:
    """The text side of an extraction's questions while they decode: streams, stops, votes,
    cancel.

    A question with one sample streams its tokens and answers when it ends. A voted question
    (`samples` > 1) streams sample 0's tokens (the greedy answer) and answers once its vote is
    decided (worker/vote.py); its other samples are read silently.
    """

    llama: Llama
    order: ExtractOrder
    publisher: TokenPublisher
    prompt_tokens: list[int]
    cached: int
    # Answers' times count from when the questions started; jobs' from when the job did.
    offset_ms: float
    streamed: Streamed
    streams: list[TextStream] = field(init=False)
    votes: dict[int, _Votes] = field(init=False)
    answers: dict[str, Answer] = field(init=False)
    cancelled: bool = False
    drifted: bool = False  # see worker.outcomes.Extracted.reproducible
    # Draft rows its questions' passes carried, and how many of them were written.
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        llama, stop, samples = self.llama, self.order.stop, self.order.samples
        self.streams = [
            text_stream(llama, stop, self.streamed.of(q.id)) for q in self.order.questions
        ]
        self.votes = {}
        if samples > 1:
            self.votes = {
                index: _Votes(Ballot(samples), {s: TextStream(stop) for s in range(1, samples)})
                for index in range(len(self.order.questions))
            }
        self.answers = dict(self.streamed.answers)

    def open_samples(self) -> list[tuple[int, int]]:
        """(question, sample) pairs still to decode, by question, then sample. A sample 0
        the earlier attempt took to its end ends now."""
        runs = []
        for index, question in enumerate(self.order.questions):
            for sample in range(self.order.samples):
                if question.id in self.answers:
                    break
                if sample == 0 and (self.streams[index].stopped or self.budget(index) <= 0):
                    self.on_end(index, 0, NOTHING_DECODED)
                else:
                    runs.append((index, sample))
        return runs

    def needed(self, index: int) -> int:
        """The fewest more samples of a voted question that could decide its vote."""
        return self.votes[index].ballot.needed()

    def budget(self, index: int, sample: int = 0) -> int:
        resumed = self.streamed.of(self.order.questions[index].id) if sample == 0 else []
        return self.order.max_tokens - len(resumed)

    def on_token(self, index: int, sample: int, token: int) -> bool:
        """A sample's token; True stops the sample (its stop string, a cancelled job)."""
        piece = token_bytes(self.llama, token)
        if sample > 0:
            stream = self.votes[index].streams[sample]
            stream.feed(piece)
            self.cancelled = self.cancelled or self.publisher.cancelled.is_set()
            return self.cancelled or stream.stopped
        stream = self.streams[index]
        text = stream.feed(piece)
        if self.publisher.token(token, text, question=self.order.questions[index].id):
            self.cancelled = True
        return self.cancelled or stream.stopped

    def on_end(self, index: int, sample: int, end: QuestionEnd) -> bool:
        """A sample ended; True when that made the question's answer final."""
        if self.order.questions[index].id in self.answers:
            return False  # a sample the decided vote stopped
        if sample == 0:
            self._flush(index)
        votes = self.votes.get(index)
        if votes is None:
            self._answer(index, self.streams[index].text, self._finish(index, 0, end), end)
            return True
        return self._vote(index, sample, end, votes)

    def _vote(self, index: int, sample: int, end: QuestionEnd, votes: _Votes) -> bool:
        votes.tokens += len(end.tokens)
        if sample == 0:
            votes.first = end
        if self.cancelled:  # what a cancelled job's samples wrote does not count
            return False
        if sample > 0:  # sample 0's text was flushed as it was published
            votes.streams[sample].flush()
        ballot = votes.ballot
        ballot.end(sample, self._stream(index, sample).text)
        votes.finishes[sample] = self._finish(index, sample, end)
        if not ballot.complete:
            return False
        winner = ballot.winner()
        first = votes.first or NOTHING_DECODED
        text, finish = ballot.text(winner), votes.finishes[winner]
        self._answer(index, text, finish, first, votes.tokens, ballot.outcome())
        return True

    def abandon(self, index: int) -> None:
        """A cancelled job's voted question with no sample left decoding: it answers with
        what sample 0 (the streamed one) wrote."""
        votes = self.votes[index]
        first = votes.first or NOTHING_DECODED
        self._answer(index, self.streams[index].text, "cancelled", first, votes.tokens)

    def _stream(self, index: int, sample: int) -> TextStream:
        return self.streams[index] if sample == 0 else self.votes[index].streams[sample]

    def _finish(self, index: int, sample: int, end: QuestionEnd) -> FinishReason:
        if self.cancelled:
            return "cancelled"
        return "stop" if self._stream(index, sample).stopped else end.finish_reason

    def _flush(self, index: int) -> None:
        """Publish the text sample 0's stream held back for a stop string that never came."""
        tail = self.streams[index].flush()
        if tail:
            self.publisher.token(None, tail, question=self.order.questions[index].id)

    def _answer(
        self,
        index: int,
        text: str,
        finish: FinishReason,
        first: QuestionEnd,
        sampled_tokens: int | None = None,
        vote: Vote | None = None,
    ) -> None:
        question = self.order.questions[index].id
        resumed = len(self.streamed.of(question))
        decoded = len(first.tokens) if sampled_tokens is None else sampled_tokens
        view = Answer(
            text=text,
            finish_reason=finish,
            usage=Usage(
                prompt_tokens=self.prompt_tokens[index],
                cached_tokens=self.cached,
                completion_tokens=resumed + decoded,
                resumed_tokens=resumed,
            ),
            timings=Timings(
                ttft_ms=None if first.ttft_ms is None else first.ttft_ms + self.offset_ms,
                decode_tokens_per_s=first.decode_tokens_per_s,
            ),
            vote=vote,
        )
        self.answers[question] = view
        self.publisher.answer(question, view)
