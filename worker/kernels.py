"""Which CPU kernels a pass takes: a prompt chunk's fastest ones, or a decode step's exact ones.

The wheel `make install` builds (deploy/build-llama-wheel.sh) has llama.cpp's kernels that pick
their code path by the number of rows in a pass take their batched path only from
`granary_exact_rows` rows (32), so a decode step of fewer rows computes every row as it would
alone, bit for bit: what lets the Conclave batch jobs, and speculation verify drafts, exactly.
The exception is llamafile's kernels for Q8_0, Q5_0 and Q4_0 weights on AVX2, whose arithmetic
per output is the lone row's: they keep their batched path from 2 rows.

A prompt chunk needs none of that: with the switch at 0 it takes the batch kernels at any row
count, each row with their arithmetic wherever it stands in the pass (repacked weights' last
rows padded into a group of 4, deploy/llama-prompt-rows.patch), so short chunks of several
streams can share a pass and a restore can end at any token inside a chunk. A lone short chunk
pays a little for it (docs/BENCHMARKS.md, "A prompt chunk's kernels"). Only the thread that
decodes switches it, between passes, so no pass ever sees it change.

Flash attention reads the same switch: a decode pass sums each row over fixed segments of
cells, a prompt chunk's pass in whole tiles (deploy/llama-flash-attn-tiles.patch). A wheel
without the switch (stock, or a build of its own) has nothing to set: its prompt chunks already
take the sdist's thresholds.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import llama_cpp

SYMBOL = "granary_exact_rows"
# Below every threshold: each kernel takes its batched path from one row.
PROMPT_THRESHOLD = 0


@functools.cache
def exact_rows() -> ctypes.c_int | None:
    """The loaded CPU backend's threshold, or None for a wheel built without the switch."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for path in sorted(lib_dir.glob("libggml-cpu.*")):
        # Only the backend llama_cpp loaded (by its soname, libggml-cpu.so.0): a wheel holds
        # each name as a copy, and a copy opened by its path is a second library whose switch
        # no kernel reads.
        try:
            loaded = ctypes.CDLL(path.name, mode=os.RTLD_NOLOAD)
            return ctypes.c_int.in_dll(loaded, SYMBOL)
        except (OSError, ValueError):
            continue
    return None


def exact_row_limit() -> int:
    """The most rows a decode pass may have and still compute each row as alone: below the
    switch's threshold; 1 on a wheel without it (whose kernels batch from 2 rows)."""
    threshold = exact_rows()
    return 1 if threshold is None else threshold.value - 1


def build_stamp() -> str:
    """Which llama.cpp build this process loaded: every library of the wheel by name, size and
    modification time. Two builds of one version (stock and row-invariant) differ here."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    return ";".join(
        f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}"
        for path in sorted(lib_dir.glob("lib*"))
        for stat in (path.stat(),)
    )


@contextlib.contextmanager
def prompt_chunk_kernels() -> Iterator[None]:
    """Passes inside take the batch kernels at any row count: for prompt chunks only."""
    threshold = exact_rows()
    if threshold is None:
        yield
        return
    saved = threshold.value
    threshold.value = PROMPT_THRESHOLD
    try:
        yield
    finally:
        threshold.value = saved
