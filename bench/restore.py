"""Where a restore's time goes: reading a blob, checking it, loading it into llama.cpp; and
what the snapshot a save starts with costs the model thread.

A ~3,000-token Qwen2.5-Coder-0.5B state is saved to a cache directory on this machine's disk and
restored as a worker does, with its file in the page cache. Each step is timed on its own,
beside two plain copies of the same bytes: the floor a restore could approach.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.prefix_cache import document
from shared.llm import load_llama
from shared.prefix_cache import PrefixCache
from shared.prefix_cache.blobs import DirectoryBlobStore
from shared.prefix_cache.format import blob_key, blob_name, decode_blob
from shared.prefix_cache.keys import prefix_key
from shared.settings import Settings
from worker import kv_state

N_TOKENS = 3000
BASE_TOKENS = 1536  # the delta row: the state's first half stored as its base
FINGERPRINT = "bench-restore"


def _ms(step: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median and fastest of `rounds` timings, in ms."""
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        step()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), min(samples)


def section(settings: Settings, cache_dir: Path, rounds: int) -> str:
    llama = load_llama(settings)
    try:
        text = document(90, seed=90).encode()
        tokens = llama.tokenize(text, add_bos=True, special=True)[:N_TOKENS]
        llama.eval(tokens[:BASE_TOKENS])  # whole batches: the same cells as one eval of all
        base_state, _ = kv_state.capture(llama)
        llama.eval(tokens[BASE_TOKENS:])
        state, _ = kv_state.capture(llama)
        block = settings.cache.block_tokens
        store = DirectoryBlobStore(cache_dir)
        cache = PrefixCache(store, FINGERPRINT, block_tokens=block)
        assert cache.save(tokens, state)
        key = blob_key(FINGERPRINT, blob_name(len(tokens), prefix_key(tokens, block, FINGERPRINT)))
        blob = store.get(key)
        assert blob is not None
        decoded = decode_blob(blob, FINGERPRINT)
        assert decoded is not None
        loaded = decoded[2]
        prompt = [*tokens, 0]  # the blob is this prompt's restorable prefix, whole

        def whole() -> None:
            hit = cache.lookup(prompt)
            assert hit is not None and kv_state.restore_into(
                llama, kv_state.SEQ, hit.state, hit.n_tokens
            )

        deltas = PrefixCache(store, f"{FINGERPRINT}-delta", block_tokens=block)
        assert deltas.save(tokens[:BASE_TOKENS], base_state) and deltas.save(tokens, state)
        smallest = min(e.bytes for e in deltas.entries())
        assert smallest < len(state) * 0.6, "the state was not stored as a delta"
        composed_hit = deltas.lookup(prompt)
        assert composed_hit is not None and composed_hit.state == state

        def composed() -> None:
            hit = deltas.lookup(prompt)
            assert hit is not None and kv_state.restore_into(
                llama, kv_state.SEQ, hit.state, hit.n_tokens
            )

        _, kept = kv_state.capture(llama)
        saves = _saves(store, block, tokens, base_state, state, rounds)
        rows = {
            "snapshot: `kv_state.capture` into a new buffer": lambda: kv_state.capture(llama),
            "snapshot: `kv_state.capture` into a buffer an earlier one used": lambda: (
                kv_state.capture(llama, buffer=kept)
            ),
            "read: `DirectoryBlobStore.get`": lambda: store.get(key),
            "check: `format.decode_blob` (header, tokens, payload digest)": lambda: decode_blob(
                blob, FINGERPRINT
            ),
            "load: `kv_state.restore_into` (`llama_state_seq_set_data`)": lambda: (
                kv_state.restore_into(llama, kv_state.SEQ, loaded, len(tokens))
            ),
            "**whole restore**: `PrefixCache.lookup` + `kv_state.restore_into`": whole,
            f"**whole restore of a delta** on a {BASE_TOKENS}-token base (two blobs read, "
            "composed into one state)": composed,
            **_copies(bytes(state), cache_dir / f"{FINGERPRINT}/blobs" / key.rsplit("/", 1)[1]),
        }
        lines = [_row(label, _ms(step, rounds)) for label, step in rows.items()]
        lines += [_row(label, timing) for label, timing in saves.items()]
    finally:
        llama.close()
    return HEADER.format(tokens=len(tokens), mb=len(state) / 1e6, rounds=rounds) + "\n".join(lines)


def _copies(state: bytes, path: Path) -> dict[str, Callable[[], object]]:
    """The floor: the same bytes copied into a buffer that already exists."""
    target = bytearray(path.stat().st_size)
    pointer = (ctypes.c_char * len(state)).from_buffer(target)

    def from_file() -> None:
        with path.open("rb", buffering=0) as f:
            f.readinto(target)

    return {
        "floor: copy of the state in memory (`memmove` into an existing buffer)": lambda: (
            ctypes.memmove(pointer, state, len(state))
        ),
        "floor: read of the blob file from the page cache into an existing buffer": from_file,
    }


def _saves(
    store: DirectoryBlobStore,
    block: int,
    tokens: list[int],
    base_state: bytes | memoryview,
    state: bytes | memoryview,
    rounds: int,
) -> dict[str, tuple[float, float]]:
    """What the saver's thread spends on `PrefixCache.save`: the state as a delta on its
    stored base (a namespace of its own each round, the base saved untimed), and again once
    stored."""
    samples = []
    for i in range(rounds):
        cache = PrefixCache(store, f"{FINGERPRINT}-save-{i}", block_tokens=block)
        assert cache.save(tokens[:BASE_TOKENS], base_state)
        started = time.perf_counter()
        assert cache.save(tokens, state)
        samples.append((time.perf_counter() - started) * 1000)
    label = f"save: `PrefixCache.save` as a delta on a stored {BASE_TOKENS}-token base"
    return {
        f"{label} (read the base, compare the cells, write)": (
            statistics.median(samples),
            min(samples),
        ),
        "save: `PrefixCache.save` of a state stored already": _ms(
            lambda: cache.save(tokens, state), rounds
        ),
    }


def _row(label: str, timing: tuple[float, float]) -> str:
    median, fastest = timing
    return f"| {label} | {median:.1f} | {fastest:.1f} |"


HEADER = """## Prefix cache: where a restore's time goes

One Qwen2.5-Coder-0.5B state of {tokens} tokens ({mb:.1f} MB) saved to a cache directory on this
machine's disk, then restored as a worker does (file in the page cache), each step timed on its
own, {rounds} times; "whole restore" is the lookup and load that a job's `timings.restore_ms`
includes on a hit; "of a delta", the same state stored as its last cells on a base holding the
first ones (shared/prefix_cache/deltas.py). The two floors copy the same bytes into a buffer that already exists: no
restore can beat them. The two "snapshot" rows are the copy a worker makes on its model thread
when it saves a state (worker/prefix_saver.py), into a fresh buffer and into a kept one; the
two "save" rows what its saver thread then spends on a state.

| step | median ms | fastest ms |
|---|---|---|
"""
