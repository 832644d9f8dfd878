"""The engine every job runs on: generation, extraction and warm jobs as Conclave streams.

Each job runs on its own thread (worker/worker.py ConclaveWorker); `max_active_jobs = 1` is
the same engine with one job at a time. A job tokenizes, submits streams to the Conclave and
turns the tokens it gets back into text, usage and timings; only the model thread touches the
model's memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

from llama_cpp import Llama

from shared.errors import CacheDisabled, ContextOverflow
from shared.llm import render_warm, tokenize_parts
from shared.prefix_cache import PrefixCache
from shared.prefix_usage import document_prefix_id, prefix_id
from shared.schemas import (
    ExtractOrder,
    JobResult,
    Timings,
    Usage,
    WarmOrder,
    WarmResult,
    WorkOrder,
)
from worker.answers import Decoded, OnToken, TextSink, end_text
from worker.conclave import questions
from worker.conclave.loop import Conclave
from worker.conclave.streams import (
    WARM,
    Ended,
    StreamHandle,
    StreamRequest,
    expect,
    wait_ended,
    wait_started,
)
from worker.outcomes import Extracted, Generation, speculation_report, warm_result
from worker.prefix_saver import PrefixSaver
from worker.prompt_breaks import prompt_breaks
from worker.resume import NOTHING, Streamed, text_stream
from worker.sampling import Sampling
from worker.token_publisher import TokenPublisher

# How often a warm job waiting for its prefill asks whether it should stop (cancelled, or
# stepping aside): a stop takes effect at the next chunk end after that.
WARM_POLL_S = 0.1


class ConclaveEngine:
    """The interface `worker.tasks.Runtime` uses: generate, extract, warm."""

    def __init__(
        self,
        llama: Llama,
        conclave: Conclave,
        n_ctx: int,
        cache: PrefixCache | None,
        saver: PrefixSaver | None,
    ) -> None:
        self.llama = llama
        self.conclave = conclave
        self.n_ctx = n_ctx  # the per-request limit; the pool is the conclave's
        self.cache = cache
        self.saver = saver

    def close(self) -> None:
        self.conclave.close()
        if self.saver is not None:
            self.saver.close()

    def forget(self) -> None:
        """Write pending snapshots and drop what memory holds idle: the next job starts from
        the disk cache or cold, as after a restart."""
        if self.saver is not None:
            self.saver.flush()
        self.conclave.forget()

    def generate(
        self,
        order: WorkOrder,
        on_token: OnToken,
        streamed: Sequence[int] = (),
        priority: int = 0,
    ) -> Generation:
        """Answer `order`; `streamed`: tokens an earlier attempt published, taken as given."""
        started = time.perf_counter()
        tokens, boundary = tokenize_parts(self.llama, order.prompt)
        # Streamed tokens are prefilled after the prompt, which ends a chunk as it would alone.
        held = [*tokens, *streamed]
        resumed_from = len(tokens) - 1 if streamed else None
        max_tokens = min(order.max_tokens, self.n_ctx - len(tokens))
        text = text_stream(self.llama, order.stop, streamed)
        decoded = Decoded(count=len(streamed))
        usage = Usage(prompt_tokens=len(tokens), resumed_tokens=len(streamed))
        if text.stopped or decoded.count >= max_tokens:  # the earlier attempt got that far
            decoded.finish_reason = "stop" if text.stopped else "length"
            end_text(text, decoded, on_token)
            return _generation(decoded, usage, boundary)
        request = StreamRequest(
            held,
            prompt_breaks(self.llama, tokens, boundary, resumed_from, limit=len(held) - 1),
            order.cache_namespace,
            priority,
            max_new=max_tokens - decoded.count,
            sampling=Sampling(order.temperature, order.top_p, order.seed),
            document=_document(order, boundary),
            declared=boundary is not None,
            speculation=order.speculation,
        )
        sink = TextSink(self.llama, text, decoded, max_tokens, on_token)
        handle = self.conclave.handle(request, lambda event: sink.push(event.token))
        with self.conclave.submit(handle):
            begun = wait_started(handle)
            ended = wait_ended(handle)
        end_text(text, decoded, on_token)
        if ended.reason == "stop" and decoded.finish_reason == "length":
            decoded.finish_reason = "stop"  # the model's end-of-generation token
        usage = usage.model_copy(
            update={
                "cached_tokens": min(begun.cached_tokens, len(tokens)),
                "completion_tokens": decoded.count,
            }
        )
        timings = decoded.timings(
            started, begun.prefill_started, begun.restore_ms, ended.at, begun.choice
        )
        generation = _generation(decoded, usage, boundary, timings)
        speculation = speculation_report(order.speculation, ended.drafted, ended.accepted)
        return replace(generation, reproducible=not ended.drifted, speculation=speculation)

    def extract(
        self,
        order: ExtractOrder,
        publisher: TokenPublisher,
        streamed: Streamed = NOTHING,
        priority: int = 0,
    ) -> Extracted:
        """Answer every question about one document (worker/conclave/questions.py)."""
        return questions.extract(
            self.conclave, self.llama, self.n_ctx, order, publisher, streamed, priority
        )

    def warm(self, order: WarmOrder, should_stop: Callable[[], bool]) -> WarmResult:
        """Compute a prefix and write its state to the cache, unless it is there already.

        A document is computed up to its end, anything else up to its last-but-one token:
        exactly the state a later request restores in full. It is read at the lowest priority;
        once `should_stop` says so (cancelled, or another job needs its room) it stops at the
        next chunk end and reports how far it got: its cells stay in memory, where running it
        again resumes.
        """
        if self.cache is None:
            raise CacheDisabled("the prefix cache is disabled: there is nowhere to warm into")
        target = warm_target(self.llama, order, self.n_ctx)
        request = StreamRequest(
            target.tokens,
            target.breaks,
            order.cache_namespace,
            WARM,
            max_new=0,
            end=target.end,
            # Warmed, the document is in memory too: its next question is best served here.
            document=None
            if order.item.document is None
            else (prefix_id(order.item, order.cache_namespace), target.end),
            declared=target.declared,
        )
        with self.conclave.submit(self.conclave.handle(request)) as handle:
            cached = min(wait_started(handle).cached_tokens, target.end)
            reached = _wait_prefilled(handle, should_stop)
        if self.saver is not None:
            self.saver.flush()  # "warmed" means a request arriving now finds it on disk
        return warm_result(target.end, cached, reached)


class WarmTarget(NamedTuple):
    """A warm job's tokens, where its state ends, and its chunk ends (see prompt_breaks)."""

    tokens: list[int]
    end: int
    breaks: tuple[int, ...]
    declared: bool


