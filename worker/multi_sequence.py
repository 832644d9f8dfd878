"""One document, many questions: fork the document's memory once per question, decode together.

Sequence 0 of the context holds the shared prefix (instructions + document), prefilled or
restored by the caller. Each question gets a sequence of its own, forked from sequence 0 with
llama_memory_seq_cp: in a unified KV cache the fork shares the prefix's cells instead of copying
them, so N questions cost one prefix plus N tails. Each sequence prefills its own tail, then all
live sequences decode together, one token each per llama_decode, which is what makes N answers
cheaper than N runs: a CPU decode step reads every weight once whatever the batch holds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama
from llama_cpp import _internals as internals

from shared.errors import ContextOverflow, GranaryError
from shared.llm import load_llama, quiet_native_logs
from shared.settings import Settings
from worker.decode_batch import fill_batch, llama_batch
from worker.kernels import prompt_chunk_kernels
from worker.speculation.drafting import Drafting
from worker.speculation.near_tie import TIE_MARGIN, is_near_tie

PREFIX_SEQ = 0

# Called with (question index, generated token id); returns True to stop that question.
OnToken = Callable[[int, int], bool]
# Called with (question index, its answer) as soon as that question is done.
OnAnswer = Callable[[int, "Answer"], None]
Finish = Literal["stop", "length"]
Logits = npt.NDArray[np.float32]


class DoesNotFit(ContextOverflow):
    """A question's own tokens and answer cannot fit in the context next to the prefix."""

    def __init__(self, question: int, overflow: int) -> None:
        super().__init__(
            f"question {question} does not fit in the context next to the shared prefix: "
            f"{overflow} tokens too many"
        )
        self.question = question
        self.overflow = overflow


class Unsupported(GranaryError):
    """This model or context cannot fork one sequence's memory into several."""

    status_code = 501
    error_type = "unsupported"


@dataclass(frozen=True, slots=True)
class Question:
    # The prompt after the shared prefix; its last token is decoded with the answer's first step.
    tokens: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a question needs at least one token of its own")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

    @property
    def cells(self) -> int:
        """KV cells the question may occupy beyond the prefix."""
        return len(self.tokens) + self.max_tokens


@dataclass(frozen=True, slots=True)
class Answer:
    tokens: list[int]
    finish_reason: Finish
    ttft_ms: float | None  # from the start of `answer_questions`, earlier waves included
    decode_tokens_per_s: float | None
    first_logits: Logits | None = None  # only with keep_first_logits


def load_multi_sequence_llama(
    settings: Settings, n_seq_max: int, n_ctx: int | None = None, unified: bool = True
) -> Llama:
    """A Llama whose context holds `n_seq_max` sequences in one unified KV cache.

    Llama.__init__ only sets n_seq_max and kv_unified for embedding contexts, and creates its
    context before returning, so the context is replaced by one built from the same parameters
    with these two changed. Everything the Llama object tracks (n_ctx, input_ids, its batch)
    stays valid when the context size is the same; with `n_ctx` (a larger pool of cells shared
    by several jobs) only the raw context is used, never Llama.eval. Unified matters: with a
    stream per sequence each would hold only n_ctx / n_seq_max cells, too few for a long
    shared prefix.
    """
    if not 2 <= n_seq_max <= llama_cpp.llama_max_parallel_sequences():
        raise ValueError(
            f"n_seq_max must be between 2 and {llama_cpp.llama_max_parallel_sequences()}"
        )
    llama = load_llama(settings)
    params = llama.context_params
    params.n_seq_max = n_seq_max
    params.kv_unified = unified
    if n_ctx is not None:
        params.n_ctx = n_ctx
    with quiet_native_logs():
        context = internals.LlamaContext(model=llama._model, params=params, verbose=False)
    previous = llama._ctx
    llama._ctx = llama._stack.enter_context(contextlib.closing(context))
    # Free the first context's KV cache now; closing it again at llama.close() is a no-op.
    previous.close()
    return llama


def cells_needed(prefix_tokens: int, questions: Sequence[Question]) -> int:
    """KV cells for answering all questions at once."""
    return prefix_tokens + sum(q.cells for q in questions)


