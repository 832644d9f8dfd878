"""The resident model: restore what was computed before, prefill the rest, decode.

One Engine per worker process, kept for the process's life. A prompt's prefix comes from the
context's own memory (the previous job's cells) or from the shared on-disk prefix cache,
whichever holds more; only the rest is prefilled, and the new prefix is saved in the background.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import llama_cpp
from llama_cpp import Llama

from shared.errors import CacheDisabled, ContextOverflow
from shared.llm import render_warm, tokenize_parts
from shared.prefix_cache import PrefixCache, common_prefix_len, restorable_tokens
from shared.schemas import (
    FinishReason,
    JobResult,
    SpeculationReport,
    Timings,
    Usage,
    WarmOrder,
    WarmResult,
    WorkOrder,
)
from worker import kv_state
from worker.kernels import prompt_chunk_kernels
from worker.prefix_saver import PrefixSaver
from worker.prompt_breaks import content_breaks
from worker.resume import text_stream
from worker.speculation import Speculator, drafts
from worker.text_stream import TextStream

log = logging.getLogger(__name__)

# Called with (the token a text piece came from, None for text released at the end, the piece);
# returns True to stop (the job was cancelled).
OnToken = Callable[[int | None, str], bool]


@dataclass(frozen=True, slots=True)
class Generation:
    result: JobResult
    usage: Usage
    timings: Timings
    # Where the prompt's declared shared prefix (a document) ends, if it has one.
    prefix_tokens: int | None = None
    speculation: SpeculationReport | None = None
    # False: the output may depend on what ran beside it (worker/conclave/streams.py Ended).
    reproducible: bool = True


@dataclass(frozen=True, slots=True)
class _Prompt:
    tokens: list[int]
    # Extra chunk ends (see prompt_breaks).
    breaks: tuple[int, ...]
    # The breaks hold the end of a declared shared prefix (a document), not the prompt's own.
    declared: bool = True

    @property
    def limit(self) -> int:
        """Prefill stops here: the last prompt token is decoded with the first sample."""
        return len(self.tokens) - 1


def chunk_breaks(*ends: int | None, limit: int) -> tuple[int, ...]:
    return tuple(sorted({end for end in ends if end is not None and 0 < end < limit}))


def prompt_breaks(
    llama: Llama, tokens: list[int], boundary: int | None, *ends: int | None, limit: int
) -> tuple[int, ...]:
    """A prompt's chunk ends besides the block grid: its declared prefix's end, or without
    one, where its own text shows prompts part (worker/prompt_breaks.py); and `ends`."""
    found = (boundary,) if boundary is not None else content_breaks(llama, tokens)
    return chunk_breaks(*found, *ends, limit=limit)


def snapshot_points(
    breaks: Sequence[int],
    start: int,
    end: int,
    *,
    declared: bool,
    truncatable: bool,
    block_tokens: int,
    min_tokens: int,
) -> set[int]:
    """Where a prefill saves states. With a declared prefix, at its end. Else at the first and
    last break (a shared system prompt; a document before its question) and at the prefill's
    end (what the conversation's next turn extends): without breaks, the end alone. For
    memories that cannot be cut back, also the block boundary before the first point, so a
    longer prompt sharing this one's start finds a state it may restore."""
    first = min(breaks, default=end)
    points = {first}
    if not declared:
        points |= {max((b for b in breaks if b <= end), default=end), end}
    if not truncatable:
        points.add(first - first % block_tokens)
    return {p for p in points if start < p <= end and p >= min_tokens}


class Engine:
    def __init__(
        self,
        llama: Llama,
        chunk_tokens: int,
        cache: PrefixCache | None = None,
        saver: PrefixSaver | None = None,
        min_snapshot_tokens: int = 32,
        speculator: Speculator | None = None,
    ) -> None:
        self.llama = llama
        # Prefill chunks end at multiples of this (the cache's block size) and at the prompt's
        # last-but-one token, whatever was restored, so warm and cold runs compute every cell
        # in identically shaped batches and produce identical output.
        self.chunk_tokens = chunk_tokens
        self.cache = cache
        self._namespaced: dict[str, PrefixCache] = {}
        self._namespace: str | None = None
        self._saver = saver
        self._min_snapshot_tokens = min_snapshot_tokens
        self.speculator = speculator
        self.truncatable = memory_is_truncatable(llama)
        # A job's snapshots are cut from one capture after its first token where states can
        # be cut (`_save_cut`); warm jobs and sliding windows capture as the points are reached.
        self._cut_snapshots = self.truncatable
        # Memory cells before this position were computed by canonical chunks, with these
        # extra chunk ends.
        self._prefilled = 0
        self._breaks: tuple[int, ...] = ()

    @property
    def n_ctx(self) -> int:
        return self.llama.n_ctx()

    def close(self) -> None:
        """Finish writing pending snapshots (a stopping worker must not lose them)."""
        if self._saver is not None:
            self._saver.close()

    def forget(self) -> None:
        """Drop everything held in memory: the next job starts cold (or from disk)."""
        self.llama.reset()
        self._prefilled = 0
        self._breaks = ()

    def generate(
        self, order: WorkOrder, on_token: OnToken, streamed: Sequence[int] = ()
    ) -> Generation:
        """Answer `order`; `streamed`: tokens an earlier attempt published, taken as given."""
        started = time.perf_counter()
        cache = self._enter_namespace(order.cache_namespace)
        tokens, boundary = tokenize_parts(self.llama, order.prompt)
        # Streamed tokens are prefilled after the prompt, which ends a chunk as it would alone.
        held = [*tokens, *streamed]
        resumed_from = len(tokens) - 1 if streamed else None
        breaks = prompt_breaks(self.llama, tokens, boundary, resumed_from, limit=len(held) - 1)
        prompt = _Prompt(held, breaks, declared=boundary is not None)
        cached, restore_ms = self._load_prefix(cache, prompt, started)
        prefill_started = time.perf_counter()
        deferred = self._cut_snapshots
        self._prefill(cache, prompt, cached, prompt.limit, save=not deferred)
        points = self._snapshot_points(prompt, cached, prompt.limit) if deferred else set()
        saved = _Once(lambda: self._save_cut(cache, prompt, points))
        max_tokens = min(order.max_tokens, self.n_ctx - len(tokens))
        decoded = self._decode(held, order, max_tokens, on_token, streamed, saved)
        saved()  # a run that ended before its first token
        return Generation(
            result=JobResult(text=decoded.text, finish_reason=decoded.finish_reason),
            usage=Usage(
                prompt_tokens=len(tokens),
                cached_tokens=min(cached, len(tokens)),
                completion_tokens=decoded.count,
                resumed_tokens=len(streamed),
            ),
            timings=decoded.timings(started, prefill_started, restore_ms),
            prefix_tokens=boundary,
            speculation=decoded.speculation,
        )

    def warm(self, order: WarmOrder, should_yield: Callable[[], bool]) -> WarmResult:
        """Compute a prefix and write its state to the cache, unless it is there already.

        A document is computed up to its end, anything else up to its last-but-one token:
        exactly the state a later request restores in full. Between chunks `should_yield` is
        asked whether other work is waiting; if so the job stops at that chunk's end (whose
        state is saved, so running it again resumes there).
        """
        if self.cache is None:
            raise CacheDisabled("the prefix cache is disabled: there is nowhere to warm into")
        target = warm_target(self.llama, order, self.n_ctx)
        prompt = _Prompt(target.tokens, target.breaks, target.declared)
        cached, reached = self.load_prefix(order.cache_namespace, prompt, target.end, should_yield)
        if self._saver is not None:
            self._saver.flush()  # "warmed" means a request arriving now finds it on disk
        return warm_result(target.end, cached, reached)

    def load_document(self, namespace: str | None, tokens: list[int], end: int) -> int:
        """Make memory hold exactly a document prefix `tokens[:end]`; returns the tokens
        restored (from memory or disk)."""
        prompt = _Prompt(tokens, chunk_breaks(end, limit=len(tokens) - 1))
        return self.load_prefix(namespace, prompt, end)[0]

    def load_prefix(
        self,
        namespace: str | None,
        prompt: _Prompt,
        target: int,
        should_yield: Callable[[], bool] | None = None,
    ) -> tuple[int, int]:
        """Make memory hold exactly `prompt.tokens[:target]`, restoring what the cache has.

        `target` is the prompt's declared prefix end (or its last-but-one token). Returns
        (tokens restored, tokens held): fewer than `target` only when `should_yield` stopped it.
        """
        cache = self._enter_namespace(namespace)
        cached, _ = self._load_prefix(cache, prompt, time.perf_counter())
        cached = min(cached, target)
        reached = self._prefill(cache, prompt, cached, target, should_yield)
        # Memory may hold more (a longer prompt's cells, kept for reuse): cut it back.
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.llama.ctx), 0, reached, -1)
        self.llama.n_tokens = reached
        return cached, reached

    def _load_prefix(
        self, cache: PrefixCache | None, prompt: _Prompt, started: float
    ) -> tuple[int, float | None]:
        """Keep or restore the longest usable prefix; returns (tokens held, restore ms)."""
        cached = self._reuse_memory(prompt)
        if cache is None or cached >= prompt.limit:
            return cached, None
        cached = self._restore(cache, prompt, cached)
        return cached, (time.perf_counter() - started) * 1000

    def _enter_namespace(self, namespace: str | None) -> PrefixCache | None:
        """The cache for this job's namespace; memory is never shared across namespaces."""
        if namespace != self._namespace:
            self.forget()
            self._namespace = namespace
        if self.cache is None or namespace is None:
            return self.cache
        if namespace not in self._namespaced:
            self._namespaced[namespace] = self.cache.namespaced(namespace)
        return self._namespaced[namespace]

    def _reuse_memory(self, prompt: _Prompt) -> int:
        """Keep the cells shared with the previous prompt; returns how many tokens were kept.

        Only cells from the previous prefill count (the last prompt token and the generated
        ones were decoded one at a time), under the same rule as restoring from disk.
        """
        llama = self.llama
        common = common_prefix_len(llama._input_ids[: self._prefilled].tolist(), prompt.tokens)
        kept = restorable_tokens(
            common,
            self._prefilled,
            prompt.limit,
            self.chunk_tokens,
            self.truncatable,
            prompt.breaks,
            self._breaks,
        )
        # Memory also holds the previous answer: only a plain-attention memory can drop it.
        if not self.truncatable:
            kept = 0
        if kept == 0:
            self.forget()
        else:
            # Llama.eval drops every cell from n_tokens on before it decodes.
            llama.n_tokens = kept
        return kept

    def _restore(self, cache: PrefixCache, prompt: _Prompt, in_memory: int) -> int:
        """Restore the longest cached prefix from disk if it beats what memory holds."""
        hit = cache.lookup(prompt.tokens, min_tokens=in_memory + 1, breaks=prompt.breaks)
        if hit is None or hit.n_tokens <= in_memory:
            return in_memory
        if kv_state.restore(self.llama, hit.state, prompt.tokens, hit.n_tokens):
            # Restorable only where the stored state's breaks below it are the prompt's.
            self._breaks = tuple(b for b in prompt.breaks if b <= hit.n_tokens)
            return hit.n_tokens
        log.warning("cached state %s did not load into this context; prefilling", hit.key)
        self.forget()
        return 0

    def _prefill(
        self,
        cache: PrefixCache | None,
        prompt: _Prompt,
        start: int,
        end: int,
        should_yield: Callable[[], bool] | None = None,
        save: bool = True,
    ) -> int:
        """Decode prompt tokens [start, end) in canonical chunks; with `save`, snapshot for the
        cache as the points are reached.

        Returns where it stopped: `end`, or an earlier chunk end when `should_yield` said so.
        """
        saving = save and cache is not None
        snapshots = self._snapshot_points(prompt, start, end) if saving else set()
        position = start
        while position < end:
            position = self._eval_chunk(prompt, position, end)
            if position in snapshots or (position < end and should_yield and should_yield()):
                self._snapshot(cache, prompt, position)
                if position not in snapshots:
                    break
        self._prefilled = position
        self._breaks = tuple(b for b in prompt.breaks if b <= position)
        return position

    def _eval_chunk(self, prompt: _Prompt, position: int, end: int) -> int:
        chunk_end = min(
            position - position % self.chunk_tokens + self.chunk_tokens,
            end,
            *(b for b in prompt.breaks if b > position),
        )
        with prompt_chunk_kernels():
            self.llama.eval(prompt.tokens[position:chunk_end])
        return chunk_end

    def _snapshot(self, cache: PrefixCache | None, prompt: _Prompt, end: int) -> None:
        if cache is None or self._saver is None or end < self._min_snapshot_tokens:
            return
        inside = tuple(b for b in prompt.breaks if b < end)
        self._saver.snapshot(cache, self.llama, kv_state.SEQ, prompt.tokens[:end], inside)

    def _save_cut(self, cache: PrefixCache | None, prompt: _Prompt, points: set[int]) -> None:
        """Capture memory once and have the saver cut each point's state from it (after the
        first token: see worker/conclave/loop.py `_save_snapshots`)."""
        points = {p for p in points if p >= self._min_snapshot_tokens}
        if cache is None or self._saver is None or not points:
            return
        held = (prompt.tokens, prompt.breaks)
        if not self._saver.snapshots(cache, self.llama, kv_state.SEQ, held, points):
            self._cut_snapshots = False

    def _snapshot_points(self, prompt: _Prompt, start: int, end: int) -> set[int]:
        if self._saver is None:
            return set()
        return snapshot_points(
            prompt.breaks,
            start,
            end,
            declared=prompt.declared,
            truncatable=self.truncatable,
            block_tokens=self.chunk_tokens,
            min_tokens=self._min_snapshot_tokens,
        )

    def _decode(
        self,
        prompt: list[int],
        order: WorkOrder,
        max_tokens: int,
        on_token: OnToken,
        streamed: Sequence[int],
        after_first: Callable[[], None],
    ) -> Decoded:
        """Sample after `prompt` (memory holds all of it but the last token), whose tail is
        `streamed`: already published, so only fed to the text stream. `after_first` runs once
        the first new token is out."""
        llama = self.llama
        llama.set_seed(order.seed)
        stream = text_stream(llama, order.stop, streamed)
        decoded = Decoded(count=len(streamed))
        if stream.stopped or decoded.count >= max_tokens:  # the earlier attempt got that far
            decoded.finish_reason = "stop" if stream.stopped else "length"
            return end_text(stream, decoded, on_token)
        if self.speculator is None or not drafts(order.speculation, order.temperature):
            tokens = llama.generate(
                prompt[-1:], temp=order.temperature, top_p=order.top_p, reset=False
            )
            try:
                return consume(llama, tokens, stream, decoded, max_tokens, on_token, after_first)
            finally:
                tokens.close()
        left = max_tokens - decoded.count
        with self.speculator.decode(llama, prompt, order, left) as run:
            decoded = consume(llama, iter(run), stream, decoded, max_tokens, on_token, after_first)
        decoded.speculation = run.report()
        return decoded


