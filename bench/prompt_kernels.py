"""A prompt chunk's kernels: what a short chunk costs on the exact kernels and on the batch ones.

The wheel `make install` builds takes llama.cpp's batch kernels only from 32 rows, so a decode
step of fewer rows is exact (worker/kernels.py). A prompt chunk of fewer tokens would then be
read one row at a time too: a question's tail after a restored document, the last piece of a
prompt past its last 256-token block. granary reads those with the batch kernels at any row
count (deploy/llama-prompt-rows.patch), so short chunks of several streams can share a pass.
Here, after a 700-token prefix, a tail chunk of n tokens is decoded with no logits (as granary
prefills), on both settings of the switch, interleaved, in one process; medians of 15.
"""

from __future__ import annotations

import statistics
import time
from contextlib import AbstractContextManager, nullcontext

import llama_cpp
from llama_cpp import Llama

from shared.llm import load_llama
from shared.settings import Settings
from worker.decode_batch import fill_batch, llama_batch
from worker.kernels import exact_rows, prompt_chunk_kernels

TAILS = (4, 8, 12, 16, 24, 31, 32)
PREFIX_TOKENS = 700
REPEATS = 15
TEXT = " ".join(
    f"Row {i}: {i * 11 % 17} sacks of barley from field {i % 7}, weighed on day {i * 5 % 31}."
    for i in range(120)
)


def tail_ms(
    llama: Llama,
    tokens: list[int],
    context: int,
    n: int,
    kernels: AbstractContextManager[None],
) -> float:
    """One pass of `tokens[context:context + n]` after the first `context` tokens (no logits,
    as granary prefills), timed; the pass's cells are removed again."""
    mem = llama_cpp.llama_get_memory(llama.ctx)
    tail = [(tokens[context + i], context + i, 0) for i in range(n)]
    with llama_batch(max(n, 1)) as batch:
        fill_batch(batch, tail, logits=False)
        with kernels:
            started = time.perf_counter()
            if llama_cpp.llama_decode(llama.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            elapsed = time.perf_counter() - started
    llama_cpp.llama_memory_seq_rm(mem, 0, context, -1)
    return elapsed * 1000


def _rows(settings: Settings) -> list[str]:
    llama = load_llama(settings)
    try:
        tokens = llama.tokenize(TEXT.encode(), add_bos=True)
        assert len(tokens) >= PREFIX_TOKENS + max(TAILS), "the bench text is too short"
        llama.eval(tokens[:PREFIX_TOKENS])
        rows = []
        for n in TAILS:
            exact: list[float] = []
            prompt: list[float] = []
            for _ in range(REPEATS):
                exact.append(tail_ms(llama, tokens, PREFIX_TOKENS, n, nullcontext()))
                prompt.append(tail_ms(llama, tokens, PREFIX_TOKENS, n, prompt_chunk_kernels()))
            e, p = statistics.median(exact), statistics.median(prompt)
            rows.append(
                f"| {settings.model} | {n} | {e:.1f} | {p:.1f} | {p / e:.2f}× | "
                f"{n / p * 1000:.0f} |"
            )
        return rows
    finally:
        llama.close()


def section(models: list[Settings]) -> str:
    if exact_rows() is None:
        return HEADER.split("\n", 1)[0] + (
            "\n\nNot measured: the installed llama-cpp-python has no `granary_exact_rows` "
            "switch (run `make install`).\n"
        )
    return HEADER + "\n".join(row for settings in models for row in _rows(settings)) + "\n"


HEADER = """## A prompt chunk's kernels

The wheel `make install` builds takes llama.cpp's batch kernels only from 32 rows, so a decode
step of fewer rows computes each row as it would alone (what lets the Conclave batch jobs
exactly). A prompt chunk needs no such thing: its values depend on the chunk alone, the same in
every path (canonical chunks). So granary reads prompt chunks with the batch kernels at any row
count (`worker/kernels.py`; repacked weights' rows past the last group of 4 padded into one, the
tiled K-quant path from one row): each row then reads alike whatever shares its pass, and an
extraction's question tails share one. After a 700-token prefix, a chunk of n tokens is
decoded without logits, as granary prefills, with the exact kernels and with the prompt-chunk
kernels, interleaved (`bench/prompt_kernels.py`, medians of 15, `n_threads` as configured).
Chunks of 32 tokens and more take the batch kernels either way; a ratio above 1 is what a
lone short chunk pays for sharing.

| model | chunk tokens | exact kernels ms | prompt-chunk kernels ms | ratio | prompt-chunk tok/s |
|---|---|---|---|---|---|
"""
