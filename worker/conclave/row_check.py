"""Whether this llama.cpp computes a row decoded beside others exactly as decoded alone.

Stock llama.cpp's CPU kernels pick their code path by the number of rows in a batch
(llamafile's sgemm from 2 rows, repacked weights' gemm from 4, the tiled K-quant path from 8),
so a row decoded beside others gets slightly different logits than alone, and exact batching
has to replay near ties (loop.py). The wheel `make install` builds starts those paths at 32
rows (deploy/build-llama-wheel.sh); then a decode step of fewer rows needs no replay at all.

This checks it on the loaded model instead of trusting the build (another wheel, another CPU, a
model whose weights take another kernel): a step of n rows, one per sequence, must give every
row the logits, bit for bit, that the same token decoded alone gets. The answer depends only on
the build, the CPU's kernels, the model and the check's shape, so a host runs it once for each
such set and keeps the answer in its data directory (`remembered`): a restarted worker does not
spend seconds finding it again.

Sequences hold different numbers of cells. A row whose sequence is short, decoded beside one
past the 256 cells to which llama.cpp pads a step's attention window (`get_n_kv` in
llama-kv-cache.cpp), reads a longer window than alone. With the default attention kernel that
changes nothing, the same on every build of the llama.cpp we pin
(tests/integration/test_row_check.py checks it), so the worker leaves that case out to keep
its start short. Stock flash attention splits a lone row's window among the threads once it
reaches 512 cells, and a row beside other sequences never; the wheel `make install` builds
splits every decode row's window at the same fixed segments, alone or not
(deploy/llama-flash-attn-tiles.patch), so with flash attention the worker checks that case too
(`long_cells`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

from shared.prefix_cache.fingerprint import read_json, write_json
from worker.decode_batch import fill_batch, llama_batch

log = logging.getLogger(__name__)

TEXT = b"Granary keeps what it has read; a shared prefix is computed once and restored after."
# Cells of a sequence past the attention window's padding (256), for `long_cells`.
PAST_PADDED_WINDOW = 260


def row_counts(n_seq: int) -> list[int]:
    """Where stock kernels switch path (2, 3 for ARM's pairs, 4, 8) and the most rows a step
    can hold (one per sequence)."""
    return sorted({n for n in (2, 3, 4, 8, n_seq) if 2 <= n <= n_seq})


def batched_rows_equal_lone(llama: Llama, n_seq: int, long_cells: int = 0) -> bool:
    """Decode steps of every `row_counts(n_seq)` rows against the same rows alone; sequence 0
    holds `long_cells` cells when given. Memory is cleared afterwards."""
    counts = row_counts(n_seq)
    if not counts:
        return True  # no step has two rows
    started = time.perf_counter()
    tokens = llama.tokenize(TEXT, add_bos=False)
    lengths = [1 + seq % 3 for seq in range(n_seq)]
    lengths[0] = max(lengths[0], long_cells)
    # Each sequence's next row: its token and position.
    rows = [(tokens[seq % len(tokens)], lengths[seq], seq) for seq in range(n_seq)]
    mem = llama_cpp.llama_get_memory(llama.ctx)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama.model))
    capacity = max(llama.n_batch, n_seq)
    with llama_batch(capacity) as batch:

        def decode(pieces: list[tuple[int, int, int]], logits: bool) -> None:
            for start in range(0, len(pieces), capacity):
                fill_batch(batch, pieces[start : start + capacity], logits)
                if llama_cpp.llama_decode(llama.ctx, batch) != 0:
                    raise RuntimeError("a decode of the row check failed")

        def logits(row: int) -> npt.NDArray[np.float32]:
            pointer = llama_cpp.llama_get_logits_ith(llama.ctx, row)
            return np.ctypeslib.as_array(pointer, shape=(n_vocab,)).copy()

        def drop_rows() -> None:
            for _token, pos, seq in rows:
                llama_cpp.llama_memory_seq_rm(mem, seq, pos, -1)

        try:
            # Every sequence's cells in one prefill: batched and lone rows read the same cells.
            decode(
                [(tokens[p % len(tokens)], p, s) for s, n in enumerate(lengths) for p in range(n)],
                logits=False,
            )
            alone = []
            for row in rows:
                decode([row], logits=True)
                alone.append(logits(0))
                drop_rows()
            equal = True
            for count in counts:
                decode(rows[:count], logits=True)
                equal = all(np.array_equal(logits(i), alone[i]) for i in range(count))
                drop_rows()
                if not equal:
                    log.info("a step of %d rows differs from its rows decoded alone", count)
                    break
        finally:
            llama_cpp.llama_memory_clear(mem, True)
    elapsed_ms = (time.perf_counter() - started) * 1000
    log.info("row check: batched rows %s lone rows (%.0f ms)", _equal(equal), elapsed_ms)
    return equal


def remembered(record: Path, key: str, check: Callable[[], bool]) -> bool:
    """`check()`'s answer for `key`, computed once and kept in `record` (a JSON object of key
    to answer). `key` must name everything the answer depends on. A record that cannot be read
    or written only costs running the check again."""
    known = read_json(record)
    answer = known.get(key)
    if isinstance(answer, bool):
        log.info("row check: batched rows %s lone rows (%s)", _equal(answer), record)
        return answer
    answer = check()
    # Read again: another worker of this host may have kept an answer while this one checked.
    write_json(record, {**read_json(record), key: answer})
    return answer


def _equal(equal: bool) -> str:
    return "equal" if equal else "differ from"
