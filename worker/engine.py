"""The resident model: restore what was computed before, prefill the rest, decode.

One Engine per worker process, kept for the process's life. A prompt's prefix comes from the
context's own memory (the previous job's cells) or from the shared on-disk prefix cache,
whichever holds more; only the rest is prefilled, and the new prefix is saved in the background.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp
from llama_cpp import Llama

from shared.llm import tokenize
from shared.prefix_cache import PrefixCache, restorable_tokens
from shared.prefix_keys import common_prefix_len
from shared.schemas import FinishReason, JobResult, Timings, Usage, WorkOrder
from worker import kv_state
from worker.prefix_saver import PrefixSaver
from worker.text_stream import TextStream

log = logging.getLogger(__name__)

# Called with (completion index, text piece); returns True to stop (the job was cancelled).
OnToken = Callable[[int, str], bool]


@dataclass(frozen=True, slots=True)
class Generation:
    result: JobResult
    usage: Usage
    timings: Timings


class Engine:
    def __init__(
        self,
        llama: Llama,
        chunk_tokens: int,
        cache: PrefixCache | None = None,
        saver: PrefixSaver | None = None,
        min_snapshot_tokens: int = 32,
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
        self._vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self.truncatable = memory_is_truncatable(llama)
        # Memory cells before this position were computed by canonical chunks.
        self._prefilled = 0

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

    def generate(self, order: WorkOrder, on_token: OnToken) -> Generation:
        started = time.perf_counter()
        cache = self._enter_namespace(order.cache_namespace)
        tokens = tokenize(self.llama, order.prompt)
        cached = self._reuse_memory(tokens)
        restore_ms = None
        if cache is not None and cached < len(tokens) - 1:
            cached = self._restore(cache, tokens, cached)
            restore_ms = (time.perf_counter() - started) * 1000
        prefill_started = time.perf_counter()
        self._prefill(cache, tokens, cached)
        max_tokens = min(order.max_tokens, self.n_ctx - len(tokens))
        decoded = self._decode(tokens[-1:], order, max_tokens, on_token)
        return Generation(
            result=JobResult(text=decoded.text, finish_reason=decoded.finish_reason),
            usage=Usage(
                prompt_tokens=len(tokens),
                cached_tokens=cached,
                completion_tokens=decoded.count,
            ),
            timings=decoded.timings(started, prefill_started, restore_ms),
        )

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

    def _reuse_memory(self, tokens: list[int]) -> int:
        """Keep the cells shared with the previous prompt; returns how many tokens were kept.

        Only cells from the previous prefill count (the last prompt token and the generated
        ones were decoded one at a time), under the same rule as restoring from disk.
        """
        llama = self.llama
        common = common_prefix_len(llama._input_ids[: self._prefilled].tolist(), tokens)
        kept = restorable_tokens(
            common, self._prefilled, len(tokens) - 1, self.chunk_tokens, self.truncatable
        )
        # Memory also holds the previous answer: only a plain-attention memory can drop it.
        if not self.truncatable:
            kept = 0
        if kept == 0:
            llama.reset()
        else:
            # Llama.eval drops every cell from n_tokens on before it decodes.
            llama.n_tokens = kept
        return kept

    def _restore(self, cache: PrefixCache, tokens: list[int], in_memory: int) -> int:
        """Restore the longest cached prefix from disk if it beats what memory holds."""
        hit = cache.lookup(tokens, min_tokens=in_memory + 1)
        if hit is None or hit.n_tokens <= in_memory:
            return in_memory
        if kv_state.restore(self.llama, hit.state, tokens, hit.n_tokens):
            return hit.n_tokens
        log.warning("cached state %s did not load into this context; prefilling", hit.key)
        self.llama.reset()
        self._prefilled = 0
        return 0

    def _prefill(self, cache: PrefixCache | None, tokens: list[int], cached: int) -> None:
        """Decode the prompt up to its last token in canonical chunks; snapshot for the cache.

        Snapshots end at the last-but-one token (an exact repeat restores all of it) and, for
        memories that cannot be cut back, also at the last block boundary before it (so a
        longer prompt sharing this one's start still finds a usable state).
        """
        end = len(tokens) - 1
        snapshots = self._snapshot_points(cached, end) if cache is not None else set()
        position = cached
        while position < end:
            chunk_end = min(position - position % self.chunk_tokens + self.chunk_tokens, end)
            self.llama.eval(tokens[position:chunk_end])
            position = chunk_end
            if position in snapshots and cache is not None and self._saver is not None:
                self._saver.submit(cache, tokens[:position], kv_state.capture(self.llama))
        self._prefilled = end

    def _snapshot_points(self, cached: int, end: int) -> set[int]:
        if self._saver is None:
            return set()
        points = {end}
        if not self.truncatable:
            points.add(end - end % self.chunk_tokens)
        return {p for p in points if p > cached and p >= self._min_snapshot_tokens}

    def _decode(
        self, fresh: list[int], order: WorkOrder, max_tokens: int, on_token: OnToken
    ) -> _Decoded:
        llama = self.llama
        llama.set_seed(order.seed)
        stream = TextStream(stop=order.stop)
        decoded = _Decoded()
        tokens = llama.generate(fresh, temp=order.temperature, top_p=order.top_p, reset=False)
        try:
            for token in tokens:
                decoded.tick()
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    decoded.finish_reason = "stop"
                    break
                decoded.count += 1
                piece = stream.feed(llama.detokenize([token]))
                if on_token(decoded.count - 1, piece):
                    decoded.finish_reason = "cancelled"
                    break
                if stream.stopped:
                    decoded.finish_reason = "stop"
                    break
                if decoded.count >= max_tokens:
                    break
        finally:
            tokens.close()
        tail = stream.flush()
        if tail:
            on_token(decoded.count, tail)
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
class _Decoded:
    count: int = 0
    ticks: int = 0
    text: str = ""
    finish_reason: FinishReason = "length"
    first_at: float | None = None
    last_at: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        self.ticks += 1
        if self.first_at is None:
            self.first_at = now
        self.last_at = now

    def timings(self, started: float, prefill_started: float, restore_ms: float | None) -> Timings:
        if self.first_at is None or self.last_at is None:
            return Timings(restore_ms=restore_ms)
        decode_s = self.last_at - self.first_at
        rate = (self.ticks - 1) / decode_s if self.ticks > 1 and decode_s > 0 else None
        return Timings(
            restore_ms=restore_ms,
            prefill_ms=(self.first_at - prefill_started) * 1000,
            ttft_ms=(self.first_at - started) * 1000,
            decode_tokens_per_s=rate,
        )