def plan_waves(
    prefix_tokens: int, cells: Sequence[int], n_ctx: int, n_seq_max: int
) -> list[list[int]]:
    """Group question indices into waves that each fit next to the prefix, in input order.

    A question goes into the first wave with room for it (first fit): a wave holds at most
    n_seq_max - 1 questions (sequence 0 keeps the prefix) and their cells add up to at most
    n_ctx - prefix_tokens.
    """
    if n_seq_max < 2:
        raise ValueError("n_seq_max must be at least 2: sequence 0 holds the prefix")
    budget = n_ctx - prefix_tokens
    for index, need in enumerate(cells):
        if need > budget:
            raise DoesNotFit(index, need - budget)
    waves: list[list[int]] = []
    room: list[int] = []
    for index, need in enumerate(cells):
        target = next(
            (w for w, wave in enumerate(waves) if room[w] >= need and len(wave) < n_seq_max - 1),
            None,
        )
        if target is None:
            waves.append([])
            room.append(budget)
            target = len(waves) - 1
        waves[target].append(index)
        room[target] -= need
    return waves


def check_supported(llama: Llama) -> None:
    """Raise Unsupported unless this context can fork sequence 0 into shared-cell sequences."""
    model = llama.model
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        # A recurrent state is one cell per sequence: forks copy it, never tested here.
        raise Unsupported("recurrent and hybrid models are not supported")
    if llama_cpp.llama_n_seq_max(llama.ctx) < 2 or not llama.context_params.kv_unified:
        raise Unsupported(
            "the context needs several sequences in a unified KV cache "
            "(load it with load_multi_sequence_llama)"
        )


def answer_questions(
    llama: Llama,
    questions: Sequence[Question],
    chunk_tokens: int,
    on_token: OnToken | None = None,
    keep_first_logits: bool = False,
    on_answer: OnAnswer | None = None,
    drafting: Drafting | None = None,
) -> list[Answer]:
    """Answer every question after the prefix that sequence 0 of `llama`'s memory holds.

    The prefix is whatever sequence 0 holds (its length is read from memory); the caller must
    have prefilled it in canonical chunks ending at its last token. Questions that do not fit
    together run in waves (plan_waves), one after another. Afterwards sequence 0 holds exactly
    the prefix again and every other sequence is empty, whatever was raised. With `drafting`,
    greedy questions draft their next tokens and verify them in the same decode step.
    """
    check_supported(llama)
    mem = llama_cpp.llama_get_memory(llama.ctx)
    n_seq_max = llama_cpp.llama_n_seq_max(llama.ctx)
    for seq in range(1, n_seq_max):
        llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
    prefix = llama_cpp.llama_memory_seq_pos_max(mem, PREFIX_SEQ) + 1
    # A decode step holds one token per question, and a llama_decode call at most n_batch.
    n_seq = min(n_seq_max, llama.n_batch + 1)
    waves = plan_waves(prefix, [q.cells for q in questions], llama.n_ctx(), n_seq)
    run = _Run(llama, mem, prefix, chunk_tokens, on_token, keep_first_logits, on_answer, drafting)
    answers: dict[int, Answer] = {}
    for wave in waves:
        streams = [_Stream(i, seq, questions[i], prefix) for seq, i in enumerate(wave, start=1)]
        for stream in run.wave(streams):
            answers[stream.index] = stream.answer(run.started)
    return [answers[i] for i in range(len(questions))]


@dataclass
class _Stream:
    """One question's sequence while its wave runs."""

    index: int
    seq: int
    question: Question
    pos: int  # where the next decoded token goes
    # Cells below this position hold what a lone run computes (prefilled or decoded alone).
    exact_until: int = 0
    generated: list[int] = field(default_factory=list)
    finish: Finish | None = None
    first_logits: Logits | None = None
    samples: int = 0
    first_at: float | None = None
    last_at: float | None = None
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.question.seed)

    @property
    def next_token(self) -> int:
        return self.generated[-1] if self.generated else self.question.tokens[-1]

    def token_at(self, pos: int) -> int:
        """The token whose cell is at `pos`, for positions after the shared prefix."""
        offset = pos - self.pos + len(self.generated)  # self.pos holds next_token
        if offset >= 0:
            return self.generated[offset - 1] if offset else self.question.tokens[-1]
        return self.question.tokens[offset - 1]

    def sample(self, logits: Logits) -> int:
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.samples += 1
        return sample(logits, self.question.temperature, self.question.top_p, self.rng)

    def answer(self, started: float) -> Answer:
        assert self.finish is not None
        ttft = None if self.first_at is None else (self.first_at - started) * 1000
        rate = None
        if self.first_at is not None and self.last_at is not None and self.last_at > self.first_at:
            # The first sample ends the prompt's work; each later one is one decode step.
            rate = (self.samples - 1) / (self.last_at - self.first_at)
        return Answer(self.generated, self.finish, ttft, rate, self.first_logits)


