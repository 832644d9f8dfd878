"""The resident model: prefill what is not already in memory, then decode token by token.

One Engine per worker process, kept for the process's life. Between jobs the context keeps the
last prompt's KV cells, so a job whose prompt shares a prefix with the previous one re-uses them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llama_cpp
from llama_cpp import Llama

from shared.llm import tokenize
from shared.schemas import JobResult, Timings, Usage, WorkOrder
from worker.text_stream import TextStream

# Called with (completion index, text piece); returns True to stop (the job was cancelled).
OnToken = Callable[[int, str], bool]


@dataclass(frozen=True, slots=True)
class Generation:
    result: JobResult
    usage: Usage
    timings: Timings


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Engine:
    def __init__(self, llama: Llama) -> None:
        self.llama = llama
        model = llama.model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        # Sliding-window and recurrent memories cannot drop a tail and stay correct: their
        # cells for earlier positions are already gone or folded into a state.
        self.truncatable = not (
            llama_cpp.llama_model_n_swa(model) > 0
            or llama_cpp.llama_model_is_recurrent(model)
            or llama_cpp.llama_model_is_hybrid(model)
        )

    @property
    def n_ctx(self) -> int:
        return self.llama.n_ctx()

    def generate(self, order: WorkOrder, on_token: OnToken) -> Generation:
        started = time.perf_counter()
        tokens = tokenize(self.llama, order.prompt)
        reused = self._reuse_memory(tokens)
        max_tokens = min(order.max_tokens, self.n_ctx - len(tokens))
        decoded = self._decode(tokens[reused:], order, max_tokens, on_token, started)
        return Generation(
            result=JobResult(text=decoded.text, finish_reason=decoded.finish_reason),
            usage=Usage(
                prompt_tokens=len(tokens),
                cached_tokens=reused,
                completion_tokens=decoded.count,
            ),
            timings=decoded.timings(),
        )

    def _reuse_memory(self, tokens: list[int]) -> int:
        """Keep the cells shared with the previous prompt; returns how many tokens were kept.

        The last prompt token is always decoded again so sampling gets fresh logits.
        """
        llama = self.llama
        kept = min(common_prefix(llama._input_ids.tolist(), tokens), len(tokens) - 1)
        if kept < llama.n_tokens and not self.truncatable:
            kept = 0
        if kept == 0:
            llama.reset()
        else:
            # Llama.eval drops every cell from n_tokens on before it decodes.
            llama.n_tokens = kept
        return kept

    def _decode(
        self,
        fresh: list[int],
        order: WorkOrder,
        max_tokens: int,
        on_token: OnToken,
        started: float,
    ) -> _Decoded:
        llama = self.llama
        llama.set_seed(order.seed)
        stream = TextStream(stop=order.stop)
        decoded = _Decoded(started=started)
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


@dataclass
class _Decoded:
    started: float
    count: int = 0
    ticks: int = 0
    text: str = ""
    finish_reason: str = "length"
    first_at: float | None = None
    last_at: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        self.ticks += 1
        if self.first_at is None:
            self.first_at = now
        self.last_at = now

    def timings(self) -> Timings:
        if self.first_at is None or self.last_at is None:
            return Timings()
        ttft_ms = (self.first_at - self.started) * 1000
        decode_s = self.last_at - self.first_at
        rate = (self.ticks - 1) / decode_s if self.ticks > 1 and decode_s > 0 else None
        return Timings(prefill_ms=ttft_ms, ttft_ms=ttft_ms, decode_tokens_per_s=rate)
