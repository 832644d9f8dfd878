"""Where prompts without a declared document end prefill chunks (worker/prompt_breaks.py), read
off real vocabularies: the breaks land where two prompts about one document part."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llama_cpp import Llama

from shared.llm import load_llama, render_prompt, tokenize
from shared.prefix_cache import common_prefix_len
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.conftest import DATA_DIR
from worker.prompt_breaks import MIN_STRETCH, MIN_TAIL, content_breaks

PAGE = "\n\n".join(
    " ".join(f"Shelf {i} holds {i * 3} crates of plums." for i in range(k, k + 6))
    for k in (0, 6, 12)
)
SYSTEM = "You answer questions about warehouse pages. " * 6


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def llama(request: pytest.FixtureRequest) -> Iterator[Llama]:
    model = load_llama(Settings(model=request.param, data_dir=DATA_DIR), vocab_only=True)
    yield model
    model.close()


def tokens_of(llama: Llama, request: JobRequest) -> list[int]:
    return tokenize(llama, render_prompt(llama, request))


def plain(question: str) -> JobRequest:
    return JobRequest(prompt=f"{PAGE}\n\nQuestion: {question}\nAnswer:")


def chat(question: str) -> JobRequest:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{PAGE}\n\n{question}"},
    ]
    return JobRequest.model_validate({"messages": messages})


def test_a_plain_prompt_breaks_where_its_question_starts(llama: Llama) -> None:
    one, two = (tokens_of(llama, plain(q)) for q in ("Which shelf?", "How many plums in all?"))
    shared = common_prefix_len(one, two)
    (last,) = content_breaks(llama, one)
    assert last == max(content_breaks(llama, two))
    # The question's first word ("Question") is shared too: the break is right before it.
    assert 0 < shared - last <= 4
    assert llama.detokenize(one[last:]).decode().startswith("Question")


@pytest.mark.needs("chat_template")
def test_a_chat_breaks_after_the_system_prompt_and_before_the_question(llama: Llama) -> None:
    assert llama.metadata.get("tokenizer.chat_template")
    one, two = (tokens_of(llama, chat(q)) for q in ("Which shelf?", "How many plums in all?"))
    breaks = content_breaks(llama, one)
    assert breaks == content_breaks(llama, two)[: len(breaks)]
    user_start, question = breaks[-2:]
    assert "You answer" not in llama.detokenize(one[user_start:]).decode()
    assert llama.detokenize(one[question:]).decode().startswith("Which shelf?")
    assert 0 <= common_prefix_len(one, two) - question <= 4


@pytest.mark.needs("chat_template")
def test_a_document_in_a_system_message_breaks_where_the_question_starts(llama: Llama) -> None:
    """OpenAI clients send the document as a message of its own and a short question after it:
    a chunk ends where the question's words start, so the next question reads only them (not
    the turn markers and role line between the two messages, which every question shares)."""
    assert llama.metadata.get("tokenizer.chat_template")

    def asked(question: str) -> list[int]:
        messages = [{"role": "system", "content": PAGE}, {"role": "user", "content": question}]
        return tokens_of(llama, JobRequest.model_validate({"messages": messages}))

    one, two = asked("Which shelf?"), asked("How many plums in all?")
    question = max(content_breaks(llama, one))
    assert question == max(content_breaks(llama, two))
    # Before the role line's last token, its newline (see the next test).
    assert common_prefix_len(one, two) == question + 1
    assert llama.detokenize(one[question:]).decode().startswith("\nWhich shelf?")
    assert "crates of plums." in llama.detokenize(one[:question]).decode()
    # The last message's end is followed by the turn markers alone: no break there.
    long_question = asked(PAGE.replace("\n\n", " ") + " Which shelf?")
    assert max(content_breaks(llama, long_question)) < len(long_question) - MIN_TAIL


@pytest.mark.needs("chat_template")
def test_a_conversations_next_turn_breaks_where_the_last_turn_stopped_its_prefill(
    llama: Llama,
) -> None:
    """A prompt's prefill stops before its last token, the newline of the answering role's
    line; the next turn, which holds that prompt and then the answer, breaks right there."""
    assert llama.metadata.get("tokenizer.chat_template")
    turn = [{"role": "system", "content": PAGE}, {"role": "user", "content": "Which shelf?"}]
    answer = {"role": "assistant", "content": "Shelf 3 holds the most crates of plums."}
    last = tokens_of(llama, JobRequest.model_validate({"messages": turn}))
    following = [*turn, answer, {"role": "user", "content": "And the fewest?"}]
    next_turn = tokens_of(llama, JobRequest.model_validate({"messages": following}))
    assert next_turn[: len(last)] == last
    assert len(last) - 1 in content_breaks(llama, next_turn)


def test_short_stretches_and_single_paragraphs_get_no_breaks(llama: Llama) -> None:
    assert content_breaks(llama, tokens_of(llama, JobRequest(prompt="Hi.\n\nHow are you?"))) == ()
    one_paragraph = " ".join(f"Shelf {i} holds {i * 3} crates." for i in range(30))
    assert content_breaks(llama, tokens_of(llama, JobRequest(prompt=one_paragraph))) == ()
    for position in content_breaks(llama, tokens_of(llama, plain("Which shelf?"))):
        assert position >= MIN_STRETCH