def warm_target(llama: Llama, order: WarmOrder, n_ctx: int) -> WarmTarget:
    """A document's end, else the last-but-one token (what a later request restores whole)."""
    tokens, boundary = tokenize_parts(llama, render_warm(llama, order.item))
    if len(tokens) >= n_ctx:
        raise ContextOverflow(f"the prefix is {len(tokens)} tokens; n_ctx is {n_ctx}")
    limit = len(tokens) - 1
    breaks = prompt_breaks(llama, tokens, boundary, limit=limit)
    if boundary is None:
        return WarmTarget(tokens, limit, breaks, declared=False)
    return WarmTarget(tokens, boundary, breaks, declared=True)


def _document(order: WorkOrder, boundary: int | None) -> tuple[str, int] | None:
    """The document prefix a generation job's prompt starts with, named for routing."""
    if order.document is None or boundary is None:
        return None
    return document_prefix_id(order.document, order.cache_namespace), boundary


def _wait_prefilled(handle: StreamHandle, should_stop: Callable[[], bool]) -> int:
    """Wait for a prefill-only stream's end, asking `should_stop` at its start and then every
    WARM_POLL_S until it says so: then cancel it. Returns the cells it reached."""
    stopping = False
    while True:
        if not stopping and should_stop():
            handle.cancel()
            stopping = True
        event = expect(handle.next(timeout=WARM_POLL_S))
        if isinstance(event, Ended):
            return event.position


def _generation(
    decoded: Decoded, usage: Usage, boundary: int | None, timings: Timings | None = None
) -> Generation:
    return Generation(
        result=JobResult(text=decoded.text, finish_reason=decoded.finish_reason),
        usage=usage,
        timings=timings or Timings(),
        prefix_tokens=boundary,
    )
