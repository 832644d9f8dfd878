"""The worker's decode loop against raw llama-cpp-python, on real models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llama_cpp import Llama

from shared.llm import load_llama, render_prompt
from shared.schemas import JobRequest
from shared.settings import Settings
from shared.submission import work_order_for
from tests.conftest import DATA_DIR
from worker.engine import Engine, Generation

DOC = "The warehouse in Lyon received 42 crates of pears on Monday and 17 on Tuesday. "


def _settings(model: str) -> Settings:
    return Settings(model=model, data_dir=DATA_DIR, n_ctx=1024)


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    llama = load_llama(_settings(request.param))
    yield Engine(llama, chunk_tokens=64)
    llama.close()


def run(engine: Engine, prompt: str, max_tokens: int = 24) -> tuple[str, int]:
    request = JobRequest(prompt=prompt, max_tokens=max_tokens, temperature=0)
    order = work_order_for(engine.llama, request, n_ctx=engine.n_ctx, default_max_tokens=16)
    generation = engine.generate(order, lambda _i, _t: False)
    return generation.result.text, generation.usage.cached_tokens


def raw(llama: Llama, prompt: str, max_tokens: int = 24) -> str:
    llama.reset()
    out = llama.create_completion(prompt, max_tokens=max_tokens, temperature=0)
    text: str = out["choices"][0]["text"]  # type: ignore[index]
    return text


def test_greedy_output_equals_raw_llama_cpp(engine: Engine) -> None:
    prompt = DOC + "Question: how many crates arrived in total? Answer:"
    ours, _ = run(engine, prompt)
    assert ours == raw(engine.llama, prompt)


def test_memory_reuse_never_changes_the_output(engine: Engine) -> None:
    first = DOC * 6 + "Summarise:"
    second = DOC * 6 + "List the days:"
    engine.forget()
    cold_second, _ = run(engine, second)
    run(engine, first)
    warm_second, cached = run(engine, second)
    assert warm_second == cold_second
    # Sliding window: a shorter shared prefix cannot be cut out of a longer memory.
    assert (cached > 0) == engine.truncatable
    again, _ = run(engine, second)
    assert again == cold_second


def test_chat_template_rendering_matches_llama_cpp(engine: Engine) -> None:
    if not engine.llama.metadata.get("tokenizer.chat_template"):
        pytest.skip("model ships no chat template")
    messages = [{"role": "user", "content": "Name a fruit."}]
    request = JobRequest.model_validate({"messages": messages, "max_tokens": 12, "temperature": 0})
    prompt = render_prompt(engine.llama, request)
    order = work_order_for(engine.llama, request, n_ctx=engine.n_ctx, default_max_tokens=16)
    ours = engine.generate(order, lambda _i, _t: False).result.text
    engine.llama.reset()
    reference = engine.llama.create_chat_completion(messages, max_tokens=12, temperature=0)
    assert ours == reference["choices"][0]["message"]["content"]  # type: ignore[index]
    assert prompt.text.endswith("assistant\n")


Published = list[tuple[int | None, str]]


def _generate(
    engine: Engine, prompt: str, max_tokens: int, streamed: list[int]
) -> tuple[Generation, Published]:
    """A generation and what it published: (token id or None, text) per event."""
    request = JobRequest(prompt=prompt, max_tokens=max_tokens, temperature=0)
    order = work_order_for(engine.llama, request, n_ctx=engine.n_ctx, default_max_tokens=16)
    events: Published = []

    def publish(token: int | None, text: str) -> bool:
        events.append((token, text))
        return False

    return engine.generate(order, publish, streamed), events


def test_a_resumed_generation_decodes_only_after_the_streamed_tokens(engine: Engine) -> None:
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


def test_a_resumed_generation_that_had_reached_its_end_decodes_nothing(engine: Engine) -> None:
    prompt = DOC + "Write a short poem about pears:"
    engine.forget()
    cold, cold_events = _generate(engine, prompt, 8, [])
    ids = [t for t, _ in cold_events if t is not None]
    done, events = _generate(engine, prompt, 8, ids)
    assert [t for t, _ in events if t is not None] == []
    assert done.result == cold.result
