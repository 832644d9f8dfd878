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

A second check, `slice_granule`, asks where a restore may end inside a prompt chunk: the
chunk read whole, its cells then cut back to a point inside it and the rest read again, as a
restore from memory or disk and the prefill after it do; the logits after the prompt must be
the whole read's. Where a pass's rows are grouped from its first and a leftover row past the
last whole group takes another kernel (the sdist's repacked weights), the points that hold are
multiples of a granule from the chunk's start; the rest read is MIN_PASS_ROWS long at the
least, as the restores are. The wheel `make install` builds pads a prompt pass's leftover rows
into a group (deploy/llama-prompt-rows.patch): a granule of 1.

A third, `prompt_pieces_share_passes`, asks whether prompt pieces of several sequences may
share one pass: each piece's last logits read together must be those it gets read alone.
llama.cpp cuts such a pass by sequence (`split_equal`), so pieces of unequal lengths, one of a
single row, are read in passes of several shapes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

from shared.prefix_cache.cache import MIN_PASS_ROWS
from shared.prefix_cache.fingerprint import read_json, write_json
from worker.decode_batch import fill_batch, llama_batch
from worker.kernels import prompt_chunk_kernels

log = logging.getLogger(__name__)

T = TypeVar("T")

TEXT = b"Granary keeps what it has read; a shared prefix is computed once and restored after."
# Cells of a sequence past the attention window's padding (256), for `long_cells`.
PAST_PADDED_WINDOW = 260


# The granules `slice_granule` tries, smallest first. Its chunk starts at an odd position, as
# one after a prompt's break may, and is a whole number of the largest granule longer than
# MIN_PASS_ROWS, so its last cut leaves exactly that many rows.
GRANULES = (1, 4, 8, 16, 32)
SLICE_START = 37
SLICE_END = SLICE_START + MIN_PASS_ROWS + 4 * GRANULES[-1]

Logits = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class KernelFacts:
    """What the start-up checks found of this build's kernels on the loaded model."""

    rows_invariant: bool  # `batched_rows_equal_lone`
    granule: int | None = None  # `slice_granule`
    shared_prompt_passes: bool = False  # `prompt_pieces_share_passes`


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
    capacity = max(llama.n_batch, n_seq)
    with llama_batch(capacity) as batch:

        def drop_rows() -> None:
            for _token, pos, seq in rows:
                llama_cpp.llama_memory_seq_rm(mem, seq, pos, -1)

        try:
            # Every sequence's cells in one prefill: batched and lone rows read the same cells.
            cells = [
                (tokens[p % len(tokens)], p, s) for s, n in enumerate(lengths) for p in range(n)
            ]
            for start in range(0, len(cells), capacity):
                read_rows(llama, batch, cells[start : start + capacity], prompt=False)
            alone = []
            for row in rows:
                alone += read_rows(llama, batch, [row], [0], prompt=False)
                drop_rows()
            equal = True
            for count in counts:
                together = read_rows(llama, batch, rows[:count], range(count), prompt=False)
                equal = all(map(np.array_equal, together, alone[:count]))
                drop_rows()
                if not equal:
                    log.info("a step of %d rows differs from its rows decoded alone", count)
                    break
        finally:
            llama_cpp.llama_memory_clear(mem, True)
    elapsed_ms = (time.perf_counter() - started) * 1000
    log.info("%s (%.0f ms)", rows_found(equal), elapsed_ms)
    return equal


def slice_granule(llama: Llama) -> int | None:
    """The smallest of GRANULES at every multiple of which, from a chunk's start, the chunk's
    cells may be cut back and the rest read again with the logits after the prompt unchanged
    (`shared.prefix_cache.restorable_tokens`), or None. Memory is cleared afterwards."""
    if min(llama.n_batch, llama.context_params.n_ubatch) < SLICE_END - SLICE_START:
        return None  # the check's chunk would not be read in one pass, nor would prompt chunks
    started = time.perf_counter()
    text = llama.tokenize(TEXT, add_bos=False)
    tokens = (text * (SLICE_END // len(text) + 1))[: SLICE_END + 1]
    granule = None
    with SliceCheck(llama, tokens) as check:
        whole = check.read(SLICE_START)
        for g in GRANULES:
            # The latest first: each read leaves the cells before its cut as read whole.
            cuts = (SLICE_END - MIN_PASS_ROWS, SLICE_START + 3 * g, SLICE_START + g)
            if all(np.array_equal(check.read(cut), whole) for cut in cuts):
                granule = g
                break
            check.read(SLICE_START)  # the chunk whole again: a failed read left its cells
    elapsed_ms = (time.perf_counter() - started) * 1000
    log.info("%s (%.0f ms)", granule_found(granule), elapsed_ms)
    return granule


class SliceCheck:
    """Sequence 0 holding `tokens` but the last, the chunk from SLICE_START read whole."""

    def __init__(self, llama: Llama, tokens: list[int]) -> None:
        self._llama, self._tokens = llama, tokens
        self._mem = llama_cpp.llama_get_memory(llama.ctx)
        self._batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)

    def __enter__(self) -> SliceCheck:
        try:
            read_rows(self._llama, self._batch, self._rows(0, SLICE_START))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)
        llama_cpp.llama_batch_free(self._batch)

    def read(self, cut: int) -> Logits:
        """Cut the cells back to `cut`, read the chunk's rest in one pass as prefill does, then
        the last token alone as the Conclave decodes it: its logits."""
        llama_cpp.llama_memory_seq_rm(self._mem, 0, cut, -1)
        read_rows(self._llama, self._batch, self._rows(cut, SLICE_END))
        last = self._rows(SLICE_END, SLICE_END + 1)
        return read_rows(self._llama, self._batch, last, [0], prompt=False)[0]

    def _rows(self, start: int, end: int) -> list[tuple[int, int, int]]:
        return [(self._tokens[p], p, 0) for p in range(start, end)]


# `prompt_pieces_share_passes`: each sequence's cells before its piece, and the piece's rows.
SHARED_PIECES = ((7, 13), (3, 1), (11, 6))


def prompt_pieces_share_passes(llama: Llama) -> bool:
    """Prompt pieces of SHARED_PIECES' sequences read in one call against each read alone, by
    the logits of each piece's last row; False where the context has too few sequences. Memory
    is cleared afterwards."""
    if llama.context_params.n_seq_max < len(SHARED_PIECES):
        return False
    started = time.perf_counter()
    text = llama.tokenize(TEXT, add_bos=False)

    def rows(seq: int, start: int, end: int) -> list[tuple[int, int, int]]:
        return [(text[(seq + p) % len(text)], p, seq) for p in range(start, end)]

    before = [r for seq, (cells, _n) in enumerate(SHARED_PIECES) for r in rows(seq, 0, cells)]
    pieces = [rows(seq, cells, cells + n) for seq, (cells, n) in enumerate(SHARED_PIECES)]
    mem = llama_cpp.llama_get_memory(llama.ctx)
    with llama_batch(sum(cells + n for cells, n in SHARED_PIECES)) as batch:
        try:
            read_rows(llama, batch, before)
            alone = []
            for piece in pieces:
                alone += read_rows(llama, batch, piece, [len(piece) - 1])
                for seq, (cells, _n) in enumerate(SHARED_PIECES):
                    llama_cpp.llama_memory_seq_rm(mem, seq, cells, -1)
            ends = [end - 1 for end in itertools.accumulate(len(p) for p in pieces)]
            together = read_rows(llama, batch, [r for piece in pieces for r in piece], ends)
            equal = all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))
        finally:
            llama_cpp.llama_memory_clear(mem, True)
    elapsed_ms = (time.perf_counter() - started) * 1000
    log.info("%s (%.0f ms)", shared_found(equal), elapsed_ms)
    return equal