class _Run:
    def __init__(
        self,
        llama: Llama,
        mem: llama_cpp.llama_memory_t,
        prefix: int,
        chunk_tokens: int,
        on_token: OnToken | None,
        keep_first_logits: bool,
        on_answer: OnAnswer | None,
        drafting: Drafting | None,
    ) -> None:
        self.llama = llama
        self.drafting = drafting
        self.capacity = 0
        self.ctx = llama.ctx
        self.mem = mem
        self.prefix = prefix
        self.chunk_tokens = chunk_tokens
        self.on_token = on_token
        self.keep_first_logits = keep_first_logits
        self.on_answer = on_answer
        self.vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.started = time.perf_counter()
        self.tie_margin = TIE_MARGIN if drafting is None else drafting.tie_margin

    def wave(self, streams: list[_Stream]) -> list[_Stream]:
        step_rows = len(streams) * (1 + (self.drafting.max_draft if self.drafting else 0))
        n_batch = self.llama.n_batch
        self.capacity = max(min(self.chunk_tokens, n_batch), min(step_rows, n_batch), len(streams))
        try:
            with llama_batch(self.capacity) as batch:
                for stream in streams:
                    self._fork(stream)
                    self._prefill(batch, stream)
                live = streams
                while live:
                    self._step(batch, live)
                    live = [s for s in live if s.finish is None]
        finally:
            for stream in streams:
                llama_cpp.llama_memory_seq_rm(self.mem, stream.seq, -1, -1)
        return streams

    def _fork(self, stream: _Stream) -> None:
        llama_cpp.llama_memory_seq_cp(self.mem, PREFIX_SEQ, stream.seq, -1, -1)
        # A memory that ignored the copy would silently answer without the document.
        if (
            self.prefix
            and llama_cpp.llama_memory_seq_pos_max(self.mem, stream.seq) != self.prefix - 1
        ):
            raise Unsupported("this model's memory did not fork the prefix into a new sequence")

    def _prefill(self, batch: llama_cpp.llama_batch, stream: _Stream) -> None:
        """Decode the question's tokens but its last, in the chunks a single-question run uses.

        Chunks end at multiples of chunk_tokens and at the last-but-one token, and are split at
        n_batch like Llama.eval splits them, so every cell gets the values a lone run gives it.
        """
        tokens = stream.question.tokens
        end = self.prefix + len(tokens) - 1
        position = self.prefix
        while position < end:
            chunk_end = min(position - position % self.chunk_tokens + self.chunk_tokens, end)
            with prompt_chunk_kernels():
                for start in range(position, chunk_end, self.llama.n_batch):
                    stop = min(start + self.llama.n_batch, chunk_end)
                    pieces = [(tokens[p - self.prefix], p, stream.seq) for p in range(start, stop)]
                    fill_batch(batch, pieces, logits=False)
                    self._decode(batch)
            position = chunk_end
        stream.pos = stream.exact_until = end

    def _step(self, batch: llama_cpp.llama_batch, live: list[_Stream]) -> None:
        """Decode each live sequence's next token, and its draft if any, in one batch.

        A greedy row whose top two logits nearly tie is decided again alone
        (worker/speculation/near_tie.py), after the others: that decode overwrites the batch's
        logits.
        """
        drafts = self._drafts(live)
        rows = [
            (token, stream.pos + i, stream.seq)
            for stream, draft in zip(live, drafts, strict=True)
            for i, token in enumerate([stream.next_token, *draft])
        ]
        fill_batch(batch, rows, logits=True)
        self._decode(batch)
        ties: list[_Stream] = []
        row, accepted, emitted = 0, 0, 0
        for stream, draft in zip(live, drafts, strict=True):
            before = len(stream.generated)
            tie, right = self._verify(stream, draft, row, alone=len(rows) == 1)
            if tie:
                ties.append(stream)
            accepted += right
            emitted += len(stream.generated) - before
            row += 1 + len(draft)
        for stream in ties:
            self._replay_alone(batch, stream)
            self._take(stream, self._logits(0), alone=False)
            emitted += 1
        if self.drafting is not None:
            self.drafting.record(drafts, accepted, emitted, replayed=bool(ties))

    def _drafts(self, live: list[_Stream]) -> list[list[int]]:
        """Each sequence's guess at its next tokens (none when not drafting or sampling)."""
        if self.drafting is None:
            return [[] for _ in live]
        k = min(self.drafting.plan(), (self.capacity - len(live)) // len(live))
        drafts = []
        for stream in live:
            # Accepted drafts plus one token must stay within the answer's reserved cells.
            limit = min(k, stream.question.max_tokens - len(stream.generated) - 1)
            greedy = stream.question.temperature <= 0
            if greedy and k == 0:
                self.drafting.guess(stream.index)
            drafts.append(self.drafting.propose(stream.index, limit) if greedy else [])
        return drafts

    def _verify(self, stream: _Stream, draft: list[int], row: int, alone: bool) -> tuple[bool, int]:
        """Take the tokens this batch decided for `stream`: its next one, and each draft token
        while the draft was right. Returns (a near tie is left to decide alone, drafts right)."""
        # A lone row attending to batch-written cells is not a lone run's row either.
        batched = not alone or stream.exact_until < stream.pos
        greedy = stream.question.temperature <= 0
        for i in range(len(draft) + 1):
            logits = self._logits(row + i)
            if batched and greedy and is_near_tie(logits, self.tie_margin):
                return True, i
            token = self._take(stream, logits, alone)
            if stream.finish is not None:
                return False, i
            if i == len(draft) or token != draft[i]:
                # Cells from here on hold rejected guesses.
                llama_cpp.llama_memory_seq_rm(self.mem, stream.seq, stream.pos, -1)
                return False, i
        raise AssertionError("unreachable: the last row always decides")

    def _replay_alone(self, batch: llama_cpp.llama_batch, stream: _Stream) -> None:
        """Recompute, one token at a time, every cell of `stream` written by a batched step.

        Redoing only the tied row is not enough: the cells batched steps wrote before it hold
        slightly different values too. Afterwards the logits of row 0 are a lone run's.
        """
        begin = stream.exact_until
        llama_cpp.llama_memory_seq_rm(self.mem, stream.seq, begin, -1)
        for pos in range(begin, stream.pos + 1):
            fill_batch(batch, [(stream.token_at(pos), pos, stream.seq)], logits=pos == stream.pos)
            self._decode(batch)
        stream.exact_until = stream.pos + 1

    def _logits(self, row: int) -> Logits:
        pointer = llama_cpp.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def _take(self, stream: _Stream, logits: Logits, alone: bool) -> int:
        if self.keep_first_logits and stream.first_logits is None:
            stream.first_logits = logits.copy()
        if alone and stream.exact_until == stream.pos:
            stream.exact_until += 1  # decoded alone: as a lone run computes it
        stream.pos += 1
        token = stream.sample(logits)
        self._accept(stream, token)
        if self.drafting is not None and stream.finish is None:
            self.drafting.extend(stream.index, token)
        return token

    def _accept(self, stream: _Stream, token: int) -> None:
        if llama_cpp.llama_vocab_is_eog(self.vocab, token):
            stream.finish = "stop"
        else:
            stream.generated.append(token)
            if self.on_token is not None and self.on_token(stream.index, token):
                stream.finish = "stop"
            elif len(stream.generated) >= stream.question.max_tokens:
                stream.finish = "length"
        if stream.finish is not None:
            # The cells go back to the wave at once; seq 0's shared cells stay.
            llama_cpp.llama_memory_seq_rm(self.mem, stream.seq, -1, -1)
            if self.on_answer is not None:
                self.on_answer(stream.index, stream.answer(self.started))

    def _decode(self, batch: llama_cpp.llama_batch) -> None:
        status = llama_cpp.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")


def sample(logits: Logits, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Argmax at temperature 0, else a draw from the top_p nucleus of softmax(logits / T)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):
        scaled = logits.astype(np.float64) / temperature
    if not np.isfinite(scaled).all():  # a temperature this close to 0 is greedy
        return int(np.argmax(logits))
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p >= 1:
        return int(rng.choice(len(probs), p=probs))
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    # The smallest head of the ranking whose mass reaches top_p, never empty.
    keep = min(int(np.searchsorted(cumulative, top_p)) + 1, len(order))
    head = probs[order[:keep]]
    return int(order[rng.choice(keep, p=head / head.sum())])
