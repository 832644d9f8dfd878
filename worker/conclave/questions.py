"""An extraction job over the Conclave: the document's prefix held once, questions forked.

The prefix (instructions + document) is a prefill-only stream that stays held while the job's
questions run; each question is a stream whose prompt starts with that prefix, so the Conclave
copies the held cells into the question's sequence instead of computing them again, and the
questions decode in the same steps as every other job's tokens.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from llama_cpp import Llama

from shared.errors import ContextOverflow
from shared.llm import document_prompts
from shared.prefix_usage import document_prefix_id
from shared.schemas import ExtractOrder
from worker.answers import Answering, Finish, QuestionEnd
from worker.conclave.loop import Conclave
from worker.conclave.streams import (
    Ended,
    Event,
    Started,
    StreamHandle,
    StreamRequest,
    Token,
    expect,
    wait_started,
)
from worker.outcomes import Extracted, extraction_outcome
from worker.prompt_breaks import chunk_breaks
from worker.resume import NOTHING, Streamed
from worker.sampling import Sampling
from worker.token_publisher import TokenPublisher


class DoesNotFit(ContextOverflow):
    """A question's own tokens and answer cannot fit in a sequence next to the prefix."""

    def __init__(self, question: int, overflow: int) -> None:
        super().__init__(
            f"question {question} does not fit in the context next to the shared prefix: "
            f"{overflow} tokens too many"
        )
        self.question = question
        self.overflow = overflow


@dataclass
class _Run:
    """One sample of one question as it decodes."""

    index: int  # the question's, in the order's questions
    sample: int
    tokens: list[int] = field(default_factory=list)
    first_at: float | None = None
    last_at: float | None = None


def extract(
    conclave: Conclave,
    llama: Llama,
    n_ctx: int,
    order: ExtractOrder,
    publisher: TokenPublisher,
    streamed: Streamed = NOTHING,
    priority: int = 0,
) -> Extracted:
    """Answer every question of `order`; `n_ctx` is what one request may hold."""
    started = time.perf_counter()
    prefix, tails = document_prompts(llama, order.document, [q.question for q in order.questions])
    for index, tail in enumerate(tails):
        overflow = len(prefix) + len(tail) + order.max_tokens - n_ctx
        if overflow > 0:
            raise DoesNotFit(index, overflow)
    head = [*prefix, *tails[0]]
    document = (document_prefix_id(order.document, order.cache_namespace), len(prefix))
    hold = StreamRequest(
        head,
        chunk_breaks(len(prefix), limit=len(head) - 1),
        order.cache_namespace,
        priority,
        max_new=0,
        end=len(prefix),
        hold=True,
        document=document,
    )
    with conclave.submit(conclave.handle(hold)) as held:
        cached = min(wait_started(held).cached_tokens, len(prefix))
        expect(held.next())  # the prefix is in memory
        prefilled = time.perf_counter()
        prompt_tokens = [len(prefix) + len(t) for t in tails]
        offset_ms = (prefilled - started) * 1000
        answering = Answering(llama, order, publisher, prompt_tokens, cached, offset_ms, streamed)
        runs = [_Run(i, s) for i, s in answering.open_samples()]
        with contextlib.ExitStack() as stack:
            draws = _Draws(conclave, order, answering, (prefix, tails, priority), runs, stack)
            draws.run(release_prefix=held.close)
    return extraction_outcome(order, answering, prefix, tails, cached, started, prefilled, streamed)


