"""Why prefill runs in canonical chunks: a KV cell depends on the shape of its batch.

The same prompt is prefilled whole and split at various points; the next-token logits are
compared. Restoring a saved state is exact, but a different split changes the numbers, so a
cache that let warm runs split where cold runs do not could change greedy output.
"""

from __future__ import annotations

import numpy as np
from llama_cpp import Llama

from shared.llm import load_llama
from shared.prefix_cache.cache import MIN_PASS_ROWS
from shared.settings import Settings
from worker.conclave.row_check import SLICE_END, SLICE_START, TEXT, SliceCheck, slice_granule
from worker.model import load_model, memory_is_truncatable

SPLITS: tuple[tuple[int, ...], ...] = ((200,), (201,), (100, 300), (256,), (398,), (1,))
# Where the second table cuts a chunk back, in tokens from its start.
RESTORE_POINTS = (4, 6, 12, 13, 96, 128, 140, 152)


def _logits(llama: Llama, tokens: list[int], splits: tuple[int, ...]) -> np.ndarray:
    llama.reset()
    start = 0
    for end in (*splits, len(tokens) - 1):
        llama.eval(tokens[start:end])
        start = end
    llama.eval(tokens[-1:])
    return np.ctypeslib.as_array(llama._ctx.get_logits(), shape=(llama.n_vocab(),)).copy()


def section(models: list[Settings]) -> str:
    rows = []
    text = " ".join(f"Item {i}: a crate of {i * 7 % 13} pears for shop {i % 5}." for i in range(40))
    for settings in models:
        llama = load_llama(settings)
        tokens = llama.tokenize(text.encode(), add_bos=True, special=True)[:400]
        whole = _logits(llama, tokens, ())
        for splits in SPLITS:
            split = _logits(llama, tokens, splits)
            diff = float(np.abs(split - whole).max())
            same = int(split.argmax()) == int(whole.argmax())
            rows.append(
                f"| {settings.model} | {list(splits)} | {diff:.4f} | {'yes' if same else 'NO'} |"
            )
        llama.close()
    return HEADER + "\n".join(rows) + "\n" + _restores(models)


def _restores(models: list[Settings]) -> str:
    """The second table: a chunk read whole, cut back inside it and the rest read again."""
    rows = []
    for settings in models:
        llama = load_model(settings, 1)
        if not memory_is_truncatable(llama):
            rows.append(f"| {settings.model} | – | – | – | – | its memory cannot be cut back |")
            llama.close()
            continue
        granule = slice_granule(llama)
        text = llama.tokenize(TEXT, add_bos=False)
        tokens = (text * (SLICE_END // len(text) + 1))[: SLICE_END + 1]
        with SliceCheck(llama, tokens) as check:
            whole = check.read(SLICE_START)
            for into in RESTORE_POINTS:
                diff = float(np.abs(check.read(SLICE_START + into) - whole).max())
                check.read(SLICE_START)  # the chunk whole again
                left = SLICE_END - SLICE_START - into
                allowed = granule is not None and into % granule == 0 and left >= MIN_PASS_ROWS
                rows.append(
                    f"| {settings.model} | {granule} | {into} | {left} | {diff:.4f} "
                    f"| {'yes' if allowed else 'no'} |"
                )
        llama.close()
    return RESTORE_HEADER + "\n".join(rows) + "\n"


HEADER = """## Why prefill runs in canonical chunks

A 400-token prompt is prefilled in one piece and again split at the points shown (then the
last token alone, as granary always does); the table gives the largest difference between the
two runs' next-token logits. Restoring a saved KV state is itself exact; what differs is the
batch shape each cell was computed in. So granary prefills in chunks that end at multiples of
`cache.block_tokens` and at the last-but-one prompt token, and restores only states that end
where the prompt's own cold prefill would end a chunk, or inside one under the rule of the
second table (docs/ARCHITECTURE.md).

| model | split at | max abs logit difference vs unsplit | same argmax |
|---|---|---|---|
"""


RESTORE_HEADER = f"""
A restore inside a chunk (`bench/chunk_shape.py` with the worker's start-up slice check,
worker/conclave/row_check.py): after a {SLICE_START}-token chunk, a {SLICE_END - SLICE_START}-token one is read
whole with the prompt-chunk kernels, cut back to the point shown and the rest read again, as a
restore from memory or disk and the prefill after it do; then the last token alone. Restores
may end inside a chunk where the rule of `restorable_tokens` says yes: at a multiple of the
granule the check finds on this host and with at least {MIN_PASS_ROWS} tokens left to read.

| model | granule | cut back to (tokens into the chunk) | tokens left to read | max abs logit difference vs whole | a restore may end there |
|---|---|---|---|---|---|
"""
