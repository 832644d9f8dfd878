"""Why prefill runs in canonical chunks: a KV cell depends on the shape of its batch.

The same prompt is prefilled whole and split at various points; the next-token logits are
compared. Restoring a saved state is exact, but a different split changes the numbers, so a
cache that let warm runs split where cold runs do not could change greedy output.
"""

from __future__ import annotations

import numpy as np
from llama_cpp import Llama

from shared.llm import load_llama
from shared.settings import Settings

SPLITS: tuple[tuple[int, ...], ...] = ((200,), (201,), (100, 300), (256,), (398,), (1,))


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
    return HEADER + "\n".join(rows) + "\n"


HEADER = """## Why prefill runs in canonical chunks

A 400-token prompt is prefilled in one piece and again split at the points shown (then the
last token alone, as granary always does); the table gives the largest difference between the
two runs' next-token logits. Restoring a saved KV state is itself exact; what differs is the
batch shape each cell was computed in. So granary prefills in chunks that end at multiples of
`cache.block_tokens` and at the last-but-one prompt token, and restores only states that end
where the prompt's own cold prefill would end a chunk (docs/ARCHITECTURE.md).

| model | split at | max abs logit difference vs unsplit | same argmax |
|---|---|---|---|
"""
