"""Many questions about one document, decoded together, against single-question runs.

The reference for a question is what the worker does for one prompt: the prefix's exact
snapshot restored (the same cells a cold prefill computes), the question's tail prefilled in
canonical chunks, then Llama.generate, greedy.

A question alone in its wave is computed by exactly the batches of a lone run: bitwise equal.
With several, each question's cells sit at other cache positions and its tokens share decode
batches, so llama.cpp's CPU kernels round differently and logits move a little (measured on the
first answer token: at most 0.38 on Qwen2.5-0.5B, 1.1 on SmolLM2 and Gemma-3, of a ~35 range).
Greedy answers then stay identical except where the lone run's top two logits were that close.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import llama_cpp
import numpy as np
import pytest
from llama_cpp import Llama

from shared.errors import ContextOverflow
from shared.llm import load_llama, render_prompt, tokenize
from shared.prefix_cache import common_prefix_len
from shared.schemas import JobRequest
from shared.settings import Settings
from shared.submission import work_order_for
from tests.conftest import DATA_DIR
from worker import kv_state
from worker.engine import Engine
from worker.kernels import prompt_chunk_kernels
from worker.multi_sequence import (
    Answer,
    DoesNotFit,
    OnToken,
    Question,
    Unsupported,
    answer_questions,
    cells_needed,
    load_multi_sequence_llama,
    plan_waves,
    sample,
)
from worker.speculation.decoder import FixedDraft
from worker.speculation.drafting import Drafting
from worker.speculation.sources import NgramLookup

CHUNK = 64
MAX_TOKENS = 16
CITIES = ["Lyon", "Porto", "Graz", "Turin", "Ghent", "Bergen", "Cork", "Brno"]
FRUIT = ["pears", "apples", "plums", "figs", "cherries", "lemons", "grapes", "melons"]


def _document(lines: int) -> str:
    return "\n".join(
        f"- The depot in {CITIES[i % 8]} received {(i * 37) % 90 + 10} crates of "
        f"{FRUIT[(i * 3) % 8]} on day {i + 1}."
        for i in range(lines)
    )


def _question(i: int) -> str:
    where = f"the depot in {CITIES[i % 8]} receive on day {i + 1}"
    return f"How many crates did {where}?" if i % 2 == 0 else f"Which fruit did {where}?"


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    finish: str
    first_logits: np.ndarray
    # Top-1 minus top-2 logit at each step: how far rounding must move to flip the choice.
    margins: list[float]


@dataclass
class Bench:
    """A model loaded twice (multi-sequence and plain) and one document with its questions."""

    multi: Llama
    single: Llama
    prefix: list[int]
    tails: list[list[int]]
    prefix_state: bytes
    tolerance: float  # how far batching may move a logit on this model
    references: dict[tuple[int, int], Reference] = field(default_factory=dict)

    def questions(self, indices: Iterable[int], max_tokens: int = MAX_TOKENS) -> list[Question]:
        return [Question(self.tails[i], max_tokens) for i in indices]

    def ask(
        self,
        questions: Sequence[Question],
        on_token: OnToken | None = None,
        keep_first_logits: bool = False,
    ) -> list[Answer]:
        self.assert_prefix_alone()
        answers = answer_questions(self.multi, questions, CHUNK, on_token, keep_first_logits)
        self.assert_prefix_alone()
        return answers

    def assert_prefix_alone(self) -> None:
        """Sequence 0 holds exactly the prefix, every other sequence is empty."""
        mem = llama_cpp.llama_get_memory(self.multi.ctx)
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == len(self.prefix) - 1
        others = range(1, llama_cpp.llama_n_seq_max(self.multi.ctx))
        assert all(llama_cpp.llama_memory_seq_pos_max(mem, s) == -1 for s in others)

    def reference(self, i: int, max_tokens: int = MAX_TOKENS) -> Reference:
        if (i, max_tokens) not in self.references:
            self.references[i, max_tokens] = self._single_run(self.tails[i], max_tokens)
        return self.references[i, max_tokens]

    def _single_run(self, tail: list[int], max_tokens: int) -> Reference:
        llama = self.single
        tokens = self.prefix + tail
        assert kv_state.restore(llama, self.prefix_state, self.prefix, len(self.prefix))
        _prefill(llama, tokens, len(self.prefix), len(tokens) - 1)
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        out: list[int] = []
        margins: list[float] = []
        finish, first = "length", None
        generator = llama.generate(tokens[-1:], temp=0, reset=False)
        for token in generator:
            # Still the logits `token` was sampled from: it is not decoded yet.
            logits = _logits(llama, -1)
            if first is None:
                first = logits.copy()
            top = np.partition(logits, -2)[-2:]
            margins.append(float(top[1] - top[0]))
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                finish = "stop"
                break
            out.append(token)
            if len(out) >= max_tokens:
                break
        generator.close()
        assert first is not None
        return Reference(out, finish, first, margins)


def _logits(llama: Llama, row: int) -> np.ndarray:
    pointer = llama_cpp.llama_get_logits_ith(llama.ctx, row)
    return np.ctypeslib.as_array(pointer, shape=(llama.n_vocab(),))


def _prefill(llama: Llama, tokens: list[int], start: int, end: int) -> None:
    """Llama.eval in canonical chunks, ending at multiples of CHUNK and at `end`, on the
    kernels the engines read prompt chunks with."""
    position = start
    while position < end:
        chunk_end = min(position - position % CHUNK + CHUNK, end)
        with prompt_chunk_kernels():
            llama.eval(tokens[position:chunk_end])
        position = chunk_end


def _prompts(llama: Llama, lines: int, n: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix and each question's tail, split where the rendered prompts diverge."""
    document = _document(lines)
    prompts = []
    for i in range(n):
        content = f"Answer in one short sentence.\n\nDocument:\n{document}\n\n{_question(i)}"
        if llama.metadata.get("tokenizer.chat_template"):
            request = JobRequest.model_validate(
                {"messages": [{"role": "user", "content": content}]}
            )
        else:
            request = JobRequest(prompt=f"{content}\nAnswer:")
        prompts.append(tokenize(llama, render_prompt(llama, request)))
    shared = min(common_prefix_len(prompts[0], p) for p in prompts[1:])
    return prompts[0][:shared], [p[shared:] for p in prompts]


