"""Jobs over the Conclave: what `worker.engine.Engine` does for one job, for many at once.

Each job runs on its own thread (worker/conclave/worker.py). It tokenizes, submits streams to
the Conclave and turns the tokens it gets back into text, usage and timings, exactly as the
one-job engine does; only the model thread touches the model's memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from llama_cpp import Llama

from shared.errors import CacheDisabled
from shared.llm import tokenize_parts
from shared.prefix_cache import PrefixCache
from shared.prefix_usage import document_prefix_id, prefix_id
from shared.schemas import JobResult, Timings, Usage, WarmOrder, WarmResult, WorkOrder
from worker.conclave.loop import Conclave
from worker.conclave.streams import (
    WARM,
    Ended,
    Event,
    Failed,
    Sampling,
    Started,
    StreamHandle,
    StreamRequest,
)
from worker.engine import (
    Decoded,
    Generation,
    OnToken,
    TextSink,
    end_text,
    prompt_breaks,
    warm_result,
    warm_target,
)
from worker.prefix_saver import PrefixSaver
from worker.resume import text_stream

# How often a warm job that waits for its prefill asks whether it was cancelled.
WARM_POLL_S = 1.0


class StreamFailed(RuntimeError):
    """The model thread could not serve a stream (its error is the cause)."""


def expect(event: Event | None) -> Event | None:
    """Raise what the model thread reported instead of an event."""
    if isinstance(event, Failed):
        raise StreamFailed(str(event.error)) from event.error
    return event


def wait_started(handle: StreamHandle) -> Started:
    event = expect(handle.next())
    assert isinstance(event, Started), event
    return event


class ConclaveEngine:
    """The interface `worker.tasks.Runtime` uses, with jobs served side by side."""

    # Warm jobs need not step aside: their prefill is interleaved like any other.
    warm_yields = False
    speculator = None

    def __init__(
        self,
        llama: Llama,
        conclave: Conclave,
        n_ctx: int,
        chunk_tokens: int,
        cache_for: Callable[[str | None], PrefixCache | None],
        cache: PrefixCache | None,
        saver: PrefixSaver | None,
    ) -> None:
        self.llama = llama
        self.conclave = conclave
        self.n_ctx = n_ctx  # the per-request limit; the pool is the conclave's
        self.chunk_tokens = chunk_tokens
        self.cache_for = cache_for
        self.cache = cache
        self._saver = saver

    def close(self) -> None:
        self.conclave.close()
        if self._saver is not None:
            self._saver.close()

    def forget(self) -> None:
        """A failed stream's sequence is dropped by the model thread itself."""

    def generate(
        self,
        order: WorkOrder,
        on_token: OnToken,
        streamed: Sequence[int] = (),
        priority: int = 0,
    ) -> Generation:
        started = time.perf_counter()
        tokens, boundary = tokenize_parts(self.llama, order.prompt)
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
        )
        sink = TextSink(self.llama, text, decoded, max_tokens, on_token)
        handle = self.conclave.handle(request, lambda event: sink.push(event.token))
        with self.conclave.submit(handle):
            begun = wait_started(handle)
            ended = _wait_ended(handle)
        end_text(text, decoded, on_token)
        if ended.reason == "stop" and decoded.finish_reason == "length":
            decoded.finish_reason = "stop"  # the model's end-of-generation token
        usage = usage.model_copy(
            update={
                "cached_tokens": min(begun.cached_tokens, len(tokens)),
                "completion_tokens": decoded.count,
            }
        )
        timings = decoded.timings(started, begun.prefill_started, begun.restore_ms, ended.at)
        generation = _generation(decoded, usage, boundary, timings)
        return replace(generation, reproducible=not ended.drifted)

    def warm(self, order: WarmOrder, should_stop: Callable[[], bool]) -> WarmResult:
        """Compute a prefix into the cache (see Engine.warm), at the lowest priority."""
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
        if self._saver is not None:
            self._saver.flush()  # "warmed" means a request arriving now finds it on disk
        return warm_result(target.end, cached, reached)


def _document(order: WorkOrder, boundary: int | None) -> tuple[str, int] | None:
    """The document prefix a generation job's prompt starts with, named for routing."""
    if order.document is None or boundary is None:
        return None
    return document_prefix_id(order.document, order.cache_namespace), boundary


def _wait_ended(handle: StreamHandle) -> Ended:
    event = expect(handle.next())
    assert isinstance(event, Ended), event
    return event


def _wait_prefilled(handle: StreamHandle, should_stop: Callable[[], bool]) -> int:
    """Wait for a prefill-only stream's end; cancel it when `should_stop`. Returns the cells
    it reached."""
    while True:
        event = expect(handle.next(timeout=WARM_POLL_S))
        if isinstance(event, Ended):
            return event.position
        if event is None and should_stop():
            handle.cancel()


def _generation(
    decoded: Decoded, usage: Usage, boundary: int | None, timings: Timings | None = None
) -> Generation:
    return Generation(
        result=JobResult(text=decoded.text, finish_reason=decoded.finish_reason),
        usage=usage,
        timings=timings or Timings(),
        prefix_tokens=boundary,
    )
