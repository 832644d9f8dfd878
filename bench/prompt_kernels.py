"""A prompt chunk's kernels: what a short chunk costs on the exact kernels and on the batch ones.

The wheel `make install` builds takes llama.cpp's batch kernels only from 32 rows, so a decode
step of fewer rows is exact (worker/kernels.py). A prompt chunk of fewer tokens would then be
read one row at a time too: a question's tail after a restored document, the last piece of a
prompt past its last 256-token block. granary reads those with the batch kernels at any row
count (deploy/llama-prompt-rows.patch), so short chunks of several streams can share a pass.
Here, after a 700-token prefix, a tail chunk of n tokens is decoded with no logits (as granary
prefills), on both settings of the switch, interleaved, in one process; medians of 15. Then what
reading a prompt's last token in its last chunk saves (worker/conclave/loop.py, `_prompt_end`):
the tail with that token's logits in one pass, against the tail less that token, then the token
alone on the exact kernels. Last, several question tails of unequal lengths after one document,
a sequence each, in one call: as llama.cpp splits such a call (one pass per run of consecutive
sequences and per remaining length, `split_equal`), against the same tails padded to one length
(one pass; the padding's cells removed after).
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
from worker.model import load_model

TAILS = (4, 8, 12, 16, 24, 31, 32)
LAST_TAILS = (12, 40, 110)
PREFIX_TOKENS = 700
REPEATS = 15
# Eight question tails after one document, of the lengths chat questions take (tokens).
TAIL_LENGTHS = (11, 12, 12, 13, 11, 14, 12, 13)
DOCUMENT_TOKENS = 570
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
    last_logits: bool = False,
) -> float:
    """One pass of `tokens[context:context + n]` after the first `context` tokens (no logits,
    as granary prefills, or the last row's), timed; the pass's cells are removed again."""
    mem = llama_cpp.llama_get_memory(llama.ctx)
    tail = [(tokens[context + i], context + i, 0) for i in range(n)]
    with llama_batch(max(n, 1)) as batch:
        fill_batch(batch, tail, [last_logits and i == n - 1 for i in range(n)])
        with kernels:
            started = time.perf_counter()
            if llama_cpp.llama_decode(llama.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            elapsed = time.perf_counter() - started
    llama_cpp.llama_memory_seq_rm(mem, 0, context, -1)
    return elapsed * 1000


def _rows(settings: Settings) -> tuple[list[str], list[str]]:
    llama = load_llama(settings)
    try:
        tokens = llama.tokenize(TEXT.encode(), add_bos=True)
        assert len(tokens) >= PREFIX_TOKENS + max(*TAILS, *LAST_TAILS), (
            "the bench text is too short"
        )
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
        return rows, [_last_row(settings.model, llama, tokens, n) for n in LAST_TAILS]
    finally:
        llama.close()


def _last_row(model: str, llama: Llama, tokens: list[int], n: int) -> str:
    """A prompt tail of n tokens, its last with logits: one pass on the prompt-chunk kernels,
    against the rest then the last token alone on the exact kernels (as where prompt rows read
    otherwise by pass); and that token alone on the prompt-chunk kernels (a restore up to it)."""
    one: list[float] = []
    two: list[float] = []
    lone_exact: list[float] = []
    lone_prompt: list[float] = []
    before = PREFIX_TOKENS + n - 1
    for _ in range(REPEATS):
        one.append(tail_ms(llama, tokens, PREFIX_TOKENS, n, prompt_chunk_kernels(), True))
        rest = tail_ms(llama, tokens, PREFIX_TOKENS, n - 1, prompt_chunk_kernels())
        _read(llama, tokens, PREFIX_TOKENS, before)  # the rest's cells, untimed this time
        lone_exact.append(tail_ms(llama, tokens, before, 1, nullcontext(), True))
        two.append(rest + lone_exact[-1])
        lone_prompt.append(tail_ms(llama, tokens, before, 1, prompt_chunk_kernels(), True))
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llama.ctx), 0, PREFIX_TOKENS, -1)
    o, t = statistics.median(one), statistics.median(two)
    e, a = statistics.median(lone_exact), statistics.median(lone_prompt)
    return f"| {model} | {n} | {t:.1f} | {o:.1f} | {o - t:+.1f} | {e:.1f} | {a:.1f} |"


def _read(llama: Llama, tokens: list[int], start: int, end: int) -> None:
    with llama_batch(end - start) as batch, prompt_chunk_kernels():
        fill_batch(batch, [(tokens[p], p, 0) for p in range(start, end)], logits=False)
        if llama_cpp.llama_decode(llama.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")


def _tails_row(settings: Settings) -> str:
    """TAIL_LENGTHS tails on sequences 1..8 after the document in each, read in one call three
    ways, interleaved: as they are (consecutive sequences), padded to the longest (one pass),
    and on every other sequence (runs of one). Medians of REPEATS."""
    llama = load_model(settings, 2 * len(TAIL_LENGTHS) + 1)
    mem = llama_cpp.llama_get_memory(llama.ctx)
    try:
        tokens = llama.tokenize(TEXT.encode(), add_bos=True)
        for start in range(0, DOCUMENT_TOKENS, 256):  # canonical chunks, within n_batch
            _read(llama, tokens, start, min(start + 256, DOCUMENT_TOKENS))
        seqs = range(1, 2 * len(TAIL_LENGTHS) + 1)
        for seq in seqs:
            llama_cpp.llama_memory_seq_cp(mem, 0, seq, -1, -1)
        longest = max(TAIL_LENGTHS)
        ways: dict[str, list[float]] = {"split": [], "padded": [], "gaps": []}
        for _ in range(REPEATS):
            for way, times in ways.items():
                step = 2 if way == "gaps" else 1
                lengths = [longest] * len(TAIL_LENGTHS) if way == "padded" else TAIL_LENGTHS
                rows = [
                    (tokens[DOCUMENT_TOKENS + i], DOCUMENT_TOKENS + i, 1 + k * step)
                    for k, n in enumerate(lengths)
                    for i in range(n)
                ]
                times.append(_timed_read(llama, rows))
                for seq in seqs:
                    llama_cpp.llama_memory_seq_rm(mem, seq, DOCUMENT_TOKENS, -1)
    finally:
        llama.close()
    split, padded, gaps = (statistics.median(t) for t in ways.values())
    return (
        f"| {settings.model} | {', '.join(map(str, TAIL_LENGTHS))} | {split:.1f} | "
        f"{padded:.1f} | {gaps:.1f} | {split - padded:+.1f} |"
    )


def _timed_read(llama: Llama, rows: list[tuple[int, int, int]]) -> float:
    with llama_batch(len(rows)) as batch, prompt_chunk_kernels():
        fill_batch(batch, rows, logits=False)
        started = time.perf_counter()
        if llama_cpp.llama_decode(llama.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return (time.perf_counter() - started) * 1000


def section(models: list[Settings]) -> str:
    if exact_rows() is None:
        return HEADER.split("\n", 1)[0] + (
            "\n\nNot measured: the installed llama-cpp-python has no `granary_exact_rows` "
            "switch (run `make install`).\n"
        )
    tables = [_rows(settings) for settings in models]
    return (
        HEADER
        + "\n".join(row for chunks, _ in tables for row in chunks)
        + LAST_HEADER
        + "\n".join(row for _, last in tables for row in last)
        + TAILS_HEADER
        + "\n".join(_tails_row(settings) for settings in models)
        + "\n"
    )


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

LAST_HEADER = """

A prompt's last token, whose row gives the first token. Where a prompt row reads alike in any
pass (the start-up checks) and states can be cut (not Gemma-3's sliding window), granary reads
it in the prompt's last chunk, as llama-server does; elsewhere after the chunk, alone, on the
exact kernels. After the same prefix, a tail of n tokens both ways, and the last token alone on
either kernels (what a prompt pays whose restore reached that token: a repeated one), medians
of 15, interleaved.

| model | tail tokens | tail, then the last token alone, ms | in one pass, ms | difference ms | last token alone, exact kernels, ms | the same, prompt-chunk kernels, ms |
|---|---|---|---|---|---|---|
"""

TAILS_HEADER = """

Question tails beside each other: an extraction's questions, or chats about one document
arriving together, read their tails in one call, a sequence each. With a KV buffer per sequence
llama.cpp splits such a call into one pass per run of consecutive sequence ids and per length
left (`split_equal`), each reading every weight again. After a document of 570 tokens in each
sequence, eight tails of the lengths below, in one call, on the prompt-chunk kernels: as they
are (sequences 1-8), padded to the longest (one pass; what padding would save, the padding's
cells dropped after), and on every other sequence (each a run of its own), interleaved, medians
of 15.

| model | tail tokens | as llama.cpp splits them, ms | padded to one pass, ms | on every other sequence, ms | padding saves, ms |
|---|---|---|---|---|---|
"""