def _bench(model: str, n_ctx: int, n_seq_max: int, lines: int, tolerance: float) -> Iterator[Bench]:
    settings = Settings(model=model, data_dir=DATA_DIR, n_ctx=n_ctx)
    multi = load_multi_sequence_llama(settings, n_seq_max)
    single = load_llama(settings)
    prefix, tails = _prompts(single, lines, 16)
    _prefill(single, prefix, 0, len(prefix))
    state, _ = kv_state.capture(single)
    # The multi-sequence side prefills its own prefix, as a worker without the cache would.
    _prefill(multi, prefix, 0, len(prefix))
    yield Bench(multi, single, prefix, tails, state, tolerance)
    multi.close()
    single.close()


def _first(answer: Answer) -> np.ndarray:
    assert answer.first_logits is not None
    return answer.first_logits


def _assert_like_single_runs(
    bench: Bench,
    answers: list[Answer],
    max_tokens: int = MAX_TOKENS,
    min_identical: float = 0.5,
) -> None:
    """Logits within the model's tolerance; answers identical unless a near-tie flipped them.

    Answers are for questions 0, 1, 2, ... in order.
    """
    identical = 0
    for i, answer in enumerate(answers):
        reference = bench.reference(i, max_tokens)
        if answer.first_logits is not None:
            assert np.abs(answer.first_logits - reference.first_logits).max() < bench.tolerance
        if answer.tokens == reference.tokens:
            identical += 1
            continue
        # Rounding moves each logit by less than the tolerance: only a closer race can flip.
        step = common_prefix_len(answer.tokens, reference.tokens)
        assert reference.margins[step] < 2 * bench.tolerance, (i, step, reference.margins[step])
    assert identical >= min_identical * len(answers)


@pytest.fixture(scope="module")
def qwen() -> Iterator[Bench]:
    yield from _bench("qwen2.5-0.5b", n_ctx=1024, n_seq_max=17, lines=14, tolerance=0.5)


@pytest.fixture(scope="module")
def smollm() -> Iterator[Bench]:
    yield from _bench("smollm2-135m", n_ctx=1024, n_seq_max=9, lines=14, tolerance=1.5)


@pytest.fixture(scope="module")
def gemma() -> Iterator[Bench]:
    # Longer than Gemma-3's 512-token sliding window, so the window actually slides.
    yield from _bench("gemma3-270m", n_ctx=2048, n_seq_max=9, lines=36, tolerance=1.5)


# Wave planning and sampling: pure functions.


def test_waves_hold_at_most_n_seq_max_minus_one_questions() -> None:
    assert plan_waves(100, [10] * 5, n_ctx=1000, n_seq_max=3) == [[0, 1], [2, 3], [4]]
    assert plan_waves(100, [10] * 5, n_ctx=1000, n_seq_max=8) == [[0, 1, 2, 3, 4]]


