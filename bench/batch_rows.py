"""What a verified draft costs, and why batched greedy rows are checked for near ties.

After a 700-token prompt, the next 12 tokens are decoded one at a time (plain decoding), then
again as one batch of n rows (speculative verification's shape). For each n: the largest
difference between a row's logits in the batch and the same token's logits decoded alone, and
the time of one pass of n rows against one of a single row (median of 5).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llama_cpp
import numpy as np
from llama_cpp import Llama

from shared.llm import load_llama
from shared.settings import Settings
from worker.multi_sequence import fill_batch, llama_batch

ROWS = (1, 2, 3, 4, 8, 12, 16)
PROMPT_TOKENS = 700
REPEATS = 5


class _Decoder:
    def __init__(self, llama: Llama, batch: llama_cpp.llama_batch) -> None:
        self.llama, self.batch = llama, batch
        self.memory = llama_cpp.llama_get_memory(llama.ctx)

    def decode(self, tokens: Sequence[int], start: int, logits: bool) -> None:
        fill_batch(self.batch, [(t, start + i, 0) for i, t in enumerate(tokens)], logits)
        if llama_cpp.llama_decode(self.llama.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")

    def row(self, i: int) -> np.ndarray:
        pointer = llama_cpp.llama_get_logits_ith(self.llama.ctx, i)
        return np.ctypeslib.as_array(pointer, shape=(self.llama.n_vocab(),)).copy()

    def cut(self, start: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, 0, start, -1)


def _rows(settings: Settings, text: str) -> list[str]:
    llama = load_llama(settings)
    tokens = llama.tokenize(text.encode(), add_bos=True, special=True)[:PROMPT_TOKENS]
    prompt_end = len(tokens) - 1
    with llama_batch(llama.n_batch) as batch:
        dec = _Decoder(llama, batch)
        for start in range(0, prompt_end, 256):
            dec.decode(tokens[start : min(prompt_end, start + 256)], start, logits=False)
        alone, seq = [], [tokens[-1]]
        for i in range(max(ROWS)):
            dec.decode(seq[-1:], prompt_end + i, logits=True)
            alone.append(dec.row(0))
            seq.append(int(alone[-1].argmax()))
        rows, single_ms = [], 0.0
        for n in ROWS:
            dec.cut(prompt_end)
            dec.decode(seq[:n], prompt_end, logits=True)
            diff = max(float(np.abs(dec.row(i) - alone[i]).max()) for i in range(n))
            times = []
            for _ in range(REPEATS):
                dec.cut(prompt_end)
                started = time.perf_counter()
                dec.decode(seq[:n], prompt_end, logits=True)
                times.append(time.perf_counter() - started)
            ms = float(np.median(times)) * 1000
            single_ms = single_ms or ms
            rows.append(
                f"| {settings.model} | {n} | {diff:.4f} | {ms:.1f} | {ms / single_ms:.2f} |"
            )
    llama.close()
    return rows


def section(models: list[Settings]) -> str:
    text = " ".join(
        f"Item {i}: a crate of {i * 7 % 13} pears for shop {i % 5}, sent on day {i * 3 % 29}."
        for i in range(60)
    )
    rows = [row for settings in models for row in _rows(settings, text)]
    return HEADER + "\n".join(rows) + "\n"


HEADER = f"""## Decoding rows in one batch: drift and cost

After a {PROMPT_TOKENS}-token prompt, the next tokens are decoded one at a time, then again as
one batch of n rows — the shape in which speculative decoding verifies a draft of n - 1 tokens
(and extraction decodes n questions). "Drift" is the largest logit difference between a row
computed in the batch and the same token decoded alone; greedy verification decides a row
again alone when its top two logits are closer than `TIE_MARGIN` (worker/near_tie.py). "Pass"
is the median time of one decode call of n rows with logits for all of them; a verified draft
pays only if the tokens it accepts outnumber the pass's cost in single steps.

| model | rows | drift (max abs logit) | pass ms | pass / one row |
|---|---|---|---|---|
"""
