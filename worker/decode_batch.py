"""A llama_batch's lifetime and filling, shared by every decoder that builds batches by hand."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import llama_cpp


@contextlib.contextmanager
def llama_batch(capacity: int) -> Iterator[llama_cpp.llama_batch]:
    batch = llama_cpp.llama_batch_init(capacity, 0, 1)
    try:
        yield batch
    finally:
        llama_cpp.llama_batch_free(batch)


def fill_batch(
    batch: llama_cpp.llama_batch,
    pieces: Sequence[tuple[int, int, int]],
    logits: bool | Sequence[bool],
) -> None:
    """Put (token, position, sequence) triples into `batch`, asking logits for all, none, or
    the rows `logits` marks."""
    for i, (token, pos, seq) in enumerate(pieces):
        batch.token[i] = token
        batch.pos[i] = pos  # type: ignore[call-overload]  # stub says array of arrays
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits if isinstance(logits, bool) else logits[i]
    batch.n_tokens = len(pieces)