class _Once:
    """`action` the first time it is called, then nothing."""

    def __init__(self, action: Callable[[], None]) -> None:
        self._action: Callable[[], None] | None = action

    def __call__(self) -> None:
        action, self._action = self._action, None
        if action is not None:
            action()


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


def warm_result(target: int, cached: int, reached: int) -> WarmResult:
    return WarmResult(
        prefix_tokens=target,
        cached_tokens=cached,
        warmed_tokens=max(reached - cached, 0),
        already_cached=cached >= target,
        yielded=int(reached < target),
    )


def consume(
    llama: Llama,
    tokens: Iterator[int],
    stream: TextStream,
    decoded: Decoded,
    max_tokens: int,
    on_token: OnToken,
    after_first: Callable[[], None] = lambda: None,
) -> Decoded:
    """Turn sampled tokens into text pieces for `on_token` until a stop, the end or a cancel;
    `after_first` runs after the first token's."""
    sink = TextSink(llama, stream, decoded, max_tokens, on_token)
    for token in tokens:
        if sink.push(token):
            break
        after_first()
    return end_text(stream, decoded, on_token)


class TextSink:
    """A job's sampled tokens become text, published as they come, up to a stop."""

    def __init__(
        self,
        llama: Llama,
        stream: TextStream,
        decoded: Decoded,
        max_tokens: int,
        on_token: OnToken,
    ) -> None:
        self._llama = llama
        self._vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self._stream = stream
        self.decoded = decoded
        self._max_tokens = max_tokens
        self._on_token = on_token

    def push(self, token: int) -> bool:
        """Take one sampled token; True when no more are wanted."""
        decoded = self.decoded
        decoded.tick()
        if llama_cpp.llama_vocab_is_eog(self._vocab, token):
            decoded.finish_reason = "stop"
            return True
        decoded.count += 1
        piece = self._stream.feed(self._llama.detokenize([token]))
        if self._on_token(token, piece):
            decoded.finish_reason = "cancelled"
            return True
        if self._stream.stopped:
            decoded.finish_reason = "stop"
            return True
        return decoded.count >= self._max_tokens


