"""When a greedy choice made in a batch cannot be trusted to match decoding alone.

llama.cpp's CPU kernels give a row computed in a batch of several tokens slightly different
logits than the same token decoded alone (the matrix kernels pick other code paths by batch
size and sum in another order); docs/BENCHMARKS.md measures that drift per model and batch
size (bench/batch_rows.py). Greedy decoding only notices where the top two logits are closer
than the drift, so on such kernels the Conclave (worker/conclave/loop.py) decides a batched
step whose margin is under TIE_MARGIN by decoding that token again alone: the shape a lone run
uses.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

# 0.5 let a Qwen near tie flip in speculative verification (the one-job engine's, since
# retired); 0.75 passed on all three models. It is not a bound: docs/BENCHMARKS.md measures
# drifts past half of it at 8+ rows on SmolLM2 and Gemma-3, so a tie the batch hid that well
# still goes undetected.
TIE_MARGIN = 0.75


def is_near_tie(logits: npt.NDArray[np.float32], margin: float) -> bool:
    """Whether the two largest logits are less than `margin` apart."""
    if margin <= 0 or logits.size < 2:
        return False
    top = np.partition(logits, -2)[-2:]
    return bool(top[1] - top[0] < margin)
