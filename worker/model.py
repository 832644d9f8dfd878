"""The resident model: loaded once per worker with a KV buffer per sequence, decoded once at
start, and what its memory allows."""

from __future__ import annotations

import contextlib
import logging
import time

import llama_cpp
from llama_cpp import Llama
from llama_cpp import _internals as internals

from shared.llm import load_llama, quiet_native_logs
from shared.settings import Settings
from worker.decode_batch import fill_batch, llama_batch

log = logging.getLogger(__name__)


def load_model(settings: Settings, n_seq: int) -> Llama:
    """A Llama whose context holds `n_seq` sequences, each with a KV buffer of its own of
    `settings.n_ctx` cells (worker/conclave/memory.py says why not one shared buffer).

    Llama.__init__ only sets n_seq_max and kv_unified for embedding contexts, and creates its
    context before returning, so the context is replaced by one built from the same parameters
    with these and its size changed. Only the raw context is used then, never Llama.eval (the
    Llama object still tracks the first context's size).
    """
    if not 1 <= n_seq <= llama_cpp.llama_max_parallel_sequences():
        raise ValueError(f"n_seq must be between 1 and {llama_cpp.llama_max_parallel_sequences()}")
    llama = load_llama(settings)
    params = llama.context_params
    params.n_seq_max = n_seq
    params.kv_unified = False
    params.n_ctx = n_seq * settings.n_ctx
    with quiet_native_logs():
        context = internals.LlamaContext(model=llama._model, params=params, verbose=False)
    previous = llama._ctx
    llama._ctx = llama._stack.enter_context(contextlib.closing(context))
    # Free the first context's KV cache now; closing it again at llama.close() is a no-op.
    previous.close()
    return llama


def warm_up(llama: Llama) -> None:
    """One throwaway decode before the first job, as llama-server makes at start. The weights
    are mapped from the model file, so the first decode after a start takes the page faults of
    every weight it reads (tens of thousands for Qwen2.5-Coder-0.5B) and llama.cpp's first-use
    setup: without this, the first request after a restart paid for them in its time to first
    token.
    The cell is cleared with its data, so no job sees it."""
    started = time.perf_counter()
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    token = max(llama_cpp.llama_vocab_bos(vocab), 0)
    with llama_batch(1) as batch:
        fill_batch(batch, [(token, 0, 0)], logits=True)
        if llama_cpp.llama_decode(llama.ctx, batch) != 0:
            raise RuntimeError("the warm-up decode failed")
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)
    log.info("warmed up in %.0f ms", (time.perf_counter() - started) * 1000)


def memory_is_truncatable(llama: Llama) -> bool:
    """Whether the tail of a sequence's memory can be dropped and the rest stay correct.

    Sliding-window and recurrent memories cannot: cells for earlier positions are already gone
    or folded into a state, and llama_memory_seq_rm still returns true (measured on Gemma-3).
    """
    model = llama.model
    return not (
        llama_cpp.llama_model_n_swa(model) > 0
        or llama_cpp.llama_model_is_recurrent(model)
        or llama_cpp.llama_model_is_hybrid(model)
    )
