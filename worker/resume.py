"""A job re-run after its worker died carries on from what its earlier attempt streamed.

Clients already hold those tokens; the re-run must not contradict them. Regenerating from
scratch gives the same tokens only while decoding is a pure function of the job, which a
re-run on another host's kernels, or a sampled stream whose drafts differ, need not be; the
stream would then join two different runs. So the re-run reads the published events back, takes
their token ids as given (prefilled after the prompt, fed silently through each answer's text
stream), publishes from the next index on, and decodes only the rest.

A stream that already released its held-back text (the end of a generation, or an extraction
question without its `answer` event yet) cannot be carried on: those jobs run again from the
start, their events deduplicated by index as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
from llama_cpp import Llama

from shared.job_store import JobEvent
from shared.llm import token_bytes
from shared.schemas import Answer, AnswerEvent, TokenEvent
from worker.text_stream import TextStream


@dataclass(frozen=True, slots=True)
class Streamed:
    """What earlier attempts of a job published."""

    # The index the next event gets: every event published so far is one index.
    next_index: int = 0
    # Token ids per answer stream: the question's id, or None for a generation job.
    tokens: dict[str | None, list[int]] = field(default_factory=dict)
    # Extraction questions whose `answer` event went out.
    answers: dict[str, Answer] = field(default_factory=dict)

    def of(self, question: str | None) -> list[int]:
        return self.tokens.get(question, [])

    @property
    def resumed_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


NOTHING = Streamed()


def read_back(events: list[JobEvent]) -> Streamed | None:
    """Read a job's published events back; None when they cannot be carried on from."""
    tokens: dict[str | None, list[int]] = {}
    answers: dict[str, Answer] = {}
    ended: set[str | None] = set()
    next_index = 0
    for event in events:
        if event.final:
            return None  # the job ended: nothing to re-run
        data = orjson.loads(event.data)
        if event.event == "answer":
            answer = AnswerEvent.model_validate(data)
            answers[answer.question] = answer.answer
        else:
            token = TokenEvent.model_validate(data)
            if token.token is None:
                ended.add(token.question)
            elif token.question in ended:
                return None
            else:
                tokens.setdefault(token.question, []).append(token.token)
        next_index = event.seq + 1
    if ended - set(answers):
        return None
    return Streamed(next_index, tokens, answers)


def text_stream(llama: Llama, stop: list[str], streamed: Sequence[int]) -> TextStream:
    """An answer's text stream as the earlier attempt left it: its tokens fed, their text
    (published already) not released again."""
    stream = TextStream(stop=stop)
    for token in streamed:
        stream.feed(token_bytes(llama, token))
    return stream
