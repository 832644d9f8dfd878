"""Flash attention by the rows of a pass, after a long context: where it pays and where it costs.

`flash_attn` is a context setting (the KV cache's layout follows it), so one worker reads every
pass one way. llama.cpp's CPU flash attention tiles only passes of many rows (a pass of fewer
rows walks every cached cell one query row at a time); the wheel `make install` builds tiles
every pass. Here, after a context of C tokens, a pass
of n rows of one sequence is decoded without logits, as granary reads a prompt chunk (a
question's tail after a restored document: a few rows; a canonical chunk: 256), with flash
attention on and off, in two contexts of one process, alternating; medians of 5. One row is a
decode step's cost for one stream beside a long document. Prompt chunks of more than one row
take the prompt-chunk kernels (`worker/kernels.py`); a lone row the exact ones, as granary runs
them.
"""

from __future__ import annotations

import statistics
from contextlib import AbstractContextManager, nullcontext

import llama_cpp
from llama_cpp import Llama

from bench.prompt_kernels import tail_ms
from shared.llm import load_llama
from shared.settings import Settings
from worker.decode_batch import fill_batch, llama_batch
from worker.kernels import prompt_chunk_kernels

CONTEXTS = (700, 3000)
ROWS = (1, 4, 12, 32, 64, 256)
REPEATS = 5
TEXT = " ".join(
    f"Row {i}: {i * 11 % 17} sacks of barley from field {i % 7}, weighed on day {i * 5 % 31}."
    for i in range(420)
)


def _pass_ms(llama: Llama, tokens: list[int], context: int, n: int) -> float:
    """A prompt chunk of n > 1 rows with the kernels granary reads prompts with; a lone row
    (a decode step) with the exact ones."""
    kernels: AbstractContextManager[None] = prompt_chunk_kernels() if n > 1 else nullcontext()
    return tail_ms(llama, tokens, context, n, kernels)


def _read(llama: Llama, tokens: list[int], end: int) -> None:
    """The context, in the canonical 256-token chunks granary reads a prompt in."""
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    for start in range(0, end, 256):
        rows = [(tokens[i], i, 0) for i in range(start, min(start + 256, end))]
        with llama_batch(len(rows)) as batch, prompt_chunk_kernels():
            fill_batch(batch, rows, logits=False)
            if llama_cpp.llama_decode(llama.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")


def _rows(settings: Settings) -> list[str]:
    on = load_llama(settings.model_copy(update={"flash_attn": True}))
    off = load_llama(settings.model_copy(update={"flash_attn": False}))
    try:
        tokens = on.tokenize(TEXT.encode(), add_bos=True)
        assert len(tokens) >= max(CONTEXTS) + max(ROWS), "the bench text is too short"
        lines = []
        for context in CONTEXTS:
            for llama in (on, off):
                _read(llama, tokens, context)
            for n in ROWS:
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(REPEATS):
                    for fa, llama in ((True, on), (False, off)):
                        times[fa].append(_pass_ms(llama, tokens, context, n))
                a, b = statistics.median(times[True]), statistics.median(times[False])
                lines.append(
                    f"| {settings.model} | {context} | {n} | {a:.0f} | {b:.0f} | {a / b:.2f}× |"
                )
        return lines
    finally:
        on.close()
        off.close()


def section(settings: Settings) -> str:
    return HEADER + "\n".join(_rows(settings)) + "\n"


HEADER = """## Flash attention by the rows of a pass

`flash_attn` is a context setting (the KV cache's layout follows it), so a worker reads every
pass one way. After a context of C tokens (read in 256-token chunks), a pass of n rows of that
sequence is decoded without logits, with flash attention on and off, alternating (two contexts
in one process, medians of 5; `bench/attention_rows.py`). One row: a decode step beside a long
document (exact kernels); 4-32 rows: a question's tail after a restored document; 256: a
canonical prefill chunk (both with the prompt-chunk kernels, as granary reads them).
llama.cpp's CPU flash attention tiles a pass's rows from 64 and walks every cached cell one
query row at a time below that; the wheel `make install` builds tiles every pass, the query rows
of every head reading one K/V head in one tile (deploy/llama-flash-attn-tiles.patch).

| model | context tokens | rows | flash attention on ms | off ms | on / off |
|---|---|---|---|---|---|
"""