def end_text(stream: TextStream, decoded: Decoded, on_token: OnToken) -> Decoded:
    """Release the text a stop string held back, and keep the whole text."""
    tail = stream.flush()
    if tail:
        on_token(None, tail)
    decoded.text = stream.text
    return decoded


def memory_is_truncatable(llama: Llama) -> bool:
    """Whether the tail of a sequence's memory can be dropped and the rest stay correct.

    Sliding-window and recurrent memories cannot: cells for earlier positions are already gone
    or folded into a state, and llama_memory_seq_rm still returns true (measured on Gemma-3).
    """
    model = llama.model
    return not (
        llama_cpp.llama_model_n_swa(model) > 0
        or llama_cpp.llama_model_is_recurrent(model)
        or llama_cpp.llama_model_is_hybrid(model)
    )


@dataclass
class Decoded:
    count: int = 0
    ticks: int = 0
    text: str = ""
    finish_reason: FinishReason = "length"
    speculation: SpeculationReport | None = None
    first_at: float | None = None
    last_at: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        self.ticks += 1
        if self.first_at is None:
            self.first_at = now
        self.last_at = now

    def timings(
        self,
        started: float,
        prefill_started: float,
        restore_ms: float | None,
        ended_at: float | None = None,
    ) -> Timings:
        """`ended_at`: when the generation's end was decided; with no token (the first sample
        ended it), the first token's time is that decision's."""
        first_at = self.first_at or ended_at
        if first_at is None:
            return Timings(restore_ms=restore_ms)
        rate = None
        if self.first_at is not None and self.last_at is not None and self.ticks > 1:
            decode_s = self.last_at - self.first_at
            rate = (self.ticks - 1) / decode_s if decode_s > 0 else None
        return Timings(
            restore_ms=restore_ms,
            prefill_ms=(first_at - prefill_started) * 1000,
            ttft_ms=(first_at - started) * 1000,
            decode_tokens_per_s=rate,
        )
