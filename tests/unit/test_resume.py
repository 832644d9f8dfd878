"""Reading a job's published events back for a re-run (worker/resume.py)."""

from __future__ import annotations

from shared.job_store import JobEvent
from shared.schemas import Answer, AnswerEvent, Timings, TokenEvent, Usage
from worker.resume import read_back


def _token(index: int, text: str, token: int | None, question: str | None = None) -> JobEvent:
    event = TokenEvent(index=index, text=text, token=token, question=question)
    return JobEvent(index, "token", event.model_dump_json())


def _answer(index: int, question: str, text: str) -> JobEvent:
    answer = Answer(text=text, finish_reason="stop", usage=Usage(), timings=Timings())
    event = AnswerEvent(index=index, question=question, answer=answer)
    return JobEvent(index, "answer", event.model_dump_json())


def test_a_generations_tokens_are_read_back_in_order() -> None:
    found = read_back([_token(0, "Hel", 11), _token(1, "", 12), _token(2, "lo", 13)])
    assert found is not None
    assert found.of(None) == [11, 12, 13]
    assert found.next_index == 3 and found.resumed_tokens == 3


def test_an_extractions_tokens_and_answers_are_read_back_per_question() -> None:
    events = [
        _token(0, "a", 1, "q1"),
        _token(1, "b", 2, "q2"),
        _token(2, "!", None, "q1"),  # q1's held-back text at its end, then its answer
        _answer(3, "q1", "a!"),
        _token(4, "c", 3, "q2"),
    ]
    found = read_back(events)
    assert found is not None
    assert found.of("q1") == [1] and found.of("q2") == [2, 3]
    assert found.answers["q1"].text == "a!" and "q2" not in found.answers
    assert found.next_index == 5


def test_streams_that_cannot_be_carried_on() -> None:
    # A generation that released its end: the job was done but for its final record.
    assert read_back([_token(0, "a", 1), _token(1, "b", None)]) is None
    # A question that ended without its answer event.
    assert read_back([_token(0, "a", 1, "q1"), _token(1, "b", None, "q1")]) is None
    # A job that ended: nothing to re-run.
    assert read_back([_token(0, "a", 1), JobEvent(1, "done", "")]) is None


def test_nothing_streamed_starts_at_the_beginning() -> None:
    found = read_back([])
    assert found is not None and found.next_index == 0 and found.of(None) == []
