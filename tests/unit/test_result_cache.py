"""What a stored result is keyed by, and which event streams make an entry (no Redis)."""

from __future__ import annotations

from typing import Any

import pytest

from shared.job_store import JobEvent
from shared.result_cache import entry_of, identity, result_key
from shared.schemas import (
    Answer,
    AnswerEvent,
    DocumentFields,
    ExtractionQuestion,
    ExtractionResult,
    ExtractOrder,
    JobResult,
    RenderedPrompt,
    TokenEvent,
    Usage,
    WorkOrder,
)
from shared.settings import Settings

IDENTITY = "i" * 64


def order(**changes: Any) -> WorkOrder:
    values: dict[str, Any] = {
        "prompt": RenderedPrompt(text="Count: 1, 2,", add_bos=True, control_spans=[]),
        "prompt_tokens": 7,
        "max_tokens": 16,
        "temperature": 0.0,
        "top_p": 0.95,
        "seed": 1234,
        "stop": [],
    }
    return WorkOrder(**(values | changes))


def digest(work: WorkOrder | ExtractOrder, explicit_seed: bool = False) -> str | None:
    key = result_key(work, IDENTITY, explicit_seed=explicit_seed)
    return None if key is None else key.digest


def test_greedy_key_ignores_what_greedy_decoding_does_not_read() -> None:
    base = digest(order())
    assert base is not None
    # The API draws a seed for every request; greedy output reads neither it nor top_p.
    assert digest(order(seed=99, top_p=0.5)) == base
    # Drafting with tie replays gives plain decoding's output.
    assert digest(order(speculation="auto")) == base
    # prompt_tokens follows from the prompt.
    assert digest(order(prompt_tokens=8)) == base


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 17},
        {"stop": [","]},
        {"cache_namespace": "tenant-a"},
        {"prompt": RenderedPrompt(text="Count: 1, 2, 3,", add_bos=True, control_spans=[])},
        # The same text read with its control-token text as control tokens.
        {"prompt": RenderedPrompt(text="Count: 1, 2,", add_bos=True, control_spans=[(0, 5)])},
        {"prompt": RenderedPrompt(text="Count: 1, 2,", add_bos=False, control_spans=[])},
        {"prompt": RenderedPrompt(text="Count: 1, 2,", add_bos=True, prefix_chars=6)},
    ],
)
def test_anything_that_decides_output_changes_the_key(change: dict[str, Any]) -> None:
    assert digest(order(**change)) != digest(order())


def test_sampled_requests_are_keyed_only_with_the_clients_own_seed() -> None:
    sampled = order(temperature=0.7)
    assert digest(sampled) is None  # the seed was drawn by the API: not a repeatable request
    seeded = digest(sampled, explicit_seed=True)
    assert seeded is not None and seeded != digest(order())
    assert digest(order(temperature=0.7, seed=1235), explicit_seed=True) != seeded
    assert digest(order(temperature=0.7, top_p=0.9), explicit_seed=True) != seeded
    assert digest(order(temperature=0.8), explicit_seed=True) != seeded


def test_a_different_identity_never_shares_a_key() -> None:
    one = result_key(order(), IDENTITY, explicit_seed=False)
    other = result_key(order(), "j" * 64, explicit_seed=False)
    assert one is not None and other is not None
    assert one.digest != other.digest


def test_identity_covers_model_context_and_chunking_and_no_worker_setting() -> None:
    base = Settings()
    same = identity(base, "fp")
    assert identity(Settings(), "fp") == same
    assert identity(base, "other-model") != same
    assert identity(Settings(n_ctx=2048), "fp") != same
    assert identity(Settings(cache={"block_tokens": 128}), "fp") != same
    # One engine: workers configured otherwise write the same output, so they share results.
    assert identity(Settings(worker={"max_active_jobs": 1}), "fp") == same
    assert identity(Settings(worker={"max_active_jobs": 16, "sequences": 40}), "fp") == same
    # Threads change no row's values; exactness settings decide what is stored instead.
    assert identity(Settings(n_threads=1), "fp") == same
    assert identity(Settings(worker={"exact_batching": False}), "fp") == same


def test_extraction_key_covers_document_questions_and_fields() -> None:
    def extract(**changes: Any) -> ExtractOrder:
        values: dict[str, Any] = {
            "document": DocumentFields(document="Total: 12 EUR"),
            "questions": [ExtractionQuestion(id="total", question="What is the total?")],
            "fields": False,
            "max_tokens": 8,
            "temperature": 0.0,
            "top_p": 0.95,
            "seed": 1,
            "stop": [],
        }
        return ExtractOrder(**(values | changes))

    base = digest(extract())
    assert base is not None and digest(extract(seed=2)) == base
    assert digest(extract(document=DocumentFields(document="Total: 13 EUR"))) != base
    question = ExtractionQuestion(id="total", question="What is the sum?")
    assert digest(extract(questions=[question])) != base
    assert digest(extract(fields=True)) != base


def token(seq: int, text: str) -> JobEvent:
    return JobEvent(seq, "token", TokenEvent(index=seq, text=text, token=seq).model_dump_json())


def test_entry_keeps_the_stream_in_order_without_its_final_event() -> None:
    events = [token(0, "1"), token(1, ", 2"), JobEvent(2, "done", "")]
    result = JobResult(text="1, 2", finish_reason="length")
    entry = entry_of(events, result, Usage(prompt_tokens=5, completion_tokens=2))
    assert entry is not None
    assert entry.events == [("token", e.data) for e in events[:2]]
    assert entry.result == result and entry.extraction is None


@pytest.mark.parametrize(
    "events",
    [
        [token(0, "1"), token(2, "2"), JobEvent(3, "done", "")],  # a lost publish
        [token(0, "1"), token(1, "2")],  # no final event
        [token(0, "1"), JobEvent(1, "error", "")],
        [token(1, "1"), JobEvent(2, "done", "")],
    ],
)
def test_a_stream_that_is_not_whole_makes_no_entry(events: list[JobEvent]) -> None:
    result = JobResult(text="12", finish_reason="length")
    assert entry_of(events, result, Usage()) is None


def test_extraction_entry_holds_its_answer_events() -> None:
    answer = Answer(text="12", finish_reason="stop", usage=Usage(), timings={"ttft_ms": 5.0})
    event = AnswerEvent(index=1, question="total", answer=answer)
    events = [token(0, "12"), JobEvent(1, "answer", event.model_dump_json())]
    result = ExtractionResult(answers={"total": answer})
    entry = entry_of([*events, JobEvent(2, "done", "")], result, Usage())
    assert entry is not None and entry.extraction == result and entry.result is None
    assert [name for name, _ in entry.events] == ["token", "answer"]