def test_waves_fit_the_context_next_to_the_prefix_first_fit() -> None:
    # Budget 100 per wave: 60 opens wave 0, the next 60 wave 1; 30 and 40 fill the gaps.
    assert plan_waves(100, [60, 60, 30, 40], n_ctx=200, n_seq_max=8) == [[0, 2], [1, 3]]
    assert plan_waves(100, [100, 100], n_ctx=200, n_seq_max=8) == [[0], [1]]


def test_a_question_that_cannot_fit_reports_by_how_much() -> None:
    with pytest.raises(DoesNotFit) as raised:
        plan_waves(100, [50, 101, 300], n_ctx=200, n_seq_max=8)
    assert (raised.value.question, raised.value.overflow) == (1, 1)
    assert isinstance(raised.value, ContextOverflow)
    assert plan_waves(0, [], n_ctx=200, n_seq_max=2) == []
    with pytest.raises(ValueError):
        plan_waves(100, [1], n_ctx=200, n_seq_max=1)


def test_cells_needed_counts_the_prefix_once() -> None:
    questions = [Question([1, 2, 3], max_tokens=5), Question([4], max_tokens=2)]
    assert cells_needed(100, questions) == 100 + 8 + 3


def test_sampling() -> None:
    logits = np.array([0.0, 3.0, 2.9, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, 0.0, 1.0, rng) == 1
    # A nucleus this small holds only the most likely token.
    assert {sample(logits, 1.0, 0.01, rng) for _ in range(50)} == {1}
    assert {sample(logits, 1.0, 0.9, rng) for _ in range(200)} == {1, 2}
    draws = [sample(logits, 5.0, 1.0, np.random.default_rng(7)) for _ in range(3)]
    assert len(set(draws)) == 1


# Qwen2.5-0.5B: the reference model for identical greedy answers.


@pytest.mark.qwen
@pytest.mark.parametrize("n", [1, 4, 16])
def test_qwen_greedy_answers_equal_single_question_runs(qwen: Bench, n: int) -> None:
    answers = qwen.ask(qwen.questions(range(n)), keep_first_logits=True)
    _assert_like_single_runs(qwen, answers, min_identical=1.0)
    for i, answer in enumerate(answers):
        assert answer.finish_reason == qwen.reference(i).finish
    if n == 1:
        assert np.array_equal(_first(answers[0]), qwen.reference(0).first_logits)
        assert answers[0].tokens == qwen.reference(0).tokens


@pytest.mark.qwen
def test_qwen_questions_beyond_the_context_run_in_waves(qwen: Bench) -> None:
    # Room for 200 answer tokens each: only three fit next to the prefix at once.
    questions = qwen.questions(range(6), max_tokens=200)
    waves = plan_waves(len(qwen.prefix), [q.cells for q in questions], qwen.multi.n_ctx(), 17)
    assert waves == [[0, 1, 2], [3, 4, 5]]
    answers = qwen.ask(questions, keep_first_logits=True)
    _assert_like_single_runs(qwen, answers, max_tokens=200, min_identical=1.0)
    assert all(a.finish_reason == "stop" for a in answers)


# SmolLM2: batched decoding changes rounding and the model has near-ties.


def test_smollm2_first_token_logits_match_single_runs(smollm: Bench) -> None:
    answers = smollm.ask(smollm.questions(range(8)), keep_first_logits=True)
    _assert_like_single_runs(smollm, answers)


def test_one_question_is_exactly_a_single_run(smollm: Bench) -> None:
    for i in (2, 5):
        [answer] = smollm.ask(smollm.questions([i]), keep_first_logits=True)
        assert np.array_equal(_first(answer), smollm.reference(i).first_logits)
        assert answer.tokens == smollm.reference(i).tokens


def test_a_question_that_cannot_fit_raises_before_touching_memory(smollm: Bench) -> None:
    n_ctx = smollm.multi.n_ctx()
    long_tail = smollm.tails[1] * 40
    questions = [*smollm.questions([0]), Question(long_tail, max_tokens=100)]
    with pytest.raises(DoesNotFit) as raised:
        smollm.ask(questions)
    assert raised.value.question == 1
    assert raised.value.overflow == len(smollm.prefix) + len(long_tail) + 100 - n_ctx


def test_on_token_stops_one_question_and_sees_every_token(smollm: Bench) -> None:
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def on_token(question: int, token: int) -> bool:
        seen[question].append(token)
        return question == 1 and len(seen[1]) == 3

    answers = smollm.ask(smollm.questions(range(3)), on_token=on_token)
    assert [a.tokens for a in answers] == [seen[0], seen[1], seen[2]]
    assert len(answers[1].tokens) == 3 and answers[1].finish_reason == "stop"
    assert answers[0].finish_reason == "length" and len(answers[0].tokens) == MAX_TOKENS


def test_sampling_is_reproducible_per_seed_and_timed(smollm: Bench) -> None:
    def ask() -> list[Answer]:
        questions = [
            Question(smollm.tails[i], MAX_TOKENS, temperature=0.9, top_p=0.9, seed=i)
            for i in range(4)
        ]
        return smollm.ask(questions)

    first, second = ask(), ask()
    assert [a.tokens for a in first] == [a.tokens for a in second]
    for answer in first:
        assert answer.ttft_ms is not None and answer.ttft_ms > 0
        assert answer.decode_tokens_per_s is not None and answer.decode_tokens_per_s > 0


def test_a_plain_context_is_refused(smollm: Bench) -> None:
    with pytest.raises(Unsupported, match="unified"):
        answer_questions(smollm.single, smollm.questions([0]), CHUNK)


def test_single_prompt_jobs_run_unchanged_on_a_multi_sequence_context() -> None:
    settings = Settings(model="smollm2-135m", data_dir=DATA_DIR, n_ctx=1024)
    plain = load_llama(settings)
    multi = load_multi_sequence_llama(settings, 4)
    assert llama_cpp.llama_n_seq_max(multi.ctx) == 4 and multi.n_ctx() == 1024
    request = JobRequest(prompt=_document(12) + "\nSummary:", max_tokens=24, temperature=0)
    on_multi = Engine(multi, chunk_tokens=CHUNK)
    runs = []
    for engine in (Engine(plain, chunk_tokens=CHUNK), on_multi, on_multi):
        order = work_order_for(engine.llama, request, n_ctx=1024, default_max_tokens=24)
        runs.append(engine.generate(order, lambda _i, _t: False))
    assert runs[0].result.text == runs[1].result.text == runs[2].result.text
    assert runs[2].usage.cached_tokens > 0
    plain.close()
    multi.close()


# Gemma-3: sliding-window attention memory forks too (a full-size SWA cache is the default).


@pytest.mark.gemma
def test_gemma_sliding_window_memory_forks_and_answers_like_single_runs(gemma: Bench) -> None:
    assert len(gemma.prefix) > llama_cpp.llama_model_n_swa(gemma.multi.model)
    answers = gemma.ask(gemma.questions(range(8)), keep_first_logits=True)
    # Gemma's answers here race often: 6 of 8 came out identical on stock kernels, 5 of 8 on
    # the row-invariant ones (the same questions, the rest parting only at near ties). What
    # must hold is the rule inside: every difference starts at a near tie.
    _assert_like_single_runs(gemma, answers)
    [alone] = gemma.ask(gemma.questions([0]), keep_first_logits=True)
    assert np.array_equal(_first(alone), gemma.reference(0).first_logits)
    # On the row-invariant kernels this answer parts from the single run at its 7th token, at a
    # near tie (on stock kernels it did not part; the cause is not isolated: its cells sit in
    # the shared buffer beside the prefix's). What must hold is that it parts only at one.
    _assert_like_single_runs(gemma, [alone], min_identical=0)


# Drafting inside the wave: each question drafts from the document and its own answer.


def _drafting(bench: Bench, indices: Sequence[int], k: int) -> Drafting:
    sources = [NgramLookup(bench.prefix + bench.tails[i]) for i in indices]
    return Drafting(sources, FixedDraft(k))


@pytest.mark.qwen
def test_qwen_drafted_answers_equal_single_question_runs(qwen: Bench) -> None:
    # Answers quote the document's lines ("The depot in Lyon received..."): drafts match.
    drafting = _drafting(qwen, range(8), k=4)
    answers = answer_questions(qwen.multi, qwen.questions(range(8)), CHUNK, drafting=drafting)
    qwen.assert_prefix_alone()
    assert [a.tokens for a in answers] == [qwen.reference(i).tokens for i in range(8)]
    assert drafting.drafted > drafting.accepted > 0


def test_smollm2_drafted_answers_like_single_runs(smollm: Bench) -> None:
    drafting = _drafting(smollm, range(4), k=6)
    answers = answer_questions(
        smollm.multi, smollm.questions(range(4)), CHUNK, keep_first_logits=True, drafting=drafting
    )
    smollm.assert_prefix_alone()
    _assert_like_single_runs(smollm, answers)
    assert drafting.drafted > 0
