"""The engine (the Conclave) against raw llama-cpp-python, on real models, one job at a time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from llama_cpp import Llama

from shared.llm import document_prompts, load_llama, render_prompt
from shared.schemas import DocumentFields, JobRequest
from shared.settings import Settings
from shared.submission import work_order_for
from tests.conftest import DATA_DIR
from worker.conclave.engine import ConclaveEngine
from worker.conclave.streams import Ended, Started, StreamHandle, StreamRequest, Token
from worker.kernels import prompt_chunk_kernels
from worker.main import build_conclave
from worker.model import memory_is_truncatable
from worker.outcomes import Generation
from worker.prompt_breaks import chunk_breaks

DOC = "The warehouse in Lyon received 42 crates of pears on Monday and 17 on Tuesday. "


def _settings(model: str) -> Settings:
    return Settings(
        model=model,
        data_dir=DATA_DIR,
        n_ctx=1024,
        cache={"enabled": False, "block_tokens": 64},
        worker={"max_active_jobs": 1},
    )


class Pair:
    """The engine as a worker builds it, and a plain Llama of the same model for reference."""

    def __init__(self, model: str) -> None:
        self.engine = build_conclave(_settings(model))
        self.raw = load_llama(_settings(model))

    def close(self) -> None:
        self.engine.close()
        self.raw.close()


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    built = Pair(request.param)
    yield built
    built.close()


def run(engine: ConclaveEngine, prompt: str, max_tokens: int = 24) -> tuple[str, int]:
    request = JobRequest(prompt=prompt, max_tokens=max_tokens, temperature=0)
    order = work_order_for(engine.llama, request, n_ctx=engine.n_ctx, default_max_tokens=16)
    generation = engine.generate(order, lambda _i, _t: False)
    return generation.result.text, generation.usage.cached_tokens


def raw(llama: Llama, prompt: str, max_tokens: int = 24) -> str:
    llama.reset()
    out = llama.create_completion(prompt, max_tokens=max_tokens, temperature=0)
    text: str = out["choices"][0]["text"]  # type: ignore[index]
    return text


def test_greedy_output_equals_raw_llama_cpp(pair: Pair) -> None:
    prompt = DOC + "Question: how many crates arrived in total? Answer:"
    pair.engine.forget()
    ours, _ = run(pair.engine, prompt)
    assert ours == raw(pair.raw, prompt)


def test_memory_reuse_never_changes_the_output(pair: Pair) -> None:
    engine = pair.engine
    first = DOC * 6 + "Summarise:"
    second = DOC * 6 + "List the days:"
    engine.forget()
    cold_second, _ = run(engine, second)
    run(engine, first)
    warm_second, cached = run(engine, second)
    assert warm_second == cold_second
    # Sliding window: a shorter shared prefix cannot be cut out of a longer memory.
    assert (cached > 0) == memory_is_truncatable(engine.llama)
    again, _ = run(engine, second)
    assert again == cold_second


@pytest.mark.needs("chat_template")
def test_chat_template_rendering_matches_llama_cpp(pair: Pair) -> None:
    engine = pair.engine
    assert engine.llama.metadata.get("tokenizer.chat_template")
    messages = [{"role": "user", "content": "Name a fruit."}]
    request = JobRequest.model_validate({"messages": messages, "max_tokens": 12, "temperature": 0})
    prompt = render_prompt(engine.llama, request)
    order = work_order_for(engine.llama, request, n_ctx=engine.n_ctx, default_max_tokens=16)
    ours = engine.generate(order, lambda _i, _t: False).result.text
    pair.raw.reset()
    # The kernels granary reads prompt chunks with; its decode steps, lone rows of a short
    # context, take the same path either way.
    with prompt_chunk_kernels():
        reference = pair.raw.create_chat_completion(messages, max_tokens=12, temperature=0)
    assert ours == reference["choices"][0]["message"]["content"]  # type: ignore[index]
    assert prompt.text.endswith("assistant\n")


Published = list[tuple[int | None, str]]


def _generate(
    engine: ConclaveEngine, prompt: str, max_tokens: int, streamed: list[int]
) -> tuple[Generation, Published]:
    """A generation and what it published: (token id or None, text) per event."""
    request = JobRequest(prompt=prompt, max_tokens=max_tokens, temperature=0)
    order = work_order_for(engine.llama, request, n_ctx=engine.n_ctx, default_max_tokens=16)
    events: Published = []

    def publish(token: int | None, text: str) -> bool:
        events.append((token, text))
        return False

    return engine.generate(order, publish, streamed), events


def test_a_resumed_generation_decodes_only_after_the_streamed_tokens(pair: Pair) -> None:
    engine = pair.engine
    prompt = DOC + "Write a short poem about pears:"
    engine.forget()
    cold, cold_events = _generate(engine, prompt, 16, [])
    ids = [t for t, _ in cold_events if t is not None]
    assert len(ids) == 16 and cold.result.finish_reason == "length"
    engine.forget()
    resumed, events = _generate(engine, prompt, 16, ids[:6])
    # Only the rest is published; the text holds the streamed part, which is not sent again.
    assert len([t for t, _ in events if t is not None]) == 10
    streamed_text = "".join(text for _, text in cold_events[:6])
    assert resumed.result.text.startswith(streamed_text)
    assert resumed.result.text == streamed_text + "".join(text for _, text in events)
    assert resumed.usage.resumed_tokens == 6 and resumed.usage.completion_tokens == 16
    assert resumed.usage.prompt_tokens == cold.usage.prompt_tokens


def test_a_resumed_generation_that_had_reached_its_end_decodes_nothing(pair: Pair) -> None:
    engine = pair.engine
    prompt = DOC + "Write a short poem about pears:"
    engine.forget()
    cold, cold_events = _generate(engine, prompt, 8, [])
    ids = [t for t, _ in cold_events if t is not None]
    done, events = _generate(engine, prompt, 8, ids)
    assert [t for t, _ in events if t is not None] == []
    assert done.result == cold.result


# An extraction's questions: streams forked from its held document prefix, decoded together.
# Gemma-3: a document past its 512-token sliding window, so the window slides in every fork.
def ledger(lines: int) -> str:
    return "\n".join(
        f"Crate {i} holds {i * 7 % 13 + 1} pears, checked on day {i % 6 + 1}." for i in range(lines)
    )


QUESTIONS = ["How many pears are in crate 5?", "Which day was crate 9 checked?", "Sum crate 2?"]


def _stream(
    engine: ConclaveEngine, tokens: list[int], prefix: int, **kwargs: Any
) -> tuple[StreamHandle, list[int]]:
    breaks = chunk_breaks(prefix, limit=len(tokens) - 1)
    request = StreamRequest(tokens, breaks, None, 0, **({"max_new": 12} | kwargs))
    out: list[int] = []

    def keep(token: Token) -> bool:
        out.append(token.token)
        return False

    return engine.conclave.submit(engine.conclave.handle(request, keep)), out


def _tokens(handle: StreamHandle, out: list[int]) -> list[int]:
    with handle:
        assert isinstance(handle.next(timeout=300), Started)
        assert isinstance(handle.next(timeout=300), Ended)
    return out


def test_questions_forked_from_a_held_document_answer_as_alone(pair: Pair) -> None:
    engine = pair.engine
    # A sliding window's document must reach past Gemma-3's window of 512 cells; other
    # models gain nothing from a longer one.
    sliding = not memory_is_truncatable(engine.llama)
    document = ledger(40 if sliding else 16)
    fields = DocumentFields(document=document, instructions="Answer from the ledger, briefly.")
    prefix, tails = document_prompts(engine.llama, fields, QUESTIONS)
    assert len(prefix) > (512 if sliding else 192)
    alone = []
    for tail in tails:
        engine.forget()
        alone.append(_tokens(*_stream(engine, [*prefix, *tail], len(prefix))))
    engine.forget()
    head = [*prefix, *tails[0]]
    held, _ = _stream(engine, head, len(prefix), max_new=0, end=len(prefix), hold=True)
    with held:
        assert isinstance(held.next(timeout=300), Started)
        assert isinstance(held.next(timeout=300), Ended)  # the document is in memory
        runs = [_stream(engine, [*prefix, *tail], len(prefix)) for tail in tails]
        together = [_tokens(*run) for run in runs]
    assert together == alone
    assert all(len(tokens) > 0 for tokens in alone)