class _Draws:
    """Which samples of an extraction's questions are drawn, and when: each a stream of its
    own, all sharing one event queue.

    One sample per question: all drawn at once. A voted question starts with the fewest
    samples that could decide it (`Ballot.needed`) and draws more only while its vote is open:
    the first of them reads the question, the others fork its cells, and the later ones find
    them in memory, where the cells of a stream that just ended are the last to be taken
    (worker/conclave/memory.py). A question whose answer is final stops its other samples.
    """

    def __init__(
        self,
        conclave: Conclave,
        order: ExtractOrder,
        answering: Answering,
        prompt: tuple[list[int], list[list[int]], int],
        runs: list[_Run],
        stack: contextlib.ExitStack,
    ) -> None:
        self._conclave, self._order, self._answering = conclave, order, answering
        self._prompt, self._runs, self._stack = prompt, runs, stack
        self._events: queue.SimpleQueue[tuple[StreamHandle, Event]] = queue.SimpleQueue()
        self._started = time.perf_counter()
        # A question's samples not yet drawn, by their tags (their place in `runs`).
        self._pending: dict[int, list[int]] = {}
        for tag, run in enumerate(runs):
            self._pending.setdefault(run.index, []).append(tag)
        self._streams: dict[int, list[StreamHandle]] = {i: [] for i in self._pending}
        self._live = dict.fromkeys(self._pending, 0)

    def run(self, release_prefix: Callable[[], None]) -> None:
        """Draw and settle every question; `release_prefix` once no later draw needs the held
        prefix: its sequence then serves other streams (its cells stay in memory for reuse) and
        moves aside, where it held up other jobs' questions and split their steps."""
        voted = self._order.samples > 1
        for index in self._pending:
            self._draw(index, self._answering.needed(index) if voted else 1)
        unstarted = None if voted else len(self._runs)  # a vote may draw again: keep it
        while any(self._live.values()):
            handle, event = self._events.get()
            if isinstance(expect(event), Started):
                if unstarted is not None:
                    unstarted -= 1
                    if unstarted == 0:  # every question has its own copy of the prefix
                        release_prefix()
                continue
            if not isinstance(event, Ended):
                continue
            run = self._runs[handle.tag]
            self._live[run.index] -= 1
            if _on_end(self._answering, run, event, self._started):
                self._settle(run.index)
            elif self._live[run.index] == 0 and self._answering.cancelled:
                self._answering.abandon(run.index)
                self._settle(run.index)
            elif self._live[run.index] == 0:
                self._draw(run.index, self._answering.needed(run.index))

    def _draw(self, index: int, count: int) -> None:
        pending = self._pending[index]
        assert pending, "an open vote with no sample left to draw"
        prefix, tails, priority = self._prompt
        for tag in pending[:count]:
            run = self._runs[tag]
            request = _request(self._order, self._answering, prefix, tails, run, priority)
            on_token = partial(_on_token, self._answering, run)
            handle = self._conclave.handle(request, on_token, self._events, tag=tag)
            self._streams[index].append(self._stack.enter_context(self._conclave.submit(handle)))
            self._live[index] += 1
        del pending[:count]

    def _settle(self, index: int) -> None:
        for other in self._streams[index]:
            other.cancel()


def _request(
    order: ExtractOrder,
    answering: Answering,
    prefix: list[int],
    tails: list[list[int]],
    run: _Run,
    priority: int,
) -> StreamRequest:
    """A sample's stream. Sample 0 carries on from what an earlier attempt streamed; a voted
    question's sample 0 is greedy. Sample s of question i draws with seed + i + s x questions."""
    i = run.index
    resumed = answering.streamed.of(order.questions[i].id) if run.sample == 0 else []
    tokens = [*prefix, *tails[i], *resumed]
    # As a generation job resumes: its streamed tokens start a chunk after the prompt.
    resumed_from = len(prefix) + len(tails[i]) - 1 if resumed else None
    seed = (order.seed + i + run.sample * len(order.questions)) % 2**32
    greedy = order.samples > 1 and run.sample == 0
    return StreamRequest(
        tokens,
        chunk_breaks(len(prefix), resumed_from, limit=len(tokens) - 1),
        order.cache_namespace,
        priority,
        max_new=answering.budget(i, run.sample),
        sampling=Sampling(0.0 if greedy else order.temperature, order.top_p, seed),
        speculation=order.speculation,
    )


def _on_token(answering: Answering, run: _Run, event: Token) -> bool:
    """Model thread: a sample's token goes out at once; True stops the sample."""
    run.tokens.append(event.token)
    run.first_at = run.first_at or event.at
    run.last_at = event.at
    return answering.on_token(run.index, run.sample, event.token)


def _on_end(answering: Answering, run: _Run, event: Ended, t0: float) -> bool:
    """Job thread: pass a sample's end on; True when its question's answer is final."""
    finish: Finish = "length" if event.reason == "length" else "stop"
    answering.drifted = answering.drifted or event.drifted
    answering.drafted += event.drafted
    answering.accepted += event.accepted
    ttft = ((run.first_at or event.at) - t0) * 1000
    rate = None
    if run.first_at and run.last_at and run.last_at > run.first_at:
        rate = (len(run.tokens) - 1) / (run.last_at - run.first_at)
    return answering.on_end(run.index, run.sample, QuestionEnd(run.tokens, finish, ttft, rate))
