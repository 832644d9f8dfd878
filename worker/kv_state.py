"""Copying one sequence's KV state out of a llama.cpp context and back in.

A snapshot is taken right after prefill, so it holds the prompt's cells and nothing else;
only the disk write happens later, on another thread. The one-job engine uses sequence 0; the
Conclave (worker/conclave/) any of its sequences.
"""

from __future__ import annotations

import ctypes

import llama_cpp
from llama_cpp import Llama

SEQ = 0


def capture(llama: Llama, seq: int = SEQ) -> bytes:
    ctx = llama.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, seq)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, seq)
    return bytes(memoryview(buffer)[:written])


def restore_into(llama: Llama, seq: int, state: bytes, n_tokens: int) -> bool:
    """Replace sequence `seq`'s cells by `state`'s first `n_tokens`; False leaves it empty."""
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
    source = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
    loaded = llama_cpp.llama_state_seq_set_data(llama.ctx, source, len(state), seq) != 0
    if not loaded or not llama_cpp.llama_memory_seq_rm(mem, seq, n_tokens, -1):
        llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
        return False
    return True


def restore(llama: Llama, state: bytes, tokens: list[int], n_tokens: int) -> bool:
    """Load `state` (covering `tokens`), keep its first `n_tokens`; False leaves memory empty.

    Cutting the tail is only correct for models whose memory allows it (plain attention); the
    cache never hands a longer state to any other model.
    """
    llama.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)
    # Points into the bytes object itself: no copy of a state that can be tens of MB.
    source = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
    if llama_cpp.llama_state_seq_set_data(llama.ctx, source, len(state), SEQ) == 0:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)
        return False
    if n_tokens < len(tokens):
        mem = llama_cpp.llama_get_memory(llama.ctx)
        if not llama_cpp.llama_memory_seq_rm(mem, SEQ, n_tokens, -1):
            llama_cpp.llama_memory_clear(mem, True)
            return False
    llama.input_ids[:n_tokens] = tokens[:n_tokens]
    llama.n_tokens = n_tokens
    return True
