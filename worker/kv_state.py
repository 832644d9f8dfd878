"""Copying one sequence's KV state out of a llama.cpp context and back in.

A snapshot holds a sequence's cells up to one of the prompt's snapshot points and nothing past
it; only the disk write happens later, on another thread. The Conclave (worker/conclave/) restores
into any of its sequences (`restore_into`).
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

SEQ = 0


def capture(
    llama: Llama, seq: int = SEQ, buffer: npt.NDArray[np.uint8] | None = None
) -> tuple[memoryview, npt.NDArray[np.uint8]]:
    """Sequence `seq`'s state, copied once, into `buffer` when it is large enough (else a new
    one); returns the state and the buffer holding it. It runs on the model thread between a
    prompt's chunks, so no byte is copied twice: a ctypes array or a bytearray is zeroed first,
    and `bytes()` would copy again. docs/BENCHMARKS.md ("where a restore's time goes") times
    this for a 37 MB Qwen state into a new buffer and into a kept one."""
    ctx = llama.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, seq)
    if buffer is None or len(buffer) < size:
        buffer = np.empty(size, dtype=np.uint8)
    written = llama_cpp.llama_state_seq_get_data(ctx, _pointer(buffer), size, seq)
    return buffer.data[:written], buffer


def _pointer(state: bytes | memoryview | npt.NDArray[np.uint8]) -> ctypes._Pointer[ctypes.c_uint8]:
    """Where `state`'s bytes are, for llama.cpp to read or write: no copy of a state that can
    be tens of MB. Read-only buffers too (a mapped blob), which ctypes alone cannot point into;
    the pointer keeps the buffer alive."""
    return np.frombuffer(state, dtype=np.uint8).ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def restore_into(llama: Llama, seq: int, state: bytes | memoryview, n_tokens: int) -> bool:
    """Replace sequence `seq`'s cells by `state`'s first `n_tokens`; False leaves it empty."""
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
    loaded = llama_cpp.llama_state_seq_set_data(llama.ctx, _pointer(state), len(state), seq) != 0
    if not loaded or not llama_cpp.llama_memory_seq_rm(mem, seq, n_tokens, -1):
        llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
        return False
    return True