def read_rows(
    llama: Llama,
    batch: llama_cpp.llama_batch,
    rows: list[tuple[int, int, int]],
    ends: Iterable[int] = (),
    *,
    prompt: bool = True,
) -> list[Logits]:
    """Decode `rows` in one call, as a prompt chunk is or (not `prompt`) in the kernels' current
    mode (a decode step's, outside `prompt_chunk_kernels`); the logits of the rows at `ends`."""
    ends = list(ends)
    fill_batch(batch, rows, logits=False)
    for end in ends:
        batch.logits[end] = True
    with prompt_chunk_kernels() if prompt else contextlib.nullcontext():
        if llama_cpp.llama_decode(llama.ctx, batch) != 0:
            raise RuntimeError("a decode of a start-up check failed")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama.model))
    return [
        np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(llama.ctx, end), shape=(n_vocab,)
        ).copy()
        for end in ends
    ]


def remembered(
    record: Path,
    key: str,
    check: Callable[[], T],
    valid: Callable[[object], bool],
    found: Callable[[T], str],
) -> T:
    """`check()`'s answer for `key`, computed once and kept in `record` (a JSON object of key
    to answer); a kept answer `valid` refuses is computed again, one it accepts is logged as
    `found` says. `key` must name everything the answer depends on. A record that cannot be
    read or written only costs running the check again."""
    known = read_json(record)
    if key in known and valid(known[key]):
        answer = cast(T, known[key])
        log.info("%s (%s)", found(answer), record)
        return answer
    answer = check()
    # Read again: another worker of this host may have kept an answer while this one checked.
    write_json(record, {**read_json(record), key: answer})
    return answer


def rows_found(equal: bool) -> str:
    return f"row check: batched rows {'equal' if equal else 'differ from'} lone rows"


def granule_found(granule: int | None) -> str:
    return f"slice check: restores may end every {granule} tokens inside a chunk"


def shared_found(equal: bool) -> str:
    together = "share passes" if equal else "are read one pass each"
    return f"shared pass check: prompt pieces of several sequences {together}"
